"""A standalone draft model: a smaller causal LM with the target's vocabulary drafting a chain of
greedy tokens with its own KV cache over the tokens so far (llama-server's `--spec-type
draft-simple -md draft.gguf`, vLLM's method "draft_model"). No hidden states of the target: shards
extracted with `--layer-ids none` serve it.

    layout.py     llama-server's flags of draft-simple and vLLM's draft_model config, declared (torch-free)
    config.py     its settings in the project's terms; FAMILY
    checks.py     what is read of the model before it loads: its directory, size and vocabulary
    vocabulary.py the engines' rules for a draft model's vocabulary against the target's
    vocab_mapping.py vLLM's heterogeneous vocabulary: another tokenizer mapped by token text
    proposer.py   the draft model's greedy chain at every anchor, teacher-forced (a Proposer)
    pard.py       vLLM's parallel drafting (PARD): K drafts from one pass over K - 1 mask tokens
"""
