"""DSpark (speculators, SpecForge, DeepSpec): the block drafter drafting from the anchor's own slot, a
Markov head biasing each draft by its predecessor, an optional confidence head cutting the proposal
(docs/drafter-families.md#dspark). layout.py (three layouts), gemma4_layout.py and gemma4.py (DeepSpec's
Gemma 4 DSpark on Gemma 4 block layers), config.py, model.py."""
