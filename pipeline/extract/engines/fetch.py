"""This rank's responses from the engine: each pending item without a given response becomes one
Request, answered from the store when it was fetched before, else by the servers (`concurrency`
requests in flight, item i on server i mod n), checked, stored, and handed on as the Response
the target's forward teacher-forces.

A response is checked before it is stored: its ids lie in the target's vocabulary, and the
server did not cut it with its own limit (context size, n_predict, max_model_len): such a
response is neither the target's full answer nor one that stopped at --max-new-tokens, so the
run stops naming the sample. After the first error nothing more is sent, the requests in flight
finish (and are stored when they succeeded), and the error is raised: a rerun asks only for what
is missing.

Marks (pipeline/extract/generate.py Response): greedy engine responses are greedy=True (the
capture's argmax_mismatch then says per position whether the target's own forward agrees; with
zero mismatches the response is the target's greedy output and its walk is exact), sampled ones
greedy=False; finish "eos" (ends on a target stop token; the engine's tokens after the first one
are dropped), "length" (--max-new-tokens reached) or "engine-eos" (the engine stopped on a token
the target does not stop on: stored as it is, and scored like a response cut at that length).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from pipeline.common.sampling import Sampling
from pipeline.engines.client import EngineError
from pipeline.engines.dialect import Reply, Request
from pipeline.extract.engines.cache import ResponseStore, request_key
from pipeline.extract.engines.probe import Engine
from pipeline.extract.generate import FINISH_EOS, FINISH_LENGTH, Response, draw_seed
from pipeline.extract.plan import Item

FINISH_ENGINE_EOS = "engine-eos"


def requests_for(
    items: list[Item], engine: Engine, max_new_tokens: int, stop_ids: list[int], sampling: Sampling | None, seed: int
) -> list[Request]:
    """One Request per item that has no given response, in item order."""
    return [
        Request(
            sample_id=item.sample_id,
            prompt_ids=item.prompt_ids,
            max_new_tokens=max_new_tokens,
            stop_ids=list(stop_ids),
            sampling=sampling,
            seed=None if item.draw is None else draw_seed(seed, item.prompt_id, item.draw),
            model=engine.model,
        )
        for item in items
        if item.given is None
    ]


def fetch_responses(
    engine: Engine,
    requests: list[Request],
    store: ResponseStore,
    vocab_size: int,
    concurrency: int,
    on_response: Callable[[Request], None] = lambda request: None,
) -> dict[str, Response]:
    """{sample_id: Response} for every request: stored ones as they are, the rest fetched."""
    keys = {r.sample_id: request_key(r, engine.dialect.name) for r in requests}
    found = {r.sample_id: store.get(r.sample_id, keys[r.sample_id]) for r in requests}
    todo = [r for r in requests if found[r.sample_id] is None]
    for request in requests:
        if found[request.sample_id] is not None:
            on_response(request)

    def take(request: Request, reply: Reply) -> None:
        finish = finish_reason(reply, request, vocab_size)
        found[request.sample_id] = store.add(request.sample_id, keys[request.sample_id], reply.token_ids, finish)
        on_response(request)

    try:
        fetched(engine, todo, concurrency, take)
    finally:
        store.flush()
    greedy = all(r.sampling is None for r in requests)
    return {sid: Response(list(s.token_ids), s.finish_reason, greedy) for sid, s in found.items()}


def fetched(engine: Engine, requests: list[Request], concurrency: int, take: Callable[[Request, Reply], None]) -> None:
    """take(request, reply) for every request as its reply arrives, `concurrency` in flight (the
    next one is sent when one returns). After the first EngineError (a failed request, or `take`
    refusing a reply) nothing more is sent, those in flight are still taken, and that error is
    raised. Ctrl-C does not wait for requests in flight."""
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="engine")
    queue = iter(enumerate(requests))
    in_flight: dict = {}

    def send_next() -> None:
        for i, request in queue:
            in_flight[pool.submit(ask, engine, engine.clients[i % len(engine.clients)], request)] = request
            return

    first = None
    try:
        for _ in range(max(1, concurrency)):
            send_next()
        while in_flight:
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                request = in_flight.pop(future)
                try:
                    take(request, future.result())
                except EngineError as error:
                    first = first or error
                if first is None:
                    send_next()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    if first is not None:
        raise first


def ask(engine: Engine, client, request: Request) -> Reply:
    path, body = engine.dialect.generation(request)
    return engine.dialect.reply(client.post(path, body), client.url + path, request)


def finish_reason(reply: Reply, request: Request, vocab_size: int) -> str:
    """The stored finish reason, after the checks of the module docstring (EngineError)."""
    if reply.cut is not None:
        raise EngineError(
            f"sample {request.sample_id!r}: the serving engine cut its response at {reply.cut}, before "
            f"--max-new-tokens {request.max_new_tokens} or a stop token; raise the server's limit (llama.cpp "
            f"--ctx-size / --n-predict, vLLM --max-model-len) or lower --max-new-tokens"
        )
    bad = [t for t in reply.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(
            f"sample {request.sample_id!r}: the serving engine returned token id {bad[0]}, outside the target's "
            f"vocabulary (0..{vocab_size - 1}); serve the target's own model"
        )
    stops = set(request.stop_ids)
    first_stop = next((i for i, t in enumerate(reply.token_ids) if t in stops), None)
    if first_stop is not None:
        del reply.token_ids[first_stop + 1 :]
        return FINISH_EOS
    if not reply.token_ids:
        raise EngineError(f"sample {request.sample_id!r}: the serving engine returned an empty response")
    return FINISH_ENGINE_EOS if reply.stopped and len(reply.token_ids) < request.max_new_tokens else FINISH_LENGTH
