"""What it takes to serve tests/parity/test_engine_parity_dspark_dsv4.py's tiny DeepSeek-V4 target and
DSpark drafter with llama-server, weights and all, as transformers runs them (docs/drafter-families.md#dspark):

- llama.cpp's converter reads DeepSeek's own checkpoint layout (config keys `compress_ratios`,
  `num_hash_layers`; routed experts only as MXFP4 blocks with E8M0 scales, conversion/deepseek.py:
  721-731, packed as conversion/base.py:758-790 reads them). transformers' save_pretrained already
  writes DeepSeek's tensor names (its conversion_mapping.py "deepseek_v4", reversed) under `model.`;
  `converter_dir` strips that prefix, adds the keys and packs each expert. The experts are first made
  exactly representable (`mxfp4_exact`: e2m1 values times a power of two per 32-element block), so
  the packing loses nothing and the GGUF holds the weights transformers runs.
- ggml's CPU kernel multiplies MXFP4 weights by activations rounded to Q8_0 (ggml/src/ggml-cpu/
  ggml-cpu.c:287-291, vec_dot_type GGML_TYPE_Q8_0), a rounding no torch run has: `dequantized_gguf`
  rewrites the converted GGUF's MXFP4 tensors as the F32 values they hold (gguf-py's dequantize,
  lossless), so the server's expert matmuls are F32 like every other tensor of an `--outtype f32`
  conversion.
- llama-server loads a DeepSeek-V4 target only with a compressed layer (without one it dies of
  SIGFPE, src/llama-kv-cache.cpp:1455-1457): the target's last layer is a CSA layer (ratio 4), its
  attention output zeroed (dsv4_dspark.save_target), as transformers' and llama.cpp's compressed
  attention do not agree; so served, all greedy responses are transformers'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4 e2m1 magnitudes, codes 0..7 (8..15: negated)
BLOCK = 32  # MXFP4 elements per E8M0 scale


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [.., cols] in 0..15, E8M0 exponents [.., cols / 32]) nearest to `w` along its last dim:
    each block's scale the least power of two putting its largest magnitude within 6."""
    blocks = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = blocks / torch.exp2(exponent)
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = torch.where((scaled < 0) & (index > 0), index + 8, index)
    return codes.reshape(w.shape), exponent.squeeze(-1)


