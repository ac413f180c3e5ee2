"""A standalone draft model: a smaller causal LM with the target's vocabulary drafting a chain of
greedy tokens with its own KV cache over the tokens so far (llama-server's `--spec-type
draft-simple -md draft.gguf`). No hidden states of the target: shards extracted with
`--layer-ids none` serve it.

    layout.py     llama-server's flags of draft-simple, declared (torch-free)
    config.py     its settings in the project's terms; FAMILY
    proposer.py   the draft model's greedy chain at every anchor, teacher-forced (a Proposer)
"""
