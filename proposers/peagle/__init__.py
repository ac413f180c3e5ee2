"""P-EAGLE (parallel EAGLE): an EAGLE-3 decoder that drafts its K tokens in one pass, the later ones
from a learned mask token and mask hidden state (speculators 0.9.0 `models/peagle`; vLLM's parallel
drafting). torch-free."""
