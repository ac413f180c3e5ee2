"""Suffix decoding (Oliaro et al., arXiv 2411.04975) as vLLM runs it (method "suffix", over Arctic
Inference's SuffixDecodingCache, arctic-inference 0.3.0): no weights, no hidden states. Suffix trees
count every suffix (up to max_tree_depth tokens) of the request's own prompt and response and of the
responses of earlier requests (a global tree, FIFO over max_cached_requests); after each step the last
tokens are matched in both and the most frequent continuation is drafted while its estimated
probability stays above min_token_prob, as long as max_spec_factor times the match allows. The global
tree is state across requests: the replay serves the samples one at a time in a recorded order.

    layout.py     vLLM's speculative_config of the method, declared (torch-free)
    config.py     its settings in the project's terms; FAMILY
    tree.py       the suffix tree's storage and Arctic's order of a node's children (numba)
    sequences.py  adding a token to the growing sequence, removing a sequence
    speculate.py  one tree's best draft after a context
    cache.py      vLLM's proposer over samples served one after the other: the request's own tree,
                  the global tree, the draft at every response position
    proposer.py   the Proposer: the drafts at every anchor, served in replay order
"""
