"""What the proposer families share, none of them owning it: the neural proposer (neural.py), the
block drafter (block_drafter.py) and the step chain (step_chain.py) families build on, attention,
decoder layers, the output head, reduced vocabularies, conventions, tie-ranked top-k, and the
torch-free layout pieces several families' config layouts declare."""
