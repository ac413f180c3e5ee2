"""Exactness against a real engine for the n-gram proposers llama-server runs without a draft model:
`specreplay score --ckpt ngram.json --walk-rule llama.cpp` reports, step for step, the accepted-draft
counts llama-server reports with `--spec-type ngram-simple` and the same sizes (the config's keys are
the server's flags), for every sample whose engine response is the stored one
(engine_parity.assert_engine_counts: per-step counts, their sums equal to the timings, at most one
differing response).

The target is a tiny random Qwen3 of llama_engine.engine_target's recipe emitting 16 live ids, so
its greedy responses repeat themselves and the lookups find matches; its stop token ends some of
them early. The shards hold no feature layer (`--layer-ids none`): an n-gram proposer reads the
tokens alone. ngram-simple keeps no state, so the order of the requests does not matter.
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline.shards import ShardSet
from scoring import tool_figures
from tests.helpers import chain_parity as chains, engine_parity as parity, llama_engine as engine
from tests.helpers.prompts import write_prompts
from tools.llama_convert import convert

pytestmark = pytest.mark.slow

LIVE = 16  # ids the target emits: short loops, which an n-gram lookup finds
MAX_NEW = 64  # long enough for the lookups to draft many steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("ngram")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> parity.Setup:
    tmp = tmp_path_factory.mktemp("engine_parity_ngram")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, MAX_NEW, live=LIVE, layers=4)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, [])
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish
    gguf = str(convert(model_dir, tmp / "target.gguf"))
    return parity.Setup(tmp, model_dir, gguf, shards, sequences=[], converter=None, max_new=MAX_NEW)


def ngram_simple(setup: parity.Setup, n: int, m: int) -> parity.Drafter:
    """The config file of llama-server's ngram-simple with size-n n and size-m m, and those flags."""
    path = setup.tmp / f"ngram-simple-{n}-{m}.json"
    sizes = {"spec-ngram-simple-size-n": n, "spec-ngram-simple-size-m": m}
    path.write_text(json.dumps({"spec-type": "ngram-simple", **sizes}))
    flags = tuple(x for key, value in sizes.items() for x in (f"--{key}", str(value)))
    return parity.Drafter("ngram", "llama.cpp", str(path), None, "ngram-simple", m, flags=flags, steps=False)


@pytest.mark.parametrize("n, m", [(2, 6), (1, 4), (3, 12)])
def test_ngram_simple_counts_equal_llama_server(setup, n, m):
    """Sizes where the lookup's rules decide: the latest match, no draft when fewer than n tokens
    follow it, drafts of up to m cut to the budget."""
    walk = parity.assert_engine_counts(setup, ngram_simple(setup, n, m), m, per_step=0.02)
    # the comparison can fail on the lookup: vLLM's (the earliest longest match, any draft length) drafts otherwise
    vllm = setup.tmp / f"vllm-{n}-{m}.json"
    vllm.write_text(
        json.dumps({"method": "ngram", "num_speculative_tokens": m, "prompt_lookup_min": n, "prompt_lookup_max": n})
    )
    other = chains.score(str(vllm), setup.shards, setup.tmp / f"vllm-{n}-{m}", walk_rule="llama.cpp", eagle_trees=[])
    assert engine.walk_counts(other) != walk


# llama-server's figures after each request (tools/server/server-context.cpp print_timings): the
# task's line with the draft acceptance, the accepted and generated drafts and the mean length
PRINTED = re.compile(
    r"task (\d+) \| draft acceptance = ([\d.]+) \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([\d.]+)"
)
TOTAL = re.compile(r"task (\d+) \|\s+total time")


