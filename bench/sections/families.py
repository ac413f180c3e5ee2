"""Section `families`: the scoring cost of each drafter family and layout relative to z-lab
DFlash v1, on the same shards (issue 24 item 7: DFlash2's selector and DSpark's Markov head must
not dominate).

Synthetic shards at SmolLM2 shapes (hidden 576, vocab 49152, 5 feature layers; bench/standins.py,
as the checkpoints and length sections; 396 anchors, --quick 47): the scoring cost of a random
drafter depends on the shapes, not on the feature values. One drafter per family and layout, all
with the same decoder (one layer of the target's attention and MLP shapes, block 16) and random
weights, each built and saved by the public reference's own classes where one is installed:
z-lab's `dflash.model` DFlashDraftModel / DFlash2DraftModel, speculators 0.9.0 DFlashDraftModel
(full and reduced draft vocabulary) / DFlash2DraftModel / DSparkDraftModel (vanilla and rnn Markov
heads) / XPressDraftModel (issue 36: its refiner's Jacobi passes must not dominate), with their own
save_pretrained. SpecForge and DeepSpec are not installed: their DSpark
layouts are the speculators drafter's tensors beside the config.json each writes
(docs/drafter-families.md#dspark), DeepSpec with its own copies of the embedding and lm_head;
DeepSpec's Gemma 4 DSpark and DeepSeek-V4's DSpark (one stage: a full DeepSeek-V4 block, DSV4) are
built and saved by the tests' references of vLLM's rule (no public class trains them).
Every family takes its extra fields at the defaults speculators gives them (DFlash2: kernel 2,
group 16, selector rank 256, top 16; DSpark: Markov rank 256, confidence head on the Markov
embedding; XPress: refiner rank 256, 6 Jacobi passes).

Timed: `scoring.score.run.run_score`, all anchors, chain only, each checkpoint alone, after a
one-sample warm-up; the layouts alternate in rounds (forward, then backward, `--reps` of them),
so drift on a shared machine falls on every side alike. Per layout the round with the least wall
time counts; reported per anchor, as the ratio to DFlash v1 (whole call, and the replay: the
product's "replay anchors" stage) and by the product's stages. The work a family adds on top of
its lm_head GEMM (DFlash2's selector, which no product stage separates; DSpark's Markov and
confidence heads) is measured on the product's loaded model: one `drafts()` call on random hidden
states of full blocks less the product's own "lm_head" stage inside it, min of 3; its share of
the family's replay per anchor is judged against DOMINATES.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bench.common import Phase, Rows, StageClock, log, num
from bench.sections.length import PROMPT_TOKENS, SMOLLM2
from bench.standins import write_synthetic_shards

BLOCK_SIZE = 16
# The drafters' one decoder layer: SmolLM2's attention and MLP shapes (a DeepSpec config is a copy
# of its target's; SpecForge's default "gqa" attention needs fewer key/value heads than query heads).
DECODER = dict(
    num_hidden_layers=1,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=8192,
)
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)  # speculators' defaults
DSPARK = dict(markov_rank=256, enable_confidence_head=True, confidence_head_with_markov=True)  # speculators' defaults
XPRESS = dict(xpress_rank=256, num_jacobi_passes=6)  # speculators' defaults: the refiner's passes dominate or not
REDUCED_VOCAB = SMOLLM2["vocab_size"] // 4  # speculators' 32k of a 128k-152k vocabulary, scaled
INIT_STD = 0.02
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec saves its own copies of the target's
# (key, family, layout, row label); the first is the reference of every ratio
LAYOUTS = (
    ("zlab-dflash", "dflash", "z-lab", "z-lab DFlash v1"),
    ("speculators-dflash", "dflash", "speculators", "speculators DFlash"),
    ("speculators-dflash-vocab", "dflash", "speculators", f"speculators DFlash, draft vocab {REDUCED_VOCAB}"),
    ("zlab-dflash2", "dflash2", "z-lab", "z-lab DFlash2"),
    ("speculators-dflash2", "dflash2", "speculators", "speculators DFlash2"),
    ("speculators-dspark", "dspark", "speculators", "speculators DSpark, vanilla head"),
    ("speculators-dspark-rnn", "dspark", "speculators", "speculators DSpark, rnn head"),
    ("specforge-dspark", "dspark", "specforge", "SpecForge DSpark"),
    ("deepspec-dspark", "dspark", "deepspec", "DeepSpec DSpark"),
    ("deepspec-gemma4-dspark", "dspark", "deepspec", "DeepSpec Gemma 4 DSpark, vanilla head"),
    ("deepseek-v4-dspark", "dspark", "deepseek-v4", "DeepSeek-V4 DSpark, one stage, vanilla head"),
    ("speculators-xpress", "xpress", "speculators", "speculators XPress, 6 refiner passes"),
    ("vllm-xpress", "xpress", "vllm", "vLLM XPress, 6 refiner passes, top-512"),
)
# The work a family adds on top of the lm_head logits, measured on the loaded model (key: label)
EXTRA_WORK = {"zlab-dflash2": "selector", "speculators-dspark": "Markov + confidence heads"}
EXTRA_WORK["speculators-dspark-rnn"] = EXTRA_WORK["speculators-dspark"]
EXTRA_WORK["deepspec-gemma4-dspark"] = "Markov head"
EXTRA_WORK["deepseek-v4-dspark"] = "Markov head"
EXTRA_WORK["speculators-xpress"] = "refiner passes"
EXTRA_WORK["vllm-xpress"] = "refiner passes over the top-512"
DOMINATES = 0.5  # the family's own extra work above this share of its replay would dominate it
STAGES = ("context keys/values", "drafter layers", "attention", "masks", "lm_head", "markov head", "logsumexp")
EXTRA_ANCHORS = 32  # full blocks per `drafts()` call of the extra-work measurement (quick: half)
# The stage breakdown printed (every layout's is in the JSON): column label -> stage
BREAKDOWN = {
    "layers": "drafter layers",
    "attention": "attention",
    "lm_head": "lm_head",
    "Markov head": "markov head",
    "logsumexp": "logsumexp",
    "rest of replay": "rest of replay",
}
BREAKDOWN_ROWS = (
    "zlab-dflash",
    "speculators-dflash-vocab",
    "zlab-dflash2",
    "speculators-dspark",
    "speculators-dspark-rnn",
    "deepspec-gemma4-dspark",
    "deepseek-v4-dspark",
    "speculators-xpress",
    "vllm-xpress",
)


# ---------------------------------------------------------------------------------------------
# the drafters, built and saved by the references


@torch.no_grad()
def randomize(model, seed: int):
    """Every matrix the checkpoint saves (and DFlash2's base kernels, which the references leave
    uninitialized) drawn N(0, INIT_STD) from `seed`; norms and biases as the reference built
    them. What the reference does not save (speculators' copies of the verifier's weights, the
    embedding, the lm_head of a full draft vocabulary) is left as built."""
    generator = torch.Generator().manual_seed(seed)
    unsaved = tuple(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for name, parameter in sorted(model.named_parameters()):
        if name in unsaved:
            continue
        if parameter.dim() >= 2:
            parameter.normal_(0.0, INIT_STD, generator=generator)
        else:
            assert bool(parameter.isfinite().all()), f"{name}: non-finite values"
    return model.eval()


def decoder_config(hidden: int, vocab: int):
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=hidden, vocab_size=vocab, tie_word_embeddings=False, **DECODER)
    config._attn_implementation = "eager"  # speculators' modules on CPU (flex attention needs a compiler)
    return config


def zlab(out: Path, family: str, layer_ids: list[int], seed: int) -> None:
    """z-lab's DFlashDraftModel / DFlash2DraftModel (dflash.model), saved by its save_pretrained."""
    import dflash.model as zlab_reference

    hidden, vocab = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    config = decoder_config(hidden, vocab)
    config.block_size = BLOCK_SIZE
    config.num_target_layers = SMOLLM2["num_layers"]
    config.dflash_config = {"mask_token_id": vocab - 1, "target_layer_ids": list(layer_ids)}
    if family == "dflash2":
        config.dflash_config.update(DFLASH2)
    model_class = zlab_reference.DFlash2DraftModel if family == "dflash2" else zlab_reference.DFlashDraftModel
    torch.manual_seed(seed)
    randomize(model_class(config), seed).save_pretrained(str(out))


