"""XPress checkpoints as speculators and vLLM lay them out: detected, scored end to end through the CLI (chain
rows, no DDTree: each draft reads the drafts before it), and each bad input one `error:` line naming
its field, nothing written; shards sampled at T > 0 refused the same way. The checkpoint is
speculators' own XPressDraftModel with random weights (the exactness of its drafts is
tests/parity/test_xpress_parity.py's)."""

from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.extract.config import ExtractConfig
from pipeline.extract.run import run_extract
from proposers.checkpoints.load import load_proposer
from specreplay.cli import main
from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB
from tests.helpers.prompts import write_prompts
from tests.helpers.shards import tiny_synthetic
from tests.helpers.xpress_online import random_xpress

AUX_IDS = (2, 4)  # speculators' before-layer ids: the outputs of layers 1 and 3, as the shards store them


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return tiny_synthetic(tmp_path_factory.mktemp("xpress") / "shards")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return random_xpress(
        tmp_path_factory.mktemp("xpress") / "ckpt", vocab=TINY_VOCAB, hidden=TINY_HIDDEN, aux_ids=AUX_IDS
    )


@pytest.fixture(scope="module")
def vllm_ckpt(ckpt, tmp_path_factory) -> str:
    """The same weights in vLLM's own layout (z-lab's config, `xpress_*` keys, vLLM's tensor names)."""
    from tests.helpers.xpress_vllm import vllm_layout

    return vllm_layout(ckpt, tmp_path_factory.mktemp("xpress") / "vllm", 6, topc=8)


def test_a_vllm_checkpoint_is_xpress_read_with_vllms_rule(vllm_ckpt, ckpt, shards, tmp_path):
    """Detected by its architecture, its refiner's tensors renamed to the model's, vLLM's options
    (the anchor slot reading x_t, its top-C), and scored through the CLI."""
    proposer, _ = load_proposer(vllm_ckpt, target_layers=6)
    assert (proposer.family, proposer.layout) == ("xpress", "vllm")
    assert proposer.config.family_options == {
        "xpress_rank": 8,
        "xpress_mlp_hidden": 16,
        "num_jacobi_passes": 2,
        "top_c": 8,
        "slot0_reads": "anchor",
    }
    theirs = load_proposer(ckpt, target_layers=6)[0].model.refiner_head.state_dict()
    mine = proposer.model.refiner_head.state_dict()
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    run, out = _score(vllm_ckpt, shards, tmp_path / "results")
    assert run.exit_code == 0, run.output
    [result] = [p for p in out.iterdir() if p.is_dir()]
    assert set(pl.read_parquet(result / "summary.parquet")["drafter_layout"]) == {"vllm"}


def _score(ckpt: str, shards: str, out, *extra) -> tuple:
    run = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet", *extra])
    return run, out


def test_a_speculators_checkpoint_is_xpress_with_a_whole_untaught_block(ckpt):
    proposer, _ = load_proposer(ckpt, target_layers=6)
    config = proposer.config
    assert (proposer.family, proposer.layout) == ("xpress", "speculators")
    assert not proposer.independent_drafts and proposer.max_drafts == 3
    assert config.whole_block and not config.teacher_forced_block and not config.drafts_from_anchor
    assert config.family_options == {
        "xpress_rank": 8,
        "xpress_mlp_hidden": 16,
        "num_jacobi_passes": 2,
        "top_c": 0,
        "slot0_reads": "before",
    }
    assert proposer.needs.feature_layers == (1, 3)
    assert tuple(proposer.model.refiner_head.mix_l.shape) == (8, 4, 4)


def test_score_writes_chain_rows_under_its_family(ckpt, shards, tmp_path):
    run, out = _score(ckpt, shards, tmp_path / "results", "--ddtree-budgets", "8", "--anchor-drafts")
    assert run.exit_code == 0, run.output
    [result] = [p for p in out.iterdir() if p.is_dir()]
    summary = pl.read_parquet(result / "summary.parquet")
    assert set(summary["drafter_family"]) == {"xpress"}
    assert set(summary["method"]) == {"chain"}  # no DDTree: the drafts depend on each other
    anchors = pl.read_parquet(result / "anchors.parquet")
    # the block is never cut at the budget: 3 drafts at every anchor, the last ones included
    assert set(anchors["block_len"]) == {4}, anchors["block_len"].unique()


