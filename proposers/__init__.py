"""Every way of drafting, behind one interface (interface.py; docs/proposers.md): one folder per
family (dflash/, dflash2/, dspark/, eagle3/, mtp/, ngram/, draft/, suffix/), registered in registry.py; what families
share in toolkit/; checkpoint files, loading and compatibility with the shards in checkpoints/.
Torch-free at this level: stage 1 reads the families' config layouts (layouts.py, <family>/layout.py)."""
