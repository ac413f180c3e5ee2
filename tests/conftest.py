"""pytest fixtures and hooks for the whole suite. The helpers they and the tests use live in
tests/helpers/ (import them as `from tests.helpers.models import build_tiny_qwen3`).

  hooks     pytest_configure: a missing reference package stops the suite at once, one line
            saying what to install (the tests that need it are never skipped);
            pytest_collection_modifyitems: the modules holding slow tests run first
  fixtures  torch_threads_kept (every test: torch's thread count as it found it), tiny_qwen3_dir, tiny_qwen35_hybrid_dir, tiny_qwen35_vlm_dir (session scope, return
            str paths; tests/helpers/models.py builds them)
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

from tests.helpers.models import build_tiny_qwen3, build_tiny_qwen35_hybrid, build_tiny_qwen35_vlm

# The public references the parity tests compare with (PyPI dflash 0.1.0 and speculators 0.9.0,
# installed with --no-deps by `make setup`): without them those tests cannot run, and a suite that
# skipped them would pass.
REFERENCE_PACKAGES = {
    "dflash": "dflash==0.1.0",
    "speculators": "speculators==0.9.0",
    "eagle.model.cnets": "eagle-llm==1.2.1",  # the EAGLE repository (EAGLE-1/2 parity)
    "specforge.modeling.draft.peagle": "specforge==0.2.0",  # SpecForge's P-EAGLE (its layout's parity)
}


def missing_reference() -> str | None:
    """Why a reference package cannot be imported (absent, or a module its import needs), or None."""
    for name, pin in REFERENCE_PACKAGES.items():
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return f"reference package {name} is missing: run `make setup` (it installs {pin} with --no-deps)"
        try:
            with warnings.catch_warnings():  # its dependencies' deprecation notices, at every start
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except ImportError as error:
            return f"reference package {name} does not import ({error}): run `make setup` (it installs what it needs)"
    return missing_engine()


def missing_engine() -> str | None:
    """Why the real engine the engine-parity tests run (llama-server, llama.cpp's converter) is not
    there, or None."""
    from tools.llama_convert import CONVERTER_DIR
    from tools.llama_server import llama_server_runs

    if not llama_server_runs():
        return "llama-server is not built or does not start: run `make setup` (it builds llama.cpp's server)"
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file() or importlib.util.find_spec("sentencepiece") is None:
        return f"llama.cpp's converter is missing from {CONVERTER_DIR} (or sentencepiece): run `make setup`"
    return None


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter starts: the message is the one line printed
def pytest_configure(config):
    problem = missing_reference()
    if problem:
        pytest.exit(problem, returncode=3)
    share_the_cores()


def pytest_collection_modifyitems(config, items):
    """The modules holding slow tests first, each module's tests kept together and in order: under
    `--dist loadscope` a worker takes a whole module at a time, in this order, so the minutes-long
    modules start while the other worker still has many short ones to take. In collection order
    the longest ones came last and one worker ran them alone for minutes at the end."""
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:  # the longest first among the slow (longest job first: the shortest tail)
        module = item.nodeid.split("::")[0]
        return (module not in slow_modules, LONGEST.index(module) if module in LONGEST else len(LONGEST))

    items.sort(key=rank)  # stable: order kept within each module


# the modules that took longest under `make test --durations` (a minute or more each on 2 cores)
LONGEST = [
    "tests/parity/test_engine_parity_smollm2.py",
    "tests/parity/test_sampling_parity.py",
    "tests/faults/test_disk_full.py",
    "tests/faults/test_killed_score.py",
    "tests/parity/test_engine_parity_mtp_moe.py",
    "tests/parity/test_engine_parity_mtp.py",
]


def share_the_cores() -> None:
    """Under pytest-xdist, each worker's share of the cores for torch and for the processes it
    starts (CLI runs, torchrun, llama-server): W workers each running as many threads as there are
    cores oversubscribe them, and OpenMP's spinning threads then slow small calls many times over.
    Thread counts a caller set in the environment stay."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LLAMA_ARG_THREADS"):
        os.environ.setdefault(name, share)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """torch's intra-op thread count restored after each test: a command run in-process
    (`profile --engine torch` sets it from --threads, all cores by default) would leave the worker
    on every core beside the other worker, and OpenMP's spinning then slowed the tests that ran
    after it in that worker 4x (the sampled parity tests: 180 s for 40)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen35_hybrid_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_hybrid(tmp_path_factory.mktemp("tiny_qwen35_hybrid"))


@pytest.fixture(scope="session")
def tiny_qwen35_vlm_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny_qwen35_vlm"))
