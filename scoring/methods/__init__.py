"""Verification methods: how many of a proposer's drafts one target verification step accepts at an
anchor, registered by name (registry.py) and owning their results' method names and columns.

    base.py         what a method is (`Method`) and what it reads of a chunk of drafts
    chain.py        the chain: the leading drafts equal to the stored tokens
    ddtree.py       DDTree: the best-first tree of a budget over the drafts' per-position marginals
                    (ddtree_heap.py its definition, ddtree_kernels.py the same compiled)
    eagle_tree.py   EAGLE's dynamic tree, drafted by the proposer itself (a TreeProposer)
    registry.py     the methods in results order; a name's method and setting; the plan of a run
"""
