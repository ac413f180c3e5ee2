"""N-gram lookup (prompt lookup decoding), as the engines draft without a model: no weights, no
hidden states. vLLM's `ngram` finds the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max)
ending the tokens so far that also occurs earlier and proposes the (up to) num_speculative_tokens
tokens that followed its earliest occurrence; llama-server's `ngram-simple` looks up the last size-n
tokens, takes the latest occurrence and proposes the size-m tokens after it (llama_simple.py).

    layout.py     the engines' configs of the method (vLLM's, llama-server's flags), declared (torch-free)
    config.py     its settings in the project's terms; FAMILY
    proposer.py   vLLM's lookup at every anchor of the stored responses, and the Proposer
    llama_simple.py  llama-server's ngram-simple lookup
"""
