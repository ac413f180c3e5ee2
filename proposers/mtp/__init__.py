"""MTP heads: a Qwen3.5 / Qwen3-Next target's native multi-token-prediction head, from the target's
own checkpoint or speculators' export, replayed as a step chain over the target's final hidden state
(docs/drafter-families.md#mtp-heads). layout.py, config.py, model.py."""
