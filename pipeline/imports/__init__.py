"""`specreplay import`: hidden states captured elsewhere, into ordinary checksummed shards.

One module per producer format, one common reader interface, the target's head, the glue:

    reader.py       the interface every format implements (Entry from headers, Captured per
                    sample) and the checks they share (all-zero states, loss masks, layer counts)
    vllm.py         vLLM `extract_hidden_states` files (ExampleHiddenStatesConnector; hs-connectors' FP8)
    speculators.py  speculators data-generation outputs (prepared dataset + hs_<i>.safetensors)
    specforge.py    SpecForge offline captures (data_<i>.ckpt[.gz] torch files)
    layers.py       the producers' layer numbering -> this project's (docs/layer-numbering.md)
    checkpoint.py   the target's facts, final norm and lm_head from its checkpoint, model never loaded
    features.py     one captured sample -> the tensors a shard row stores (features, top-k)
    run.py          the import: plan, output directory and manifest (pipeline/outdir/), stream, finish
    config.py       ImportConfig (torch-free: the CLI's --help reads its defaults)
"""