def _copy(ckpt: str, tmp_path, edit_config=None, edit_state=None) -> str:
    """A copy of the checkpoint with its config.json and/or weights changed."""
    out = tmp_path / "bad"
    out.mkdir()
    config = json.loads(open(f"{ckpt}/config.json").read())
    state = load_file(f"{ckpt}/model.safetensors")
    (edit_config or (lambda c: None))(config)
    (edit_state or (lambda s: None))(state)
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"))
    return str(out)


BAD = {
    "drafts from the anchor": (lambda c: c.update(sample_from_anchor=True), None, "field 'sample_from_anchor'"),
    "a reduced draft vocabulary": (lambda c: c.update(draft_vocab_size=256), None, "field 'draft_vocab_size'"),
    "no mask token": (lambda c: c.pop("mask_token_id"), None, "missing field 'mask_token_id'"),
    "negative passes": (lambda c: c.update(num_jacobi_passes=-1), None, "num_jacobi_passes"),
    "a rank the weights do not have": (lambda c: c.update(xpress_rank=16), None, "refiner_head"),
    "no refiner mixer": (None, lambda s: s.pop("refiner_head.mix_l"), "refiner_head.mix_l"),
    "no refiner readout": (None, lambda s: s.pop("refiner_head.readout.weight"), "refiner_head.readout.weight"),
    "served block other than block_size": (
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5),
        None,
        "speculative_tokens",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_error_naming_its_field(ckpt, shards, tmp_path, case):
    edit_config, edit_state, message = BAD[case]
    run, out = _score(_copy(ckpt, tmp_path, edit_config, edit_state), shards, tmp_path / "results")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert message in run.output, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet"))


def test_sampled_shards_are_one_error(ckpt, tiny_qwen3_dir, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [{"id": "a", "input_ids": [5, 6, 7, 8]}])
    shards = str(tmp_path / "sampled")
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir, prompts=prompts, out=shards, max_new_tokens=6, layer_ids=[1, 3], top_k=4,
            dtype="fp32", temperature=0.7, num_samples=2,
        )
    )  # fmt: skip
    run, out = _score(ckpt, shards, tmp_path / "results")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert "greedy shards only" in run.output and "T=0.7" in run.output, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet"))


def test_the_passes_a_converged_row_skips_change_no_draft(tmp_path):
    """The replay stops refining a row once a pass leaves its inputs unchanged; at 6 passes, on random
    blocks where rows converge after different numbers of passes, every row's drafts equal speculators'
    own refiner run for all 6 passes (tests/helpers/xpress_online.py jacobi_drafts)."""
    import torch
    from speculators.models.xpress import XPressDraftModel

    from tests.helpers.xpress_online import jacobi_drafts

    ckpt = random_xpress(tmp_path / "ckpt", vocab=TINY_VOCAB, hidden=TINY_HIDDEN, aux_ids=AUX_IDS, passes=6, std=0.2)
    mine = load_proposer(ckpt, target_layers=6)[0].model
    reference = XPressDraftModel.from_pretrained(ckpt).eval()
    # transformers 5 loads on the meta device and never refills a non-persistent buffer: the mask
    # speculators' XPressRefinerHead registers in __init__ comes back as uninitialized memory
    block = reference.refiner_head.mix_l.shape[-1]
    reference.refiner_head.causal_tril = torch.tril(torch.ones(block, block))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, block, TINY_HIDDEN, generator=generator)
    base = 0.02 * torch.randn(64, block, TINY_VOCAB, generator=generator)  # small: the refiner decides
    tokens = torch.randint(0, TINY_VOCAB, (64, 2), generator=generator)
    features = mine.refiner_head.hidden_features(hidden)
    rows_per_pass = []
    logits = mine.refiner_head.logits

    def counted(base, previous, features):
        rows_per_pass.append(base.shape[0])
        return logits(base, previous, features)

    mine.refiner_head.logits = counted
    with torch.no_grad():
        drafts = mine.refined(base, features, tokens[:, :1], tokens[:, 1:2]).argmax(dim=-1)[:, 1:]
        expected = [jacobi_drafts(reference, hidden[i], base[i], *tokens[i].tolist(), 6) for i in range(64)]
    assert torch.equal(drafts, torch.stack(expected))
    print(f"rows refined at each pass: {rows_per_pass}")
    # every row refined once, the passes cut short, rows leaving after different numbers of passes
    assert rows_per_pass[0] == 64 and len(rows_per_pass) < 6 and 0 < rows_per_pass[-1] < 64, rows_per_pass
