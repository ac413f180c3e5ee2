"""What the engine-parity tests share (tests/parity/test_engine_parity.py, test_engine_parity_smollm2.py,
test_engine_parity_mtp.py): the setup and drafter records, the prompts, a drafter's conversion, and the
comparison of specreplay's llama.cpp walk with a running llama-server's per-step counts (llama_engine.py
serves and reads it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, llama_engine as engine

MAX_NEW = 32
PROMPTS = 12
MOST_DIFFERING = 1  # engine responses allowed to differ from the stored ones (float rounding)
# The draft-simple tests' draft model (llama_engine.fitted_draft_model): 15 steps at lr 1e-2 in
# place of its default 40 at 3e-3 (12 s less a fit at SmolLM2's vocabulary). Measured: the tiny
# target's 2.69 drafts accepted a step at n_max 4 (bar 0.4), 0.87 at 1 (bar 0.1), 2 stop tokens
# drafted last; SmolLM2's 2.52 at 4 (bar 0.2); a third of the drafts rejected, so compared too.
DRAFT_FIT = dict(steps=15, lr=1e-2)
TABLE: list[str] = []  # one row per case compared, printed when a module ends
TABLE_HEADER = (
    "family  layout       n_max  samples  differing  steps  cut  stop-last  accepted/drafted  dflash-rule differs"
)


@dataclass(frozen=True)
class Setup:
    tmp: Path
    target: str  # the HF directory
    target_gguf: str
    shards: str  # extracted from the HF directory, greedy
    sequences: list  # (ids, prompt length) the drafters are fitted on: llama_engine.continuations
    converter: engine.Converter | None
    max_new: int = MAX_NEW  # the extract's budget, each request's n_predict


@dataclass(frozen=True)
class Drafter:
    family: str
    layout: str
    path: str  # the checkpoint specreplay scores
    gguf: str  # the same drafter converted by llama.cpp's converter
    spec_type: str  # llama-server --spec-type
    drafts: int  # drafts of the trained block / chain: what --walk-rule dflash runs
    flags: tuple[str, ...] = ()  # more llama-server options (an n-gram type's sizes)
    steps: bool = True  # `score --steps` = the server's --spec-draft-n-max (n-gram types ignore that flag)


def converted(setup: Setup, family: str, layout: str, path: str, spec_type: str, drafts: int) -> Drafter:
    """The drafter at `path` converted by the setup's llama.cpp converter (beside its target)."""
    gguf = setup.converter.convert(path, setup.tmp / f"{family}-{layout}.gguf", target_dir=setup.target)
    return Drafter(family, layout, path, gguf, spec_type, drafts)


def prompt_ids(count: int, seed: int = 7) -> list[list[int]]:
    """Ids 300..699: none of the ids the target emits (llama_engine.engine_target's live ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 700, (6 + i % 4,), generator=gen).tolist() for i in range(count)]


def threads_and_table(family_prefix: str):
    """A module fixture's body: one intra-op thread (on shared cores OpenMP's spinning workers slow
    tiny calls down), then the rows of TABLE starting with `family_prefix` printed at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\n" + TABLE_HEADER)
    print("\n".join(row for row in TABLE if row.startswith(family_prefix)))


def assert_engine_counts(
    setup: Setup,
    drafter: Drafter,
    n_max: int,
    most_differing: int = MOST_DIFFERING,
    per_step: float = 0.2,
    fresh_slots: bool = False,
) -> dict:
    """Score with the llama.cpp rule, serve, and compare per sample whose engine response is the
    stored one; the default rule's walk must differ somewhere when it runs the same block.
    `fresh_slots`: every request on a server slot of its own, which no earlier request has left
    state in. Returns the llama.cpp rule's walk counts."""
    tmp, shards, name = setup.tmp, setup.shards, f"{drafter.family}-{drafter.layout}-n{n_max}"
    walk = engine.walk_counts(scored(setup, drafter, n_max, "llama.cpp"))
    stored = {s.sample_id: s for s in ShardSet(shards).samples(tensors=[])}
    slots = len(stored) if fresh_slots else 1
    log = tmp / f"{name}.log"
    with engine.serving(setup.target_gguf, drafter.gguf, drafter.spec_type, n_max, log, slots, drafter.flags) as server:
        runs = {
            sid: engine.engine_run(
                server, s.input_ids[: s.prompt_len].tolist(), setup.max_new, i if fresh_slots else None
            )
            for i, (sid, s) in enumerate(stored.items())
        }
    same = [sid for sid, s in stored.items() if runs[sid].tokens == s.input_ids[s.prompt_len :].tolist()]
    for sid in same:
        run = runs[sid]
        assert run.steps == walk.get(sid, []), (sid, run.steps, walk.get(sid))
        assert (sum(a for a, _ in run.steps), sum(d for _, d in run.steps)) == (run.draft_n_accepted, run.draft_n)
    differs = "-"
    if n_max == drafter.drafts:
        wrong = engine.walk_counts(scored(setup, drafter, n_max, "dflash"))
        differs = sum(runs[sid].steps != wrong.get(sid, []) for sid in same)
    steps = [step for sid in same for step in runs[sid].steps]
    accepted, drafted, cut = sum(a for a, _ in steps), sum(d for _, d in steps), sum(d < n_max for _, d in steps)
    last = sum(stop_drafted_last(runs[sid], stored[sid], setup.max_new) for sid in same)
    TABLE.append(
        f"{drafter.family:<7} {drafter.layout:<12} {n_max:>5}  {len(same):>7}  {len(stored) - len(same):>9}  "
        f"{len(steps):>5}  {cut:>3}  {last:>9}  {accepted:>7}/{drafted:<8}  {differs}"
    )
    print(f"\n{TABLE[-1]}")
    assert len(stored) - len(same) <= most_differing, f"{len(stored) - len(same)} engine responses differ"
    assert accepted / len(steps) > per_step * n_max, (accepted, len(steps))  # blocks accept several drafts
    assert cut > 0 or n_max == 1  # drafts cut near the budget were compared (one draft is never cut, only dropped)
    assert last > 0 or n_max > 1  # one draft a step: some response's stop token was drafted and accepted
    assert differs != 0  # the comparison can fail: the reference's rule is not the engine's
    return walk


