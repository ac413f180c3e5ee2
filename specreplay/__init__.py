"""specreplay's composition root: the console script and its subcommands.

Stage 1 (`pipeline/`: extract, the shard format) and stage 2 (`scoring/`: replay, metrics,
results) never import this package; it imports them lazily, inside each command.
"""
