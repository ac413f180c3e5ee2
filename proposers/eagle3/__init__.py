"""EAGLE-3 (speculators "eagle3", SpecForge `LlamaForCausalLMEagle3`): a chain of autoregressive steps
over three target layers (the step chain), and its own dynamic tree as sglang drafts it
(docs/drafter-families.md#eagle-3, docs/eagle-tree.md). layout.py, config.py, model.py, tree.py."""