def speculators(out: Path, family: str, layer_ids: list[int], seed: int, draft_vocab=None, **fields):
    """speculators' DFlashDraftModel / DFlash2DraftModel / DSparkDraftModel / XPressDraftModel, saved by its
    save_pretrained; `draft_vocab` a reduced draft vocabulary of that many random target ids
    (its own `load_vocab_mappings`). Returns the model (the other DSpark layouts reuse its weights)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    hidden, vocab = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    config_class, model_class = {
        "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
        "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
        "dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
        "xpress": (XPressSpeculatorConfig, XPressDraftModel),
    }[family]
    drafts = BLOCK_SIZE if family == "dspark" else BLOCK_SIZE - 1  # DSpark drafts from the anchor's slot
    config = config_class(
        transformer_layer_config=decoder_config(hidden, vocab),
        draft_vocab_size=draft_vocab or vocab,
        block_size=BLOCK_SIZE,
        aux_hidden_state_layer_ids=[i + 1 for i in layer_ids],  # before-layer ids
        mask_token_id=vocab - 1,
        speculators_config=SpeculatorsConfig(
            algorithm=family,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=drafts)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
        **fields,
    )
    torch.manual_seed(seed)
    model = randomize(model_class(config), seed)
    if draft_vocab:  # as speculators maps a vocabulary: chosen target ids ascending, d2t = id - draft id
        chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        model.load_vocab_mappings(t2d, chosen - torch.arange(draft_vocab))
    model.save_pretrained(str(out))
    return model


def write_layout(out: Path, config: dict, state: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))


def other_dspark_layouts(work: Path, reference, layer_ids: list[int]) -> None:
    """The speculators DSpark's weights in SpecForge's layout (DSparkDraftModel, every DSpark
    field in dflash_config, no embedding or lm_head) and DeepSpec's (Qwen3DSparkModel, a copy of
    the target's config with the draft fields at the top level, and its own copies of the
    embedding and lm_head). Layer ids count the output of layer i in both."""
    spec = reference.config
    decoder = {k: v for k, v in spec.transformer_layer_config.to_dict().items() if k != "transformers_version"}
    skip = ("verifier_", "t2d", "d2t", "embed_tokens.", "lm_head.")
    backbone = {k: v for k, v in reference.state_dict().items() if not k.startswith(skip)}
    heads = dict(
        markov_rank=spec.markov_rank,
        markov_head_type=spec.markov_head_type,
        enable_confidence_head=spec.enable_confidence_head,
        confidence_head_with_markov=spec.confidence_head_with_markov,
    )
    specforge = dict(
        decoder,
        architectures=["DSparkDraftModel"],
        block_size=spec.block_size,
        num_target_layers=SMOLLM2["num_layers"],
        dflash_config=dict(
            heads,
            projector_type="dspark",
            mask_token_id=spec.mask_token_id,
            target_layer_ids=list(layer_ids),
            confidence_head_alpha=1.0,
            attention_mode="gqa",
        ),
    )
    write_layout(work / "specforge-dspark", specforge, backbone)
    deepspec = dict(
        decoder,
        **heads,
        architectures=["Qwen3DSparkModel"],
        num_target_layers=SMOLLM2["num_layers"],
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(layer_ids),
        num_anchors=512,
    )
    generator = torch.Generator().manual_seed(0)
    shape = (spec.transformer_layer_config.vocab_size, spec.transformer_layer_config.hidden_size)
    copies = {name: torch.empty(shape).normal_(0.0, INIT_STD, generator=generator) for name in TARGET_COPIES}
    write_layout(work / "deepspec-dspark", deepspec, {**backbone, **copies})


def build_drafters(work: Path, layer_ids: list[int]) -> dict[str, str]:
    """Every layout of LAYOUTS under work/<key>; key -> checkpoint directory."""
    zlab(work / "zlab-dflash", "dflash", layer_ids, seed=1)
    zlab(work / "zlab-dflash2", "dflash2", layer_ids, seed=2)
    speculators(work / "speculators-dflash", "dflash", layer_ids, seed=3)
    speculators(work / "speculators-dflash-vocab", "dflash", layer_ids, seed=4, draft_vocab=REDUCED_VOCAB)
    speculators(work / "speculators-dflash2", "dflash2", layer_ids, seed=5, **DFLASH2)
    dspark = speculators(work / "speculators-dspark", "dspark", layer_ids, seed=6, markov_head_type="vanilla", **DSPARK)
    speculators(work / "speculators-dspark-rnn", "dspark", layer_ids, seed=7, markov_head_type="rnn", **DSPARK)
    other_dspark_layouts(work, dspark, layer_ids)
    gemma4_dspark(work / "deepspec-gemma4-dspark", layer_ids, seed=9)
    dsv4_dspark(work / "deepseek-v4-dspark", layer_ids, seed=10)
    speculators(work / "speculators-xpress", "xpress", layer_ids, seed=8, **XPRESS)
    vllm_xpress(work)
    return {key: str(work / key) for key, *_ in LAYOUTS}


def gemma4_dspark(out: Path, layer_ids: list[int], seed: int) -> None:
    """DeepSpec's Gemma4DSparkModel at the same shapes (Gemma 4 block layers: K and V from one
    projection, sandwich norms, proportional RoPE on half the head, GELU), random, in the layout
    vLLM and llama.cpp load; built and saved by the tests' reference of vLLM's rule (no public
    class trains it). Vanilla Markov head of rank 256, no confidence head (the reference has none)."""
    from tests.helpers.gemma4_dspark import ROPE, ReferenceGemma4DSpark, save

    hidden, vocab = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    shapes = {k: DECODER[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}
    raw = dict(
        shapes,
        architectures=["Gemma4DSparkModel"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=DECODER["intermediate_size"],
        global_head_dim=DECODER["head_dim"],
        num_global_key_value_heads=DECODER["num_key_value_heads"],
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=False,
        max_position_embeddings=DECODER["max_position_embeddings"],
        layer_types=["full_attention"] * DECODER["num_hidden_layers"],
        attention_k_eq_v=True,
        rope_parameters={"full_attention": ROPE},
        hidden_size_per_layer_input=0,
        num_target_layers=SMOLLM2["num_layers"],
        block_size=BLOCK_SIZE,
        mask_token_id=vocab - 1,
        target_layer_ids=list(layer_ids),
        num_anchors=512,
        markov_rank=DSPARK["markov_rank"],
        markov_head_type="vanilla",
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
    torch.manual_seed(seed)
    save(randomize(ReferenceGemma4DSpark(raw), seed), raw, out)


# one DeepSeek-V4 stage at SmolLM2's width: a shared key/value head of 64 for 9 query heads, 3 output
# groups, 4 hyper-connection streams, 32 experts (top 4) and a shared one, a 128-token window
DSV4 = dict(
    num_attention_heads=9, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=32, q_lora_rank=192, o_groups=3,
    o_lora_rank=128, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=384,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, rms_norm_eps=1e-6, hidden_act="silu",
    max_position_embeddings=DECODER["max_position_embeddings"],
)  # fmt: skip


def dsv4_dspark(out: Path, layer_ids: list[int], seed: int) -> None:
    """DeepSeek-V4's DSpark at SmolLM2's width: one stage (a full DeepSeek-V4 block, DSV4), random, in
    DeepSeek's checkpoint names; built and saved by the tests' reference of vLLM's rule
    (tests/helpers/dsv4_dspark.py; no public class trains it), on the target's embedding and lm_head."""
    from transformers import DeepseekV4Config

    from tests.helpers.dsv4_dspark import ROPE, ReferenceDSV4DSpark, save

    hidden, vocab, layers = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], SMOLLM2["num_layers"]
    stage = dict(DSV4, vocab_size=vocab, hidden_size=hidden, rope_parameters=ROPE)
    hf = DeepseekV4Config(**stage, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    hf._attn_implementation = "eager"
    raw = dict(
        {k: v for k, v in stage.items() if k != "rope_parameters"},
        architectures=["DeepseekV4DSparkModel"],
        rope_theta=ROPE["main"]["rope_theta"],
        num_hidden_layers=layers,
        compress_ratios=[0] * (layers + 1),
        num_hash_layers=0,
        n_mtp_layers=1,
        dspark_block_size=BLOCK_SIZE,
        dspark_noise_token_id=vocab - 1,
        dspark_target_layer_ids=list(layer_ids),
        dspark_markov_rank=DSPARK["markov_rank"],
        enable_confidence_head=False,
    )
    torch.manual_seed(seed)
    model = ReferenceDSV4DSpark(hf, features=len(layer_ids), rank=DSPARK["markov_rank"], sinks=None)
    save(randomize(model, seed), raw, out)


def vllm_xpress(work: Path) -> None:
    """The speculators XPress's weights in vLLM's own layout (z-lab's config and `xpress_*` keys,
    vLLM's refiner names; its default top-C, 512, binds on SmolLM2's vocabulary)."""
    from tests.helpers.xpress_vllm import vllm_layout

    vllm_layout(str(work / "speculators-xpress"), work / "vllm-xpress", SMOLLM2["num_layers"], topc=None)


# ---------------------------------------------------------------------------------------------
# timing


def score_once(
    ckpt: str, shard_dir: str, out: Path, limit: int | None = None, eagle_trees=None, steps: int | None = None
) -> dict:
    """One `run_score` (all anchors, chain only; `eagle_trees` [] for an EAGLE-3 drafter's chain
    alone; `steps` a chain's drafts, `score --steps`) of one checkpoint: wall, others' CPU, stages."""
    from pipeline.common import timing
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    clock = StageClock()
    with Phase() as phase, timing.recording(clock):
        [outcome] = run_score(
            ScoreConfig(
                ckpts=[ckpt],
                shards=shard_dir,
                out=str(out),
                tree_nodes=[],
                eagle_trees=eagle_trees,
                force=True,
                limit=limit,
                steps=steps,
            )
        )
    assert outcome.status == "scored", outcome.error
    record = outcome.record
    assert not record["nonfinite_drafter"], record["nonfinite_drafter"]
    return {
        "wall_s": phase.seconds,
        "others_cpu": phase.others_cpu,
        "anchors": record["anchors"],
        "scored_as": [record["checkpoint"]["family"], record["checkpoint"]["layout"]],
        "replay_s": clock.get("replay anchors"),
        "replay_own_s": clock.get("replay anchors", own=True),
        "stages": clock.figures(),
    }


@torch.inference_mode()
def extra_work(ckpt: str, lm_head: torch.Tensor, anchors: int, reps: int = 3) -> dict:
    """The family's proposal rule beyond its lm_head GEMM, on the product's loaded model: one
    `drafts()` call on random hidden states of `anchors` full blocks, less the product's own
    "lm_head" stage inside it (DFlash2: top-k, pair scores, argmax, scatter; DSpark: Markov and
    confidence heads). Min over `reps` calls after a warm-up; seconds per anchor."""
    from pipeline.common import timing
    from proposers.checkpoints.load import load_drafter

    drafter, _ = load_drafter(ckpt, dtype=torch.float32, target_layers=SMOLLM2["num_layers"])
    generator = torch.Generator().manual_seed(0)
    # a whole-block family (XPress) reads every block slot, the anchor's too
    depth = drafter.config.block_size if drafter.config.whole_block else drafter.config.max_drafts
    hidden = torch.randn(anchors, depth, SMOLLM2["hidden_size"], generator=generator)
    previous = torch.randint(0, SMOLLM2["vocab_size"], (anchors, depth), generator=generator)
    drafter.drafts(hidden, lm_head, previous)  # warm-up
    calls = []
    for _ in range(reps):
        clock = StageClock()
        with Phase() as phase, timing.recording(clock):
            drafter.drafts(hidden, lm_head, previous)
        gemm = clock.get("lm_head") or 0.0
        calls.append({"drafts_s": phase.seconds, "lm_head_s": gemm, "others_cpu": phase.others_cpu})
    best = min(calls, key=lambda c: c["drafts_s"] - c["lm_head_s"])
    return {
        "anchors": anchors,
        "depth": depth,
        **best,
        "extra_s_per_anchor": (best["drafts_s"] - best["lm_head_s"]) / anchors,
        "calls": calls,
    }


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.common.layer_ids import build_target_layer_ids
    from pipeline.shards import ShardSet

    args = ctx.args
    work = Path(ctx.work) / "families"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [48] if args.quick else [64, 96, 112, 128]
    reps = args.reps
    try:
        hidden, vocab, num_layers = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], SMOLLM2["num_layers"]
        layer_ids = build_target_layer_ids(num_layers, 5)
        log(f"families: synthetic shards at SmolLM2 shapes ({lengths} tokens), {len(LAYOUTS)} drafters ...")
        with Phase() as build:
            shard_dir = str(work / "shards")
            write_synthetic_shards(Path(shard_dir), lengths, hidden, vocab, num_layers, layer_ids, PROMPT_TOKENS)
            ckpts = build_drafters(work / "drafters", layer_ids)
        log(f"families:   built in {build.seconds:.1f}s; warm-up (one sample) ...")
        score_once(ckpts[LAYOUTS[0][0]], shard_dir, work / "warm-up", limit=1)
        runs = {key: [] for key in ckpts}
        for rep in range(reps):
            order = list(ckpts) if rep % 2 == 0 else list(reversed(ckpts))
            log(f"families: round {rep + 1}/{reps} ({'forward' if rep % 2 == 0 else 'backward'}) ...")
            for key in order:
                runs[key].append(score_once(ckpts[key], shard_dir, work / "results" / key))
        best = {key: min(r, key=lambda x: x["wall_s"]) for key, r in runs.items()}
        log("families: the selector and the Markov heads alone, on the loaded models ...")
        lm_head = ShardSet(shard_dir).target_head()["lm_head"].float()
        blocks = EXTRA_ANCHORS // 2 if args.quick else EXTRA_ANCHORS
        extra = {key: extra_work(ckpts[key], lm_head, blocks) for key in EXTRA_WORK}
        result = {
            "lengths": lengths,
            "prompt_tokens": PROMPT_TOKENS,
            "layer_ids": layer_ids,
            "block_size": BLOCK_SIZE,
            "decoder": DECODER,
            "dflash2": DFLASH2,
            "dspark": DSPARK,
            "reduced_vocab": REDUCED_VOCAB,
            "threads": torch.get_num_threads(),
            "build_s": build.seconds,
            "reps": reps,
            "runs": {key: [{k: v for k, v in r.items() if k != "stages"} for r in rs] for key, rs in runs.items()},
            "best": best,
            "extra_work": extra,
        }
        summarize(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result, rows(result)


def per_anchor(seconds, anchors: int) -> float | None:
    """Milliseconds per anchor; None for a stage the run did not enter."""
    return None if seconds is None else 1e3 * seconds / anchors


def summarize(result: dict) -> None:
    """Per layout: per-anchor cost (ms), ratios to the first layout, the product's stages per
    anchor, the share of the replay the family's own extra work takes."""
    best = result["best"]
    first = best[LAYOUTS[0][0]]
    per_layout = {}
    for key, family, layout, label in LAYOUTS:
        b = best[key]
        anchors, seconds, own = b["anchors"], b["stages"]["seconds"], b["stages"]["own_seconds"]
        stages = {name: per_anchor(seconds.get(name), anchors) for name in STAGES}
        stages["drafter layers"] = per_anchor(own.get("drafter layers"), anchors)  # without its attention, masks
        stages["rest of replay"] = per_anchor(b["replay_own_s"], anchors)
        entry = {
            "label": label,
            "expected": [family, layout],
            "scored_as": b["scored_as"],
            "ms_per_anchor": per_anchor(b["wall_s"], anchors),
            "replay_ms_per_anchor": per_anchor(b["replay_s"], anchors),
            "ratio": b["wall_s"] / first["wall_s"],
            "replay_ratio": (b["replay_s"] or 0.0) / (first["replay_s"] or float("inf")),
            "stage_ms_per_anchor": stages,
            "others_cpu": b["others_cpu"],
        }
        if key in result["extra_work"]:
            e = result["extra_work"][key]
            entry["extra"] = {
                "what": EXTRA_WORK[key],
                "ms_per_anchor": 1e3 * e["extra_s_per_anchor"],
                "share_of_replay": 1e3 * e["extra_s_per_anchor"] / entry["replay_ms_per_anchor"],
                "others_cpu": e["others_cpu"],
            }
        per_layout[key] = entry
    result["layouts"] = per_layout


def rows(r: dict) -> Rows:
    out = Rows()
    layouts = r["layouts"]
    anchors = r["best"][LAYOUTS[0][0]]["anchors"]
    out.add(
        f"families: scoring cost per anchor vs z-lab DFlash v1: {anchors} anchors at SmolLM2 shapes (synthetic), "
        f"1-layer random drafters, block {r['block_size']}, all anchors, chain; min of {r['reps']} rounds"
    )
    for key, *_ in LAYOUTS:
        lay = layouts[key]
        wrong = "" if lay["scored_as"] == lay["expected"] else f" (scored as {'/'.join(map(str, lay['scored_as']))}!)"
        out.add(
            f"  {lay['label']}{wrong}",
            f"{lay['ms_per_anchor']:.1f} ms, {lay['ratio']:.2f}x (replay {lay['replay_ms_per_anchor']:.1f} ms, "
            f"{lay['replay_ratio']:.2f}x)",
            others=lay["others_cpu"],
        )
    out.add("  ms/anchor: " + " / ".join(BREAKDOWN))
    for key in BREAKDOWN_ROWS:
        lay = layouts[key]
        stages = lay["stage_ms_per_anchor"]
        out.add(f"    {lay['label']}", " / ".join(num(stages[name]) for name in BREAKDOWN.values()))
    for key in EXTRA_WORK:
        lay = layouts[key]
        e = lay["extra"]
        out.add(
            f"  {lay['label']}: {e['what']}, share of its replay",
            f"{100 * e['share_of_replay']:.0f}% ({e['ms_per_anchor']:.2f} of {lay['replay_ms_per_anchor']:.1f} ms)",
            f"< {100 * DOMINATES:.0f}%",
            e["share_of_replay"] < DOMINATES,
            others=[e["others_cpu"], lay["others_cpu"]],
            sides=[e["others_cpu"], lay["others_cpu"]],
        )
    return out
