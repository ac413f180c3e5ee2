"""DSpark (speculators, SpecForge, DeepSpec): the block drafter drafting from the anchor's own slot, a
Markov head biasing each draft by its predecessor, an optional confidence head cutting the proposal
(docs/drafter-families.md#dspark). layout.py (three layouts), config.py, model.py."""