def test_the_figures_llama_server_prints_are_the_walk_s_tool_figures(setup):
    """llama.cpp's printed `draft acceptance`, `(a accepted / n generated)` and `mean len` of each
    request equal tool_figures of the sample's walk (docs/tool-figures.md), for every response the
    engine gave as stored; SGLang's accept length is not that formula (its steps without a draft
    count), and the drafting steps' count tells them apart here."""
    drafter = ngram_simple(setup, 2, 6)
    scored = parity.scored(setup, drafter, 6, "llama.cpp")
    stored = {s.sample_id: s for s in ShardSet(setup.shards).samples(tensors=[])}
    log = setup.tmp / "printed.log"
    with engine.serving(setup.target_gguf, None, "ngram-simple", 6, log, 1, drafter.flags) as server:
        runs = {
            sid: engine.engine_run(server, s.input_ids[: s.prompt_len].tolist(), setup.max_new)
            for sid, s in stored.items()
        }
    text = log.read_text()
    tasks = [int(t) for t in TOTAL.findall(text)]  # one a request, in the order sent
    printed = {int(m.group(1)): m.groups()[1:] for m in PRINTED.finditer(text)}
    compared = 0
    for (sid, sample), task in zip(stored.items(), tasks, strict=True):
        if runs[sid].tokens != sample.input_ids[sample.prompt_len :].tolist() or task not in printed:
            continue
        ratio, accepted, generated, mean_len = printed[task]
        figures = {
            (f.tool, f.name): f.value
            for f in tool_figures.engine_figures(tool_figures.walk_counts(scored, sample_id=sid))
        }
        assert abs(figures[("llama.cpp", "draft acceptance")] - float(ratio)) < 1e-5, (sid, ratio, figures)
        assert abs(figures[("llama.cpp", "mean len")] - float(mean_len)) <= 0.005, (sid, mean_len, figures)
        counts = tool_figures.walk_counts(scored, sample_id=sid)
        assert (counts.accepted, counts.drafted) == (int(accepted), int(generated))
        compared += 1
    assert compared >= parity.PROMPTS // 2, compared  # the others: a response that differs, or no draft
    pooled = tool_figures.walk_counts(scored)
    assert pooled.drafting_steps < pooled.steps  # steps without a match: SGLang's accept len differs
    figures = {(f.tool, f.name): f.value for f in tool_figures.tool_figures(scored)}
    assert figures[("SGLang", "accept len")] < figures[("vLLM", "Mean acceptance length")]


# --------------------------------------------------------------------------------------------- with state

