"""DFlash2 (z-lab and speculators `DFlash2DraftModel`): the block drafter with grouped dynamic
convolutions around each sublayer and a candidate selector reranking each draft by its predecessor
(docs/drafter-families.md#dflash2). layout.py, config.py, model.py."""
