"""Exactness of DeepSeek-V4's DSpark drafter (`DeepseekV4DSparkModel`, proposers/dspark/dsv4.py), scored by
`specreplay score`, against each engine's rule on one fitted drafter:

- vLLM's rule (tests/helpers/dsv4_dspark.py's reference, written from vllm/models/deepseek_v4/nvidia/
  dspark.py on transformers' own DeepSeek-V4 modules): at every anchor the replay's block equals the
  reference's greedy chain up to its first draft the response does not hold;
- llama.cpp's rule (the same reference with llama.cpp's per-query window, src/llama-hparams.h:475-487,
  and the block of n_max queries its loop drafts): every anchor of `--walk-rule llama.cpp` equals it;
  the two windows differ on anchors here, so each engine's rule is checked apart;
- the wrong rules (no hyper-connection mixing, no window, softmax expert scoring, feature layers one
  off, no attention sinks, the output's rope left in place) each change anchors' drafts and samples' walks.

No llama-server comparison in the suite: llama-server serves this target (tests/helpers/dsv4_served.py
makes it: DeepSeek's layout, MXFP4-exact experts, an F32 GGUF, a CSA layer so it loads) and its greedy
responses are transformers', but its DSpark draft does not yet equal llama.cpp's rule as the replay runs
it for blocks of several queries (docs/drafter-families.md#dspark; `python -m tests.helpers.dsv4_served`).

The target: transformers' DeepseekV4ForCausalLM (three uncompressed layers and a CSA one whose output is
zeroed, four hyper-connection streams, four experts), emitting twelve ids; the drafter (two stages)
fitted through the reference's own forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import chain_parity as chains, dsv4_dspark as d4, llama_engine as engine

pytestmark = pytest.mark.slow

PROMPTS = 8
MAX_NEW = 24
FIT_STEPS = 60
FIT_LR = 2e-2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from chains.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pipeline.shards import ShardSet
    from tests.helpers.engine_parity import prompt_ids
    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts

    tmp = tmp_path_factory.mktemp("engine_parity_dspark_dsv4")
    model_dir = d4.save_target(tmp / "target")
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompt_ids(PROMPTS))]
    shards = chains.extract(
        tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, d4.STORED
    )
    sequences = [(s.input_ids, s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with seeded(1):
        reference = d4.ReferenceDSV4DSpark()
    loss = d4.fit(reference, target, sequences, FIT_STEPS, FIT_LR)
    ckpt = d4.save(reference.eval().requires_grad_(False), d4.drafter_config(), tmp / "drafter")
    return tmp, shards, ckpt, reference, target, loss


@pytest.fixture(scope="module")
def chain_at(setup):
    """The reference's greedy chain at an anchor of a stored sample under an engine's window (cached)."""
    _, _, _, reference, target, _ = setup
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    features, chains_ = {}, {}

    @torch.no_grad()
    def chain(ids: torch.Tensor, anchor: int, count: int, rule: str = "vllm") -> list[int]:
        key = tuple(ids.tolist())
        if (key, anchor, count, rule) not in chains_:
            if key not in features:
                features[key] = d4.target_features(target, ids)
            chains_[key, anchor, count, rule] = reference.chain(features[key], ids, anchor, count, embed, head, rule)
        return chains_[key, anchor, count, rule]

    return chain


def differing(out_dir: str, shards: str, chain_at, rule: str) -> dict:
    """anchors.parquet against the reference: `anchors` whose block differs from its greedy chain along the
    chain's verified prefix (what an engine proposes), `slots` whose draft differs from its argmax given
    the stored token before it (the replay's teacher-forced drafts, every slot the response holds), and
    the totals. The reference drafts as many queries as the replay's block (llama.cpp's loop drafts n_max
    near the budget's end too, vLLM's block is cut there)."""
    import polars as pl

    from pipeline.shards import ShardSet

    rows = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    samples = {s.sample_id: s.input_ids for s in ShardSet(shards).samples(tensors=[])}
    found = dict(anchors=0, of=0, verified=0, slots=0, of_slots=0)
    for sample_id, anchor, offline in rows.iter_rows():
        ids = samples[sample_id]
        known = min(len(offline), ids.numel() - 1 - anchor)
        if known == 0:
            continue
        chain, forced = chain_at(ids, anchor, len(offline) if rule == "llama.cpp" else known, rule)
        stored = ids[anchor + 1 : anchor + 1 + known].tolist()
        verified = next((i + 1 for i, (d, y) in enumerate(zip(chain, stored)) if d != y), known)
        found["anchors"] += offline[:verified] != chain[:verified]
        found["slots"] += sum(a != b for a, b in zip(offline[:known], forced[:known]))
        found["of"], found["verified"], found["of_slots"] = (
            found["of"] + 1,
            found["verified"] + verified,
            found["of_slots"] + known,
        )
    return found


def scored(setup, name: str, rule: str) -> str:
    tmp, shards, ckpt, *_ = setup
    options = dict(walk_rule="llama.cpp", steps=d4.BLOCK) if rule == "llama.cpp" else {}
    return chains.score(ckpt, shards, tmp / name, anchor_drafts=True, eagle_trees=[], **options)


@pytest.mark.parametrize("rule", ["vllm", "llama.cpp"])
def test_every_anchor_equals_the_engines_rule(setup, chain_at, rule):
    *_, loss = setup
    out_dir = scored(setup, f"right-{rule}", rule)
    found = differing(out_dir, setup[1], chain_at, rule)
    steps = [step for walk in engine.walk_counts(out_dir).values() for step in walk]
    accepted, drafted = sum(a for a, _ in steps), sum(d for _, d in steps)
    print(f"\n{rule} walk: {len(steps)} steps, {accepted}/{drafted} drafts accepted", end="")
    print(
        f"\n{rule}: {found['of'] - found['anchors']}/{found['of']} anchors' chains equal the reference "
        f"({found['verified']} drafts compared), {found['of_slots'] - found['slots']}/{found['of_slots']} "
        f"teacher-forced slots; fit loss {loss:.3f}"
    )
    assert found["anchors"] == found["slots"] == 0 and found["of"] > 100, found
    assert found["verified"] > 1.5 * found["of"], found  # the fitted drafter's blocks accept tokens


def test_the_engines_windows_differ(setup, chain_at):
    """vLLM's block-anchored window against llama.cpp's per-query one: each engine's replay differs from
    the other's reference on some anchors, so neither check above passes by the window being moot."""
    found = differing(scored(setup, "right-llama.cpp", "llama.cpp"), setup[1], chain_at, "vllm")
    print(f"\nllama.cpp's window: {found['slots']}/{found['of_slots']} slots differ from vLLM's rule")
    assert found["slots"] > 0


