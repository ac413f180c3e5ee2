"""The drafter checkpoints of tests/proposers/test_gguf_drafters.py and the target llama.cpp's
converter converts them for, all at SmolLM2's vocabulary: the converter refuses a tokenizer whose
pre-tokenizer hash it does not know, and SmolLM2's is known (`smollm`).

Every drafter is built by its reference's own classes with random weights (z-lab's `dflash.model`,
speculators' DSparkDraftModel and Eagle3DraftModel), saved by their own save_pretrained, or
written in another layout from those weights as tests/helpers/dspark_reference.py and
eagle3_reference.py write them (DeepSpec, SpecForge), plus the vLLM/AngelSlim layout llama.cpp's
converter also reads (`Eagle3LlamaForCausalLM`: SpecForge's tensors, the before-layer ids at the
top level).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import save_file

from tests.helpers import dflash2_reference, drafters, eagle3_reference
from tests.helpers.llama_engine import smollm2_tokenizer
from tests.helpers.models import seeded, text_kwargs
from tools.llama_convert import converter

VOCAB = 49152  # SmolLM2's tokenizer
HIDDEN = 64
TARGET_LAYERS = 8  # EAGLE-3's default ids [2, L // 2, L - 3] name three different layers
FEATURE_LAYERS = [1, 3, 4]  # extracted: output-of-layer ids
TARGET = {"hidden_size": HIDDEN, "num_layers": TARGET_LAYERS, "vocab_size": VOCAB}
MASK = VOCAB - 1
BLOCK_IDS = (1, 3)  # the block drafters' feature layers (output of layer i)
EAGLE_AUX = (2, 4, 5)  # EAGLE-3's before-layer ids: the converter's default for 8 layers, [1, 3, 4] ours
DRAFT_VOCAB = 1024
STD = 0.2


def smollm2_target(save_dir) -> str:
    """A tiny random Qwen3 (hidden 64, 8 layers) at SmolLM2's vocabulary, with SmolLM2's tokenizer
    as extract's `--model smollm2` writes it (llama_engine.smollm2_tokenizer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**text_kwargs(TARGET_LAYERS), "vocab_size": VOCAB}, rope_theta=10000.0)
    with seeded(0):
        model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(str(save_dir))
    smollm2_tokenizer(save_dir)
    return str(save_dir)


# --------------------------------------------------------------------------- z-lab: DFlash, DFlash2


def zlab_dflash(save_dir, **config) -> str:
    """z-lab's DFlashDraftModel (one layer) for TARGET; `config` overrides drafter_config's fields."""
    fields = dict(target=TARGET, layers=1, layer_ids=BLOCK_IDS, num_heads=4, intermediate_size=128, mask_token_id=MASK)
    drafters.reference_drafter(save_dir, **{**fields, **config})
    return str(save_dir)


def zlab_dflash2(save_dir) -> str:
    """z-lab's DFlash2DraftModel (one layer, its selector drawn wide) for TARGET."""
    fields = dict(target=TARGET, layers=1, layer_ids=BLOCK_IDS, num_heads=4, intermediate_size=128, mask_token_id=MASK)
    dflash2_reference.zlab_dflash2(save_dir, **fields)
    return str(save_dir)


# --------------------------------------------------------------------------- DSpark


def _decoder(kind: str = "qwen3"):
    return eagle3_reference.decoder_config(kind, vocab=VOCAB, hidden=HIDDEN)