def stop_drafted_last(run: engine.EngineRun, sample, max_new: int) -> bool:
    """Whether the engine counted an accepted draft past the stored response: a stop token
    accepted as the last draft, the bonus token after it dropped (common/sampling.cpp:696-707).
    Before the budget's last token every step drafts, so the tokens it accounts for are the
    prefill's one plus accepted + 1 a step."""
    response = sample.input_ids[sample.prompt_len :]
    accounted = 1 + sum(a + 1 for a, _ in run.steps)
    return sample.finish_reason == "eos" and response.numel() < max_new - 1 and accounted > response.numel()


def score(drafter: Drafter, shards: str, out, **options) -> str:
    return chains.score(drafter.path, shards, out, eagle_trees=[], **options)


def scored(setup: Setup, drafter: Drafter, n_max: int, rule: str) -> str:
    """`drafter` scored under walk rule `rule` (llama.cpp: `n_max` drafts a step; dflash: the
    trained block), once per module: a later test asking for the same gets the same directory."""
    out = setup.tmp / f"{drafter.family}-{drafter.layout}-{Path(drafter.path).stem}-n{n_max}-{rule}"
    steps = dict(walk_rule="llama.cpp", steps=n_max if drafter.steps else None) if rule == "llama.cpp" else {}
    return score(drafter, setup.shards, out, force=False, **steps)


def native_mtp_setup(
    tmp,
    target,
    *,
    layers: int,
    steps: int,
    fit_steps: int,
    fit_lr: float,
    prepare=None,
    experts: bool = False,
    nextn: bool = False,
    fitted: dict | None = None,
):
    """(Setup, Drafter, the fit's last loss) of a target's native MTP head against llama-server's
    draft-mtp: `target` (a tiny Qwen3.5 or Qwen3.5-MoE causal LM) made the engine target
    (llama_engine.engine_target), `prepare(model_dir)` run on its directory, a head of its
    full-attention layer kind fitted on its greedy continuations (mtp_online.fit) and saved into its
    checkpoint as `mtp.*`, shards of id L (the final state before the norm, whose weight the shards'
    target head keeps), the target converted with the head kept as blk.L.nextn.*. `experts`: the
    head's fused experts saved one expert at a time, as the target's save_pretrained names them.
    `nextn`: a GLM-4.5 target's NextN head (nextn_online.NextnHead) saved as `model.layers.{L}.*`.
    `fitted`: a dict given the fitted head (`head`), for a test's own online reference."""
    import copy

    from tests.helpers import mtp_online, nextn_online
    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts
    from tools.llama_convert import convert

    prompts = prompt_ids(PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, MAX_NEW, model=target)
    if prepare is not None:
        prepare(model_dir)
    sequences = engine.continuations(model_dir, prompts, MAX_NEW)
    head_config = copy.deepcopy(target.config)  # MtpHead builds layer 0 of it: a full-attention one
    head_config.layer_types = ["full_attention"] * layers
    with seeded(1):
        head = nextn_online.NextnHead(head_config) if nextn else mtp_online.MtpHead(head_config)
    loss = mtp_online.fit(head, target, [ids for ids, _ in sequences], steps=fit_steps, lr=fit_lr)
    if fitted is not None:
        fitted["head"] = head
    if nextn:
        nextn_online.save_head(head, model_dir, target)
    else:
        mtp_online.save_head(head.eval(), model_dir, target if experts else None)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, [layers])
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish
    gguf = str(convert(model_dir, tmp / "target.gguf"))
    setup = Setup(tmp, model_dir, gguf, shards, sequences, converter=None)
    layout = "nextn" if nextn else "native"
    return setup, Drafter("mtp", layout, model_dir, None, "draft-mtp", steps), loss


def keep_saved_tokenizer_class(model_dir: str) -> None:
    """An auto_map entry in the target's tokenizer_config.json making AutoTokenizer load the saved
    class (TokenizersBackend): transformers 5.25 loads some model types' tokenizers as their own
    class whatever the file says (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: Qwen3.5-MoE's, whose
    pre-tokenizer is not SmolLM2's, so llama.cpp's converter refuses its hash)."""
    path = f"{model_dir}/tokenizer_config.json"
    with open(path) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoTokenizer": [None, "TokenizersBackend"]}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
