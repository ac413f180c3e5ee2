"""Serving engines (llama.cpp's llama-server, vLLM, SGLang) over HTTP, in token ids: what
`extract --responses-from` (pipeline/extract/engines/) asks them for responses with and what
`compare-online` (scoring/online/) asks them for their own speculative-decoding counts with.

    client.py    HTTP with timeouts, retries and backoff; one EngineError line per failure
    schemas.py   the declared shapes of the engines' answers (pydantic)
    dialect.py   Request / Reply / Acceptance and what an engine module provides
    llamacpp.py  llama.cpp's POST /completion (prompt ids, "return_tokens"; timings.draft_n*)
    vllm.py      vLLM's POST /v1/completions (prompt ids, "return_token_ids"; metrics.speculative_decoding)
    sglang.py    SGLang's native POST /generate (input_ids -> output_ids; meta_info.spec_*)
    registry.py  the engines by name; which engine a server is and which model it serves
"""