def speculators_dspark(save_dir, draft_vocab: int | None = DRAFT_VOCAB, seed: int = 0):
    """speculators' DSparkDraftModel (one layer, Markov rank 16, a confidence head over [h ; W1[prev]],
    sample_from_anchor stated) with random weights, `draft_vocab` random target ids drafted (None:
    all); saved. Returns the model."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = DSparkSpeculatorConfig(
        transformer_layer_config=_decoder(),
        draft_vocab_size=draft_vocab or VOCAB,
        block_size=4,
        aux_hidden_state_layer_ids=[i + 1 for i in BLOCK_IDS],
        mask_token_id=MASK,
        sample_from_anchor=True,  # stated: the converter reads a speculators export without it as false
        markov_rank=16,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    with seeded(seed), torch.no_grad():
        model = DSparkDraftModel(config)
        for parameter in model.parameters():
            parameter.normal_(0.0, STD)
        if draft_vocab:
            selected = torch.randperm(VOCAB)[:draft_vocab].sort().values
            t2d = torch.zeros(VOCAB, dtype=torch.bool)
            t2d[selected] = True
            model.load_vocab_mappings(t2d, selected - torch.arange(draft_vocab))
    model.eval().save_pretrained(str(save_dir))
    return model


def deepspec_dspark(save_dir, reference) -> str:
    """The full-vocabulary speculators DSpark `reference`'s weights as DeepSpec saves a
    Qwen3DSparkModel (a flat Qwen3 config with the draft fields; its own embedding and lm_head),
    the lm_head tied to the embedding: llama.cpp's converter drops a full-vocabulary DSpark lm_head
    and runs the embedding in its place (a DeepSpec drafter of a tied target)."""
    decoder = reference.config.transformer_layer_config.to_diff_dict()
    raw = {k: v for k, v in decoder.items() if k not in ("transformers_version", "_attn_implementation_autoset")}
    raw.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        tie_word_embeddings=False,
        block_size=reference.block_size,
        mask_token_id=MASK,
        target_layer_ids=list(BLOCK_IDS),
        num_target_layers=TARGET_LAYERS,
        num_anchors=512,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=16,
        markov_head_type="vanilla",
    )
    skip = ("embed_tokens.", "lm_head.", "verifier_", "t2d", "d2t")
    state = {k: v.clone().contiguous() for k, v in reference.state_dict().items() if not k.startswith(skip)}
    embed = reference.embed_tokens.weight.detach().clone()
    state.update({"embed_tokens.weight": embed, "lm_head.weight": embed.clone()})
    return _write(save_dir, raw, state)


# --------------------------------------------------------------------------- EAGLE-3


def speculators_eagle3(save_dir, seed: int = 0) -> str:
    """speculators' Eagle3DraftModel (Llama layer, 3 steps, a DRAFT_VOCAB-token vocabulary, its own
    random embedding) with random weights; saved."""
    with seeded(seed):
        draft = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    model = eagle3_reference.speculators_eagle3(
        vocab=VOCAB, hidden=HIDDEN, aux_ids=EAGLE_AUX, steps=3, kind="llama", draft_vocab=draft, std=STD, seed=seed
    )
    return eagle3_reference.save(model, save_dir)


def specforge_eagle3(speculators_dir, save_dir) -> str:
    """The same weights in SpecForge's layout (`midlayer.*`, nested output-of-layer ids, no embedding)."""
    return eagle3_reference.write_specforge(speculators_dir, save_dir, TARGET_LAYERS)


def angelslim_eagle3(specforge_dir, save_dir) -> str:
    """SpecForge's tensors under vLLM's / AngelSlim's `Eagle3LlamaForCausalLM` config: the decoder at
    the top level, the before-layer ids (vLLM's numbering) as top-level eagle_aux_hidden_state_layer_ids."""
    with open(os.path.join(specforge_dir, "config.json")) as f:
        raw = json.load(f)
    raw.pop("eagle_config")
    raw.update(architectures=["Eagle3LlamaForCausalLM"], eagle_aux_hidden_state_layer_ids=list(EAGLE_AUX))
    os.makedirs(save_dir, exist_ok=True)
    shutil.copy(os.path.join(specforge_dir, "model.safetensors"), os.path.join(save_dir, "model.safetensors"))
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return str(save_dir)


# --------------------------------------------------------------------------- bad drafters


def with_mask_embedding(zlab_dir, save_dir) -> str:
    """A copy of a z-lab DFlash drafter with a mask_embedding.pt beside it (the converter then writes
    the target's embedding, its mask row replaced, and head into the GGUF)."""
    shutil.copytree(zlab_dir, save_dir)
    with seeded(1):
        vector = torch.randn(HIDDEN)
    torch.save({"mask_token_id": MASK, "embedding": vector}, os.path.join(save_dir, "mask_embedding.pt"))
    return str(save_dir)


# --------------------------------------------------------------------------- converting

# Runs the converter script once per job in one process: its imports (torch, transformers: seconds)
# are paid once a process instead of once a file. Each job is the converter's own command line.
CONVERT_EACH = r"""
import json, os, runpy, sys, traceback
converter, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(converter))  # as running the script puts its folder first
for argv in jobs:
    sys.argv = [converter, *argv]
    try:
        runpy.run_path(converter, run_name="__main__")
    except SystemExit as error:
        if error.code:
            print(f"CONVERSION FAILED {argv}: exit {error.code}", flush=True)
    except Exception:
        print(f"CONVERSION FAILED {argv}:\n{traceback.format_exc()}", flush=True)
"""


def convert_all(jobs, workers: int = 2) -> None:
    """llama.cpp's convert_hf_to_gguf.py (as `make setup` installs it, tools/llama_convert.py) on every
    job (model dir, GGUF out, target dir or None, outtype), `workers` processes converting their
    shares in turn; raises with the converter's output when any conversion fails."""
    argvs = []
    for model_dir, out, target_dir, outtype in jobs:
        target = ["--target-model-dir", str(target_dir)] if target_dir else []
        argvs.append([str(model_dir), "--outtype", outtype, "--outfile", str(out), *target])
    shares = [argvs[i::workers] for i in range(workers) if argvs[i::workers]]
    command = [sys.executable, "-c", CONVERT_EACH, str(converter())]
    processes = [
        subprocess.Popen([*command, json.dumps(share)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for share in shares
    ]
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    failed = any(p.returncode for p in processes) or any("CONVERSION FAILED" in out for out in outputs)
    assert not failed, "\n".join(output[-4000:] for output in outputs)


def _write(save_dir, raw: dict, state: dict) -> str:
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    save_file(state, os.path.join(save_dir, "model.safetensors"))
    return str(save_dir)
