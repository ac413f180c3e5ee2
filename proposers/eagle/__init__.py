"""EAGLE-1/2 (and HASS, which trains the same format): one Llama decoder over fc([embedding ; the
target's last hidden state]), the target's lm_head on its un-normed output, chained step by step;
EAGLE-2 is the same drafter under sglang's dynamic tree (the EAGLE repository, PyPI `eagle-llm`;
vLLM and SGLang method "eagle"). torch-free."""
