"""N-gram lookup (prompt lookup decoding) as vLLM's `ngram` method drafts: no model, no weights, no
hidden states. At each step the proposer finds the longest n-gram (prompt_lookup_min <= n <=
prompt_lookup_max) ending the tokens so far that also occurs earlier, and proposes the (up to)
num_speculative_tokens tokens that followed its earliest occurrence.

    layout.py     vLLM's speculative config of the method, declared (torch-free)
    config.py     its settings in the project's terms; FAMILY
    proposer.py   the lookup at every anchor of the stored responses (a Proposer)
"""
