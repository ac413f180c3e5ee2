"""Helpers shared by the tests (and by tools/fuzz_inputs.py, tools/fault_sweeps.py); import them
as `from tests.helpers.<module> import ...`. tests/conftest.py holds only fixtures and hooks.

  models           tiny random targets and the tokenizer: make_tokenizer, build_tiny_qwen3,
                   build_tiny_qwen35_hybrid, build_tiny_qwen35_vlm, TINY_VOCAB, TINY_HIDDEN, TINY_TARGET, IM_END_ID
  drafters         drafter_config (the one config source), random_drafter, reference_drafter, fitted_drafters
  prompts          write_prompts
  shards           tiny_shards (a small real extract), same_bits
  trees            brute_force_tree (the DDTree oracle)
  browser          headless Chromium (needs_chromium, chromium_screenshot) and check_html
  processes        REPO, kill_after_first_shard
  loggers          read_tensorboard (events read back by tensorboard's own reader)
  faults           what the fault tests and tools/fault_sweeps.py share: cli, assert_same_extract, content, ...
  filesystems      tmpfs mounts for the fault tests
  online_reference online decoding loops that recompute the target every step (parity tests)
  convention_fits  drafters fitted with the public reference under a wrong convention (diagnose tests)
  fake_results     results directories built from scoring/results.py's schemas
  watch_writer     a training run writing checkpoints over time (run as a script by the watch tests)
  bad_inputs       generated bad inputs (hypothesis) and the schema oracle they are judged by
  dflash2_reference, dspark_reference   the public references' DFlash2 / DSpark models, built and saved
  family_fits, dspark_online            reference drafters fitted with their own training forward; online loops
  xpress_online                         speculators' XPress built, fitted, its K-pass Jacobi drafts and an online loop
  eagle3_reference, eagle3_online       speculators' EAGLE-3 built, run (TTT forward), written in SpecForge's
                                        layout; fitted, and driven online on a real KV cache
  chain_parity                          prompts, extract/score, walk and tau tables, z-scores of the chain parity tests
  llama_engine     a real llama-server with a drafter: the tiny target llama.cpp's converter accepts (SmolLM2's
                   tokenizer), GGUFs, the server, its per-step counts (engine parity, compare-online)
  engine_parity    what the engine-parity tests share: setup records, prompts, the per-step comparison with llama-server
  gguf_drafters    every family's drafter GGUF converted by llama.cpp's converter (GGUF drafter tests)
"""

import os

# Exact-equality tests compare two computations that differ only in where their buffers sit;
# MKL may pick alignment-dependent kernels (measured: the stored-dtype-embedding test flipped
# bits depending on which tests ran before it). Strict conditional numerical reproducibility
# makes GEMM results independent of alignment. Set here, before any helper loads torch (and MKL):
# tests/conftest.py and the tools/ scripts import these helpers first; subprocesses inherit it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# Under pytest-xdist every core runs a worker already: one intra-op thread each (and for the
# subprocesses they start), rather than two workers each spinning two threads on two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")
