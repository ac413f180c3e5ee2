"""DFlash v1 (z-lab `DFlashDraftModel`, speculators "dflash"): a block [x_t, mask, ...] drafted at once
by a small transformer over the target's feature layers; drafts independent given the block (DDTree
applies). layout.py its config layouts, config.py their parsing, model.py the block drafter with Qwen3
layers (docs/drafter-families.md#z-lab-dflash-v1)."""