# llama-server's types that keep state: their settings (the server's flags) and the requests in
# order on one slot (engine_parity serves one slot and sends the samples in the shards' order,
# which is the replay's order: run.json `requests`).
STATEFUL = {
    "ngram-map-k": {"spec-ngram-map-k-size-n": 2, "spec-ngram-map-k-size-m": 6},
    "ngram-map-k4v": {"spec-ngram-map-k4v-size-n": 2, "spec-ngram-map-k4v-size-m": 6},
    "ngram-map-k4v hits 2": {
        "spec-ngram-map-k4v-size-n": 1,
        "spec-ngram-map-k4v-size-m": 4,
        "spec-ngram-map-k4v-min-hits": 2,
    },
    "ngram-mod": {"spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 2, "spec-ngram-mod-n-max": 8},
}


# over a conversation (responses of one or two repeated ids): sizes at which every type drafts and accepts
CONVERSATION = {
    "ngram-map-k n3": {"spec-ngram-map-k-size-n": 3, "spec-ngram-map-k-size-m": 4},
    "ngram-map-k4v n3 hits 2": {
        "spec-ngram-map-k4v-size-n": 3,
        "spec-ngram-map-k4v-size-m": 4,
        "spec-ngram-map-k4v-min-hits": 2,
    },
    "ngram-mod": STATEFUL["ngram-mod"],
    # no size flag: 8 drafts from n-grams of 1 to 4 tokens. Only here: a step learns nothing unless it
    # accepted a draft (a one-token chunk holds no n-gram), so a response draws only on the n-grams
    # of its prompt, and the single-turn prompts share none with the responses
    "ngram-cache": {},
}


def stateful(setup: parity.Setup, name: str, sizes: dict | None = None) -> tuple[parity.Drafter, int]:
    """(the config file of the type `name` with its sizes, and those flags; its longest draft)."""
    spec_type, sizes = spec_type_of(name), STATEFUL[name] if sizes is None else sizes
    path = setup.tmp / f"{name.replace(' ', '-')}.json"
    path.write_text(json.dumps({"spec-type": spec_type, **sizes}))
    flags = tuple(x for key, value in sizes.items() for x in (f"--{key}", str(value)))
    longest = next((v for k, v in sizes.items() if k.endswith(("size-m", "n-max"))), 8)  # ngram-cache: 8
    # drafts=0: no other walk rule replays it (the server's loop is part of its rule)
    return parity.Drafter("ngram", "llama.cpp", str(path), None, spec_type, 0, flags=flags, steps=False), longest


@pytest.mark.parametrize("name", list(STATEFUL))
def test_stateful_ngram_counts_equal_llama_server(setup, name):
    """Each type's state carried from step to step and from request to request, as the server's one
    slot carries it: per-step counts equal for every sample."""
    drafter, longest = stateful(setup, name)
    walk = parity.assert_engine_counts(setup, drafter, longest, per_step=0.02)
    # the comparison fails on the plausible wrong rules: ngram-mod's table begun afresh for every
    # request; ngram-map's draft lengths ignoring what the last step accepted. (Here every prompt is
    # shorter than the slot's last history, so the server's begin drops a map's entries anyway.)
    if spec_type_of(name) == "ngram-mod":
        wrong = {"fresh state per request": fresh_per_request}
    else:
        wrong = {"acceptance ignored": acceptance_ignored}
    for what, patch in wrong.items():
        with pytest.MonkeyPatch.context() as mp:
            patch(mp)
            out = chains.score(drafter.path, setup.shards, setup.tmp / f"{name}-{what}", walk_rule="llama.cpp")
        assert engine.walk_counts(out) != walk, what


TURNS = 5


@pytest.fixture(scope="module")
def conversation(setup, tmp_path_factory) -> parity.Setup:
    """One conversation of TURNS requests on the same target: each prompt the previous prompt, its
    stored response and a few new ids, so it is longer than the slot's last history and ngram-map's
    begin keeps the map (common/ngram-map.cpp:139-218): the state carried from request to request."""
    tmp = tmp_path_factory.mktemp("engine_parity_ngram_turns")
    prompt, extra, records = parity.prompt_ids(1, seed=11)[0], parity.prompt_ids(TURNS, seed=12), []
    for turn in range(TURNS):
        records.append({"id": f"t{turn}", "input_ids": list(prompt)})
        path = write_prompts(tmp / f"prompts-{turn}.jsonl", records)
        shards = chains.extract(tmp / f"shards-{turn}", setup.target, path, MAX_NEW, [])
        [last] = [s for s in ShardSet(shards).samples(tensors=[]) if s.sample_id == f"t{turn}"]
        prompt = last.input_ids.tolist() + extra[turn]
    return parity.Setup(tmp, setup.target, setup.target_gguf, shards, [], converter=None, max_new=MAX_NEW)


@pytest.mark.parametrize("name", list(CONVERSATION))
def test_stateful_ngram_counts_equal_llama_server_over_a_conversation(conversation, name):
    """The same over the turns of one conversation: a map carried into the next request, and a
    replay that begins every request afresh (the plausible wrong rule) differs."""
    drafter, longest = stateful(conversation, name, CONVERSATION[name])
    walk = parity.assert_engine_counts(conversation, drafter, longest, per_step=0.02)
    with pytest.MonkeyPatch.context() as mp:
        fresh_per_request(mp)
        out = chains.score(drafter.path, conversation.shards, conversation.tmp / f"{name}-fresh", walk_rule="llama.cpp")
    assert engine.walk_counts(out) != walk


def spec_type_of(name: str) -> str:
    return name.split()[0]


def fresh_per_request(mp: pytest.MonkeyPatch) -> None:
    from proposers.ngram import stateful as module

    begin = module.LlamaStatefulProposer.begin

    def afresh(self, packed, sample_idx):
        self.engine = module.engine_of(self.config)
        begin(self, packed, sample_idx)

    mp.setattr(module.LlamaStatefulProposer, "begin", afresh)


def acceptance_ignored(mp: pytest.MonkeyPatch) -> None:
    from proposers.ngram import llama_map

    mp.setattr(llama_map.NgramMap, "accept", lambda self, accepted: None)