def _values(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    magnitude = E2M1[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    blocks = magnitude.reshape(*codes.shape[:-1], -1, BLOCK) * torch.exp2(exponent)[..., None]
    return blocks.reshape(codes.shape)


@torch.no_grad()
def mxfp4_exact(model) -> None:
    """Round every routed expert of a transformers DeepSeek-V4 model to MXFP4's grid in place (blocks
    along the input dimension: gate_up_proj [E, 2I, H] and down_proj [E, H, I] on their last dim)."""
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4Experts":
            for weight in (module.gate_up_proj, module.down_proj):
                weight.copy_(_values(*_mxfp4(weight)))


def _packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's MXFP4 layout of an exactly representable [rows, cols] weight: uint8 [rows, cols/2]
    (element 2i in the low nibble) and E8M0 uint8 [rows, cols/32] (conversion/base.py:763-766)."""
    codes, exponent = _mxfp4(w)
    assert torch.equal(_values(codes, exponent), w.float()), "an expert weight is not MXFP4-exact"
    pairs = codes.to(torch.uint8).reshape(w.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + 127).to(torch.uint8)


def _deepseek_name(name: str) -> str:
    """transformers' reversed name -> DeepSeek's: no `model.` prefix, `embed`, `hc_head_*`, and the
    attention's kv_norm as `attn.kv_norm` (transformers' one `.norm.` -> `.kv_norm.` rename reverses
    it to the compressors' `norm`)."""
    name = name.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
    return "embed.weight" if name == "embed_tokens.weight" else name.replace("hc_head.hc_", "hc_head_")


def converter_dir(model_dir, out_dir, prefix: str = "") -> str:
    """`model_dir` (a transformers save of an MXFP4-exact DeepSeek-V4 target, or a DSpark checkpoint's
    `mtp.*` when `prefix` is "mtp.") in the layout llama.cpp's converter reads: DeepSeek's names, each
    routed expert packed with its scale, config keys compress_ratios and num_hash_layers added."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    state = {}
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        name = name if prefix else _deepseek_name(name)
        if ".ffn.experts." in name and name.startswith(prefix):
            state[name], state[name.removesuffix(".weight") + ".scale"] = _packed(tensor)
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not prefix:
        config = json.loads((out / "config.json").read_text())
        ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        config.update(compress_ratios=[ratios[t] for t in config["layer_types"]], num_hash_layers=0)
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def dequantized_gguf(path) -> str:
    """Rewrite the GGUF at `path` in place with its MXFP4 tensors as F32 (the values they hold)."""
    import sys

    from tools.llama_convert import CONVERTER_DIR

    sys.path.insert(0, str(CONVERTER_DIR / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = Path(f"{path}.f32")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = tensor.data
        if tensor.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            data = gguf.quants.dequantize(data, tensor.tensor_type).astype("float32")
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return str(path)


# -- the probe: the module's target and a fitted drafter against llama-server, step for step ---------


def probe(out_dir, n_max: int = 4, prompts: int = 8, max_new: int = 24, fit_steps: int = 60) -> dict:
    """Not a test (the counts are not matched yet; docs/drafter-families.md#dspark): the parity module's
    target and drafter, converted and served with `--spec-type draft-dspark`, each prompt on a server slot
    of its own; per sample whether the server's response is the stored one and its (accepted, drafted)
    steps beside `score --walk-rule llama.cpp`'s. `python -m tests.helpers.dsv4_served OUT_DIR`."""
    from transformers import AutoModelForCausalLM

    from pipeline.shards import ShardSet
    from tests.helpers import chain_parity as chains, dsv4_dspark as d4, engine_parity as parity, llama_engine as engine
    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts
    from tools.llama_convert import convert

    tmp = Path(out_dir)
    model_dir = d4.save_target(tmp / "target")
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(parity.prompt_ids(prompts))]
    shards = chains.extract(
        tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), max_new, d4.STORED
    )
    stored = {s.sample_id: s for s in ShardSet(shards).samples(tensors=[])}
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with seeded(1):
        reference = d4.ReferenceDSV4DSpark()
    d4.fit(reference, target, [(s.input_ids, s.prompt_len) for s in stored.values()], fit_steps, 2e-2)
    mxfp4_exact(reference)
    ckpt = d4.save(reference.eval().requires_grad_(False), d4.drafter_config(), tmp / "drafter")
    served = converter_dir(model_dir, tmp / "target-conv")
    target_gguf = dequantized_gguf(convert(served, tmp / "target.gguf"))
    drafter_gguf = dequantized_gguf(
        convert(converter_dir(ckpt, tmp / "drafter-conv", "mtp."), tmp / "drafter.gguf", served)
    )
    walk = engine.walk_counts(
        chains.score(ckpt, shards, tmp / "score", eagle_trees=[], walk_rule="llama.cpp", steps=n_max)
    )
    log = tmp / f"server-n{n_max}.log"
    with engine.serving(target_gguf, drafter_gguf, "draft-dspark", n_max, log, slots=len(stored)) as server:
        runs = {sid: engine.engine_run(server, s.input_ids[: s.prompt_len].tolist(), max_new, i)
                for i, (sid, s) in enumerate(stored.items())}  # fmt: skip
    return {
        sid: dict(same_response=runs[sid].tokens == s.input_ids[s.prompt_len :].tolist(), server=runs[sid].steps,
                  replay=walk.get(sid, []))
        for sid, s in stored.items()
    }  # fmt: skip


if __name__ == "__main__":
    import sys

    for sid, found in probe(sys.argv[1]).items():
        print(sid, found)
