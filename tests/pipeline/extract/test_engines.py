"""The pieces of `extract --responses-from` against tiny real HTTP servers on 127.0.0.1 (no model):
retries and the one error line (client.py), the checks before anything is written (probe.py),
the response store (cache.py), the finish reasons and refusals of fetch.py, and each engine's
request and answer fields (llamacpp.py, vllm.py, sglang.py). The real llama.cpp server:
test_served.py."""

from __future__ import annotations

import json

import pytest

from pipeline import shards
from pipeline.common.sampling import Sampling
from pipeline.engines.client import Client, EngineError, Retry, Unreachable
from pipeline.engines.dialect import Reply, Request
from pipeline.engines.llamacpp import LlamaCpp
from pipeline.engines.sglang import Sglang
from pipeline.engines.vllm import Vllm
from pipeline.extract.engines.cache import ResponseStore, request_key
from pipeline.extract.engines.fetch import FINISH_ENGINE_EOS, finish_reason
from pipeline.extract.engines.probe import connect
from tests.helpers.models import make_tokenizer
from tests.helpers.serving import FakeServer, free_port, llamacpp_like

FAST = Retry(timeout=5, retries=2, backoff=0.01)


def ok(obj) -> callable:
    return lambda body: (200, json.dumps(obj).encode())


@pytest.fixture
def fake():
    servers = []

    def make(routes, default=None):
        server = FakeServer(routes, default) if default else FakeServer(routes)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def request(**overrides) -> Request:
    fields = dict(
        sample_id="q1", prompt_ids=[5, 6], max_new_tokens=8, stop_ids=[2], sampling=None, seed=None, model="m"
    )
    return Request(**{**fields, **overrides})


# ---------------------------------------------------------------- client.py


def test_a_server_answering_500_is_tried_again_then_one_line(fake):
    server = fake({}, default=lambda body: (500, b'{"error": {"message": "out of memory"}}'))
    with pytest.raises(EngineError, match=r"answered HTTP 500 3 times: out of memory"):
        Client(server.url, FAST).post("/completion", {})
    assert len(server.hits) == 3  # the first try and two retries


def test_garbage_is_not_tried_again(fake):
    server = fake({}, default=lambda body: (200, b"<html>hello</html>"))
    with pytest.raises(EngineError, match="not JSON.*OpenAI-compatible server"):
        Client(server.url + "/v1/", FAST).get("/v1/models")  # a base URL ending in /v1 works too
    assert server.hits == ["GET /v1/models"]


def test_a_closed_port_is_unreachable():
    with pytest.raises(Unreachable, match=r"is unreachable \(.*3 tries\); start the server"):
        Client(f"http://127.0.0.1:{free_port()}", FAST).get("/v1/models")


def test_a_4xx_quotes_the_server_and_is_not_retried(fake):
    server = fake({}, default=lambda body: (400, b'{"error": {"message": "prompt too long"}}'))
    with pytest.raises(EngineError, match=r"refused the request \(HTTP 400\): prompt too long"):
        Client(server.url, FAST).post("/completion", {})
    assert len(server.hits) == 1


# ---------------------------------------------------------------- probe.py


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_connect_names_engine_and_model(fake, tokenizer):
    server = fake(llamacpp_like(tokenizer))
    engine = connect([server.url], "auto", None, tokenizer, len(tokenizer), ["hello there"], FAST)
    assert (engine.dialect.name, engine.model) == ("llama.cpp", "smol")
    assert engine.facts(None)["sampling_rule"].startswith("llama.cpp samplers [temperature] at 0")


def test_connect_refuses_a_model_the_server_does_not_serve(fake, tokenizer):
    server = fake(llamacpp_like(tokenizer))
    with pytest.raises(EngineError, match=r"does not serve model 'qwen' \(it serves 'smol'\)"):
        connect([server.url], "auto", "qwen", tokenizer, len(tokenizer), ["hi"], FAST)


def test_connect_refuses_another_tokenizer(fake, tokenizer):
    server = fake(llamacpp_like(tokenizer, shift=1))
    with pytest.raises(EngineError, match="tokenizes differently from the target.*first different at position 0"):
        connect([server.url], "auto", None, tokenizer, len(tokenizer), ["hi"], FAST)


def test_connect_refuses_another_vocabulary_size(fake, tokenizer):
    server = fake(llamacpp_like(tokenizer, n_vocab=151936))
    with pytest.raises(EngineError, match="vocabulary of 151936 tokens, the target"):
        connect([server.url], "auto", None, tokenizer, len(tokenizer), ["hi"], FAST)


def test_connect_asks_for_engine_when_it_cannot_tell(fake, tokenizer):
    server = fake(llamacpp_like(tokenizer, owned_by="acme"))
    with pytest.raises(EngineError, match="owned_by 'acme'.*pass --engine"):
        connect([server.url], "auto", None, tokenizer, len(tokenizer), ["hi"], FAST)
    assert connect([server.url], "llama.cpp", None, tokenizer, len(tokenizer), ["hi"], FAST).dialect.name == "llama.cpp"


# ---------------------------------------------------------------- cache.py


