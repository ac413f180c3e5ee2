"""MTP heads: a Qwen3.5 / Qwen3-Next target's native multi-token-prediction head, from the target's
own checkpoint or speculators' export, and a GLM-4.5 or DeepSeek-V3 target's NextN head
(`model.layers.{L}.*`), replayed as a step chain over the target's final hidden state
(docs/drafter-families.md#mtp-heads, #nextn-heads-glm-45-deepseek-v3). layout.py, config.py,
model.py, nextn.py, mla.py, experts.py."""