# -- the wrong rules: each changes anchors' drafts and samples' walks -------------------------------


def _no_stream_mixing(patch):  # the residual streams added one to one: comb the identity
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from proposers.toolkit.dsv4.decoder import DSV4BlockLayer

    class Unmixed(DeepseekV4HyperConnection):
        def forward(self, streams):
            post, comb, collapsed = super().forward(streams)
            return post, torch.eye(comb.shape[-1], dtype=comb.dtype).expand_as(comb), collapsed

    init = DSV4BlockLayer.__init__

    def unmixed(self, config, hf):
        init(self, config, hf)
        self.attn_hc.__class__ = self.ffn_hc.__class__ = Unmixed

    patch.setattr(DSV4BlockLayer, "__init__", unmixed)


def _parsed(patch, change):
    import proposers.dspark.config as dspark_config

    parse = dspark_config.parse_dsv4

    def changed(*args):
        config = parse(*args)
        change(config)
        return config

    patch.setattr(dspark_config, "parse_dsv4", changed)


def _no_window(patch):
    _parsed(patch, lambda config: setattr(config, "sliding_window", None))


def _softmax_scoring(patch):  # the experts' scores softmax(logits), not sqrt(softplus(logits))
    from proposers.toolkit.dsv4.decoder import DSV4BlockLayer

    init = DSV4BlockLayer.__init__

    def softmax(self, config, hf):
        init(self, config, hf)
        self.mlp.gate.score_fn = nn.Softmax(dim=-1)

    patch.setattr(DSV4BlockLayer, "__init__", softmax)


def _layers_one_off(patch):
    _parsed(patch, lambda config: setattr(config, "target_layer_ids", [i + 1 for i in config.target_layer_ids]))


def _no_sinks(patch):
    from proposers.toolkit.dsv4.decoder import DSV4BlockAttention

    patch.setattr(DSV4BlockAttention, "with_sinks", lambda self, scores: torch.softmax(scores, dim=-1))


def _output_rope_kept(patch):
    from proposers.toolkit.dsv4.decoder import DSV4BlockAttention

    patch.setattr(DSV4BlockAttention, "unrotated", lambda self, out, cos, sin: out)


