"""Stage 1's output directory, one for its three sources of samples: `extract` (the loaded target
generates the responses), served responses (`extract --responses-from`: a serving engine makes
them, the target captures them) and `import` (captures made elsewhere).

Each source describes itself (`builder.Source`: target, prompts, decoding, and what only it has)
and what its shards hold (`storage.Storage`); the rest is the same for all three:

    storage.py    the tensors stored, their dtypes, the lm_head window and shard chunk sizes
    builder.py    the settings identity a resume compares, the run facts, the new manifest
                  (complete=false) and the finished one (complete=true, totals)
    directory.py  OUT as it is (resumable, refused, or deleted with --overwrite), its lock, OUT
                  prepared (target head, tokenizer, manifest), the writer that resumes a rank's shards
    entries.py    finished shard entries: the samples they account for, the totals (`inspect` too)

Nothing here loads a model or reads a capture: a source hands over its target head's tensors.
"""
