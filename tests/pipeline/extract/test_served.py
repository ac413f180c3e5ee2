"""`extract --responses-from` against a real llama.cpp server (`llama-server`, built by `make
setup` from the llama-cpp-python 0.3.36 source package) serving the bundled SmolLM2-135M GGUF,
whose dequantized weights are extract's `--model smollm2` target: greedy responses through a
counting proxy with --concurrency 2 and their argmax mismatches recounted here; the server killed
mid-extract and restarted (nothing fetched twice, shards identical to an uninterrupted run's);
sampled responses; two torchrun ranks on one server; servers that cannot be used, each one
`error:` line with nothing written to the shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline import shards
from pipeline.common.errors import UserError
from pipeline.engines.client import EngineError
from pipeline.extract.config import ExtractConfig
from pipeline.extract.generate import generate_batch
from pipeline.extract.inspect import format_report, inspect_extract
from pipeline.extract.run import run_extract
from pipeline.extract.target import load_target, smollm2_gguf_path
from specreplay.cli import main
from tests.helpers.processes import REPO
from tests.helpers.serving import FakeServer, LlamaServer, Proxy, free_port

pytestmark = pytest.mark.slow

LIMIT, MAX_NEW = 6, 48  # the first 6 default prompts (GSM8K), 48 new tokens each


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = LlamaServer(smollm2_gguf_path(), tmp_path_factory.mktemp("llama") / "server.log").start()
    yield started
    started.stop()


def config(out, url, **more) -> ExtractConfig:
    fields = dict(prompts="default", limit=LIMIT, max_new_tokens=MAX_NEW, out=str(out), quiet=True, concurrency=2)
    return ExtractConfig(**{**fields, "responses_from": [url], **more})


def shard_files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("r*"))}


@pytest.fixture(scope="module")
def uninterrupted(server, target, tmp_path_factory):
    """One greedy extract through a counting proxy: (out dir, proxy, manifest)."""
    out = tmp_path_factory.mktemp("served") / "out"
    proxy = Proxy(server.url)
    manifest = run_extract(config(out, proxy.url), loaded=target)
    yield out, proxy, manifest
    proxy.close()


def recount_mismatches(model, sample) -> int:
    """Positions where the response token is not the argmax of a plain full forward (fp32)."""
    with torch.inference_mode():
        logits = model(sample.input_ids[None]).logits[0]
    predicted = logits[sample.prompt_len - 1 : -1].argmax(-1)
    return int((predicted != sample.input_ids[sample.prompt_len :]).sum())


def test_greedy_responses_from_llama_server(uninterrupted, target):
    out, proxy, manifest = uninterrupted
    model, _, info = target
    asked = proxy.posts("/completion", status=200)
    assert len(asked) == LIMIT and len({tuple(b["prompt"]) for b in asked}) == LIMIT  # each prompt once, as ids
    assert proxy.most_in_flight == 2  # --concurrency 2
    assert manifest["settings"]["responses"]["engine"] == "llama.cpp"
    entries = shards.finished_shard_entries(str(out))
    mismatched = {sid: n for e in entries for sid, n in e.get("mismatched_samples", {}).items()}
    samples = list(shards.ShardSet(str(out)).samples())
    counts = {}
    for sample in samples:
        assert sample.greedy and sample.finish_reason in ("eos", "length")
        counts[sample.sample_id] = recount_mismatches(model, sample)
        assert int(sample.argmax_mismatch.sum()) == counts[sample.sample_id] == mismatched.get(sample.sample_id, 0)
    print(f"\nargmax mismatches per sample (llama.cpp Q4_1 vs the dequantized fp32 target): {counts}")
    exact = [s for s in samples if counts[s.sample_id] == 0]
    own = generate_batch(
        model, [s.input_ids[: s.prompt_len].tolist() for s in exact], MAX_NEW, info.stop_token_ids, info.pad_token_id
    )
    for sample, response in zip(exact, own):  # an exact response is the target's own greedy output
        assert sample.input_ids[sample.prompt_len :].tolist() == response.token_ids
    text = format_report(inspect_extract(str(out)))
    assert "responses       from llama.cpp serving" in text
    assert f"exact walks     {len(exact)} of {LIMIT} greedy samples" in text


def test_server_killed_mid_extract_resumes_without_asking_twice(uninterrupted, target, tmp_path):
    gguf, log = smollm2_gguf_path(), tmp_path / "server.log"
    killed = LlamaServer(gguf, log).start()
    proxy = Proxy(killed.url, after_post=lambda n: killed.stop() if n == 3 else None)
    out = tmp_path / "out"
    try:
        result = CliRunner().invoke(main, cli_args(out, proxy.url, "--retries", "1"))
        assert result.exit_code == 2 and result.output.startswith("error: serving engine"), result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
        assert not list((out / "shards").glob("*.arrow"))  # nothing written to the shards
        fetched_first = len(proxy.posts("/completion", status=200))
        assert 3 <= fetched_first < LIMIT
        print(f"\nserver killed after {fetched_first} of {LIMIT} responses: {result.output.strip()}")
        restarted = LlamaServer(gguf, log, port=killed.port).start()  # same address, new process
        try:
            run_extract(config(out, proxy.url), loaded=target)
        finally:
            restarted.stop()
    finally:
        killed.stop()
        proxy.close()
    answered = Counter(tuple(b["prompt"]) for b in proxy.posts("/completion", status=200))
    assert len(answered) == LIMIT and set(answered.values()) == {1}  # every response fetched exactly once
    print(f"completion requests answered over both runs: {sum(answered.values())} for {LIMIT} prompts")
    assert responses(out) == responses(uninterrupted[0])
    assert shard_files(out) == shard_files(uninterrupted[0])


def responses(out) -> dict[str, list[int]]:
    return {s.sample_id: s.input_ids[s.prompt_len :].tolist() for s in shards.ShardSet(str(out)).samples()}


def cli_args(out, url, *more) -> list[str]:
    return ["extract", "--quiet", "--prompts", "default", "--limit", str(LIMIT), "--max-new-tokens", str(MAX_NEW)] + [
        "--out",
        str(out),
        "--responses-from",
        url,
        "--concurrency",
        "2",
        *more,
    ]


def assert_one_error_line(out, args, *needles) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.output.startswith("error: "), result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not list((out / "shards").glob("*.arrow")) if (out / "shards").exists() else True


def test_unreachable_server(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    assert_one_error_line(tmp_path / "o", cli_args(tmp_path / "o", url, "--retries", "0"), "is unreachable")
    assert not (tmp_path / "o").exists()


def test_finished_extract_reruns_with_the_server_down(uninterrupted, target, tmp_path):
    """Re-running a finished extract needs no server (nothing is left to ask); a fresh one does;
    other settings into the finished OUT are refused before any server is asked."""
    out, _, manifest = uninterrupted
    before = shard_files(out)
    down = f"http://127.0.0.1:{free_port()}"
    assert run_extract(config(out, down, retries=0), loaded=target)["shards"] == manifest["shards"]
    assert shard_files(out) == before
    with pytest.raises(UserError, match="is unreachable"):  # another extract: the server is needed
        run_extract(config(tmp_path / "fresh", down, retries=0), loaded=target)
    changed = config(out, down, retries=0, max_new_tokens=MAX_NEW + 1)
    with pytest.raises(UserError, match=f"different settings:\n  max_new_tokens: {MAX_NEW} -> {MAX_NEW + 1}"):
        run_extract(changed, loaded=target)
    assert shard_files(out) == before


def test_server_answering_errors(tmp_path):
    failing = FakeServer({}, default=lambda body: (500, b"<html>Internal Server Error</html>"))
    try:
        args = cli_args(tmp_path / "o", failing.url, "--retries", "1")
        assert_one_error_line(tmp_path / "o", args, "answered HTTP 500 2 times", "Internal Server Error")
    finally:
        failing.close()


def test_model_the_server_does_not_serve(server, tmp_path):
    args = cli_args(tmp_path / "o", server.url, "--served-model", "qwen3-8b")
    assert_one_error_line(tmp_path / "o", args, "does not serve model 'qwen3-8b'", "--served-model")


def test_server_with_another_vocabulary(server, target, tmp_path):
    """A server of another model: its /tokenize gives other ids for the same text (here the
    real server's answer, shifted by one by a proxy-like fake in front of it)."""

    def shifted(body):
        request = urllib.request.Request(server.url + "/tokenize", data=body, method="POST")
        with urllib.request.urlopen(request) as answer:
            ids = json.loads(answer.read())["tokens"]
        return 200, json.dumps({"tokens": [t + 1 for t in ids]}).encode()

    def models(body):
        with urllib.request.urlopen(server.url + "/v1/models") as answer:
            return 200, answer.read()

    other = FakeServer({("GET", "/v1/models"): models, ("POST", "/tokenize"): shifted})
    try:
        with pytest.raises(EngineError, match="tokenizes differently from the target"):
            run_extract(config(tmp_path / "o", other.url), loaded=target)
    finally:
        other.close()
    assert not (tmp_path / "o").exists()


def test_response_cut_by_the_servers_own_limit(target, tmp_path):
    """A server whose context (256 tokens a slot) ends before prompt + --max-new-tokens 512: the
    response it cuts (truncated) is refused naming the sample, nothing written to the shards."""
    small = ("--ctx-size", "256", "--parallel", "1")
    capped = LlamaServer(smollm2_gguf_path(), tmp_path / "server.log", extra=small).start()
    try:
        with pytest.raises(
            EngineError, match=r"sample 'gsm8k/0000': the serving engine cut its response at its context"
        ):
            run_extract(config(tmp_path / "o", capped.url, limit=1, max_new_tokens=512), loaded=target)
    finally:
        capped.stop()
    assert not list((tmp_path / "o" / "shards").glob("*.arrow"))


def test_sampled_responses_from_llama_server(server, target, tmp_path):
    """Sampled by the engine with llama.cpp's own sampler (its rule in the manifest); the target's
    own log-probability of every token stored; the same seed gives the same responses."""
    sampled = dict(limit=2, temperature=0.8, top_p=0.95, sample_top_k=20, num_samples=2, seed=7)
    manifest = run_extract(config(tmp_path / "a", server.url, **sampled), loaded=target)
    rule = manifest["settings"]["responses"]["sampling_rule"]
    assert rule.startswith("llama.cpp samplers temperature -> top_k -> top_p")
    samples = {s.sample_id: s for s in shards.ShardSet(str(tmp_path / "a")).samples()}
    assert sorted(samples) == ["gsm8k/0000#0", "gsm8k/0000#1", "gsm8k/0001#0", "gsm8k/0001#1"]
    for sample in samples.values():
        assert not sample.greedy and sample.sample_logprob.shape == (sample.response_len,)
    zero = sum(int(torch.isneginf(s.sample_logprob).sum()) for s in samples.values())
    print(
        f"\nsampled engine tokens the target's rule gives probability 0: {zero} of {manifest['totals']['response_tokens']}"
    )
    run_extract(config(tmp_path / "b", server.url, **sampled), loaded=target)
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "b")


def test_torchrun_ranks_share_the_server(server, uninterrupted, tmp_path):
    """Two ranks, one server: each rank asks for its own share of the prompts (each asked once in
    all), stores its responses as its own files, and the samples are those of one process."""

    proxy = Proxy(server.url)
    out = tmp_path / "out"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    command = [*torchrun, "-m", "specreplay", *cli_args(out, proxy.url, "--device", "cpu")]
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    finally:
        proxy.close()
    assert done.returncode == 0, done.stdout + done.stderr
    answered = Counter(tuple(b["prompt"]) for b in proxy.posts("/completion", status=200))
    assert len(answered) == LIMIT and set(answered.values()) == {1}
    assert {p.name[:5] for p in (out / "responses").iterdir()} == {"r000-", "r001-"}  # a file or more per rank
    assert responses(out) == responses(uninterrupted[0])