WRONG = [_no_stream_mixing, _no_window, _softmax_scoring, _layers_one_off, _no_sinks, _output_rope_kept]
WRONG_IDS = ["no stream mixing", "no window", "softmax scoring", "layers one off", "no sinks", "output rope kept"]


@pytest.mark.parametrize("wrong", WRONG, ids=WRONG_IDS)
def test_a_wrong_rule_differs_from_the_engines_rule(setup, chain_at, wrong):
    tmp, shards, ckpt, *_ = setup
    right = engine.walk_counts(scored(setup, "right-vllm", "vllm"))
    with pytest.MonkeyPatch.context() as patch:
        wrong(patch)
        out_dir = chains.score(ckpt, shards, tmp / f"wrong-{wrong.__name__}", anchor_drafts=True, eagle_trees=[])
    walks = engine.walk_counts(out_dir)
    differ = sum(walks.get(sid) != steps for sid, steps in right.items())
    found = differing(out_dir, shards, chain_at, "vllm")
    print(
        f"\n{wrong.__name__}: {found['slots']}/{found['of_slots']} slots and {found['anchors']}/{found['of']} "
        f"anchors' chains differ from vLLM's rule; {differ}/{len(right)} walks from the right rule's"
    )
    assert found["slots"] > 0


def _one_error_line(ckpt: str, shards: str, out) -> str:
    from click.testing import CliRunner

    from specreplay.cli import main

    run = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet"])
    print(f"\n{run.output.strip()}")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert "Traceback" not in run.output and not any(out.glob("**/summary.parquet")), run.output
    return run.output


def test_a_config_the_engines_refuse_is_one_error_line(setup, tmp_path):
    """`specreplay score` on the drafter with softmax expert scoring, which llama.cpp's graph refuses: one
    `error:` line naming the field and the fix, nothing written."""
    import json
    import shutil

    _, shards, ckpt, *_ = setup
    bad = tmp_path / "softmax"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text(json.dumps(d4.drafter_config(scoring_func="softmax")))
    output = _one_error_line(str(bad), shards, tmp_path / "out")
    assert "field 'scoring_func' is 'softmax'" in output and "set sqrtsoftplus" in output, output


def test_a_quantized_checkpoint_is_one_error_line(setup, tmp_path):
    """DeepSeek's released layout (MXFP4 experts with E8M0 scales): refused by its first scale tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, shards, ckpt, *_ = setup
    bad = tmp_path / "mxfp4"
    shutil.copytree(ckpt, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["mtp.0.ffn.experts.0.w1.scale"] = torch.full((64, 2), 127, dtype=torch.uint8)
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    output = _one_error_line(str(bad), shards, tmp_path / "out")
    assert "'mtp.0.ffn.experts.0.w1.scale' is a quantization scale" in output and "dequantize" in output, output


def test_sampled_shards_score_through_dsparks_sampled_path(setup):
    """T > 0: shards the target sampled at 0.7 score through DSpark's sampled acceptance (DeepSpec's
    q = softmax((base + bias) / T), proposers/dspark/model.py), a positive expected acceptance."""
    import polars as pl

    tmp, _, ckpt, *_ = setup
    sampled = chains.extract(
        tmp / "sampled", tmp / "target", tmp / "prompts.jsonl", MAX_NEW, d4.STORED, temperature=0.7
    )
    summary = pl.read_parquet(f"{chains.score(ckpt, sampled, tmp / 'sampled-score', eagle_trees=[])}/summary.parquet")
    print(f"\nT 0.7: {summary.select('temperature', 'tau', 'tau_se').row(0)}")
    assert summary["temperature"][0] == 0.7 and summary["tau"][0] > 0, summary


def test_llama_cpps_rule_says_it_is_not_matched_to_the_server(setup, tmp_path):
    """`--walk-rule llama.cpp` scores llama.cpp's mask as its graph states it, which a running llama-server
    did not match (docs/drafter-families.md#dspark): a warning says so, naming the checkpoint; the
    default rule none."""
    import warnings

    _, shards, ckpt, *_ = setup
    with pytest.warns(UserWarning, match=r"--walk-rule llama.cpp is not matched to the engine") as caught:
        chains.score(ckpt, shards, tmp_path / "a", eagle_trees=[], walk_rule="llama.cpp", limit=1)
    assert [str(w.message).startswith(f"{ckpt}: ") for w in caught] == [True], [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        chains.score(ckpt, shards, tmp_path / "b", eagle_trees=[], limit=1)
