"""The import rules the design rests on, read from the code itself: stage 1 (pipeline/) never
imports stage 2 (scoring/) or the CLI; scoring/ never imports target loading, generation,
capture or extract (it needs nothing of the target beyond the shards); the CLI's help loads
neither torch nor pyarrow."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_SIDE = {"pipeline.extract"}  # stage 1: target loading, generation, capture, the extract run


def imported_modules(package: str) -> dict[str, set[str]]:
    """file -> every module it imports (top-level or inside functions)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_pipeline_never_imports_scoring_or_the_cli():
    for path, names in imported_modules("pipeline").items():
        bad = sorted(n for n in names if n.split(".")[0] in ("scoring", "specreplay"))
        assert not bad, f"{path} imports {bad}"


def test_scoring_never_imports_target_side_code():
    for path, names in imported_modules("scoring").items():
        bad = sorted(n for n in names if any(n == m or n.startswith(m + ".") for m in TARGET_SIDE))
        assert not bad and not any(n.split(".")[0] == "specreplay" for n in names), f"{path} imports {bad}"


def test_the_rule_checker_sees_function_level_imports():
    # the checker must see imports inside function bodies, where the lazy CLI keeps them
    names = imported_modules("specreplay")["specreplay/commands/score.py"]
    assert "scoring.score.run" in names


def test_help_imports_neither_torch_nor_pyarrow():
    for args in (
        ["--help"],
        ["score", "--help"],
        ["extract", "--help"],
        ["import", "--help"],
        ["compare", "--help"],
        ["diagnose", "--help"],
    ):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "specreplay", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
        assert "click" in loaded, "importtime output not understood"
        assert not loaded & {"torch", "pyarrow", "polars", "transformers"}, (args, loaded & {"torch", "pyarrow"})


PRODUCT = ("pipeline", "scoring", "specreplay")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))}


def import_edges(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the product modules it imports, at the top or inside a function: an import
    deferred into a function body still closes a circle, it only moves where it breaks."""
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_product():
    assert cycles(import_edges(product_modules())) == []


def test_the_cycle_check_finds_a_cycle():
    # the checker itself: a -> b -> c -> a is one component, d (imported, importing nothing) none
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c"]]


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` loads, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_stage_2_and_the_shared_code_never_load_stage_1_even_indirectly():
    # a shared module (pipeline/shards, pipeline/common) importing stage 1 would bring target loading into
    # every score run without scoring/ naming it; stage 1's output directory (pipeline/outdir) serves
    # extract and import alike, so it too stays clear of extract's code
    edges = import_edges(product_modules())
    shared = ("pipeline.common", "pipeline.shards", "pipeline.outdir")
    for module in sorted(m for m in edges if m.split(".")[0] == "scoring" or m.startswith(shared)):
        stage_1 = sorted(m for m in reachable(edges, module) if m.startswith("pipeline.extract"))
        assert not stage_1, f"{module} loads {stage_1}"