def test_stored_responses_come_back_and_damage_names_the_file(tmp_path):
    store = ResponseStore(str(tmp_path), rank=0, flush_every=2)
    key = request_key(request(), "llama.cpp")
    store.add("q1", key, [7, 8, 2], "eos")
    store.add("q2", key, [9], "length")  # the second response lands the file
    again = ResponseStore(str(tmp_path), rank=0)
    assert again.get("q1", key).token_ids == [7, 8, 2] and again.get("q2", key).finish_reason == "length"
    assert again.get("q1", request_key(request(max_new_tokens=9), "llama.cpp")) is None  # another request
    path = tmp_path / "responses" / "r000-00000.json"
    path.write_text(path.read_text().replace('"q2"', '"q3"'))  # still JSON, another sample id
    with pytest.raises(shards.ShardError, match=r"r000-00000.json is damaged .*delete that file"):
        ResponseStore(str(tmp_path), rank=0)


# ---------------------------------------------------------------- fetch.py


def test_finish_reasons_and_refusals():
    assert finish_reason(Reply([7, 2, 9], True), request(), 100) == "eos"  # cut after the target's stop
    assert finish_reason(Reply([7] * 8, False), request(), 100) == "length"
    assert finish_reason(Reply([7, 0], True), request(), 100) == FINISH_ENGINE_EOS  # stopped on a non-stop token
    with pytest.raises(EngineError, match=r"sample 'q1': the serving engine cut its response at its n_predict"):
        finish_reason(Reply([7], False, "its n_predict limit (1 of 8 tokens)"), request(), 100)
    with pytest.raises(EngineError, match=r"sample 'q1'.*token id 100, outside the target's vocabulary"):
        finish_reason(Reply([100], True), request(), 100)


# ---------------------------------------------------------------- the engines' fields


def test_llamacpp_fields():
    path, body = LlamaCpp().generation(request(sampling=Sampling(0.6, 0.95, 20), seed=2**40 + 5))
    assert path == "/completion" and body["prompt"] == [5, 6] and body["return_tokens"] is True
    assert body["samplers"] == ["temperature", "top_k", "top_p"] and body["seed"] == 5 and body["repeat_penalty"] == 1
    reply = LlamaCpp().reply({"tokens": [7, 7], "stop_type": "limit", "truncated": False}, "u", request())
    assert reply.cut == "its n_predict limit (2 of 8 tokens)"
    with pytest.raises(EngineError, match=r"field 'tokens' is missing|missing field 'tokens'"):
        LlamaCpp().reply({"content": "hi", "stop_type": "eos"}, "u", request())


def test_vllm_and_sglang_fields():
    path, body = Vllm().generation(request())
    assert (path, body["prompt"], body["return_token_ids"], body["top_k"]) == ("/v1/completions", [5, 6], True, -1)
    assert Vllm().reply({"choices": [{"token_ids": [7, 2], "finish_reason": "stop"}]}, "u", request()).stopped
    with pytest.raises(EngineError, match="no token_ids.*0.10.2"):
        Vllm().reply({"choices": [{"token_ids": None, "finish_reason": "stop"}]}, "u", request())
    path, body = Sglang().generation(request(sampling=Sampling(1.0), seed=3))
    assert (path, body["input_ids"], body["sampling_params"]["sampling_seed"]) == ("/generate", [5, 6], 3)
    answer = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}
    assert Sglang().reply(answer, "u", request()).cut == "its context length (1 of 8 tokens)"


def test_fetch_stops_at_the_first_bad_response_and_a_rerun_asks_only_for_the_rest(fake, tmp_path):
    """One request at a time: q2's response is cut by the server, so q3 and q4 are never sent;
    q1 is stored, and the rerun (server fixed) asks for q2, q3 and q4 only."""
    from pipeline.extract.engines.fetch import fetch_responses
    from pipeline.extract.engines.probe import Engine

    cut = {"on": True}

    def completion(body):
        prompt = json.loads(body)["prompt"]
        if prompt == [13] and cut["on"]:
            return 200, json.dumps({"tokens": [5], "stop_type": "limit", "truncated": False}).encode()
        return 200, json.dumps({"tokens": [prompt[0], 2], "stop_type": "eos"}).encode()

    server = fake({("POST", "/completion"): completion})
    engine = Engine(LlamaCpp(), [Client(server.url, FAST)], "m")
    requests = [request(sample_id=f"q{i}", prompt_ids=[9 + 2 * i]) for i in range(1, 5)]
    with pytest.raises(EngineError, match=r"sample 'q2': the serving engine cut its response at its n_predict"):
        fetch_responses(engine, requests, ResponseStore(str(tmp_path), 0), 100, concurrency=1)
    assert len(server.hits) == 2
    cut["on"] = False
    got = fetch_responses(engine, requests, ResponseStore(str(tmp_path), 0), 100, concurrency=2)
    assert len(server.hits) == 5  # q2, q3, q4 only
    assert {sid: (r.token_ids, r.finish_reason, r.greedy) for sid, r in got.items()} == {
        f"q{i}": ([9 + 2 * i, 2], "eos", True) for i in range(1, 5)
    }
