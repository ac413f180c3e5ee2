"""`specreplay compare-online`: the offline walk beside what a serving engine reports, per request.

engine_log.py   llama-server's per-step lines (LLAMA_TRACE=1): accepted/drafted per verification step
requests.py     the stored prompts sent to the engine one at a time, its response and its own counts
verdicts.py     one sample's offline steps against the engine's, and what a difference points at
run.py          reads the results and shards, asks the engine, gathers the rows and the summary
"""
