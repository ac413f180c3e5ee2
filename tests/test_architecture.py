"""The import rules the design rests on, read from the code itself: stage 1 (pipeline/) never
imports stage 2 (scoring/) or the CLI, and of proposers/ only the torch-free layouts; scoring/ never
imports target loading, generation, capture or extract (it needs nothing of the target beyond the
shards); proposer families share neutral modules, never each other's; the CLI's help loads neither
torch nor pyarrow. And the layout limits: no module over 500 lines, no folder over 16 modules, no
product function over 60 lines unless its def line says why (`# N lines: ...`)."""

from __future__ import annotations

import ast
import pathlib
import re
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


# what stage 1 may read of proposers/: the declared config layouts, which load without torch
TORCH_FREE_PROPOSERS = re.compile(
    r"proposers(\.(layouts|registry|[a-z0-9_]+\.layout|toolkit\.(layout_fields|zlab_layout|speculators_layout)))?(\.\w+)?$"
)


def test_pipeline_reads_only_the_torch_free_layouts_of_proposers():
    for path, names in imported_modules("pipeline").items():
        bad = sorted(n for n in names if n.startswith("proposers") and not TORCH_FREE_PROPOSERS.match(n))
        assert not bad, f"{path} imports {bad}"


def test_proposers_never_import_scoring_pipeline_stage_1_or_the_cli():
    for path, names in imported_modules("proposers").items():
        bad = sorted(
            n for n in names if n.split(".")[0] in ("scoring", "specreplay") or n.startswith("pipeline.extract")
        )
        assert not bad, f"{path} imports {bad}"


def test_families_share_neutral_modules_not_each_others_classes():
    """proposers/<family>/ imports no other family's folder: what two families share lives in
    proposers/toolkit/ (or the interface), so a change to one family never ripples into another."""
    families = {p.name for p in (ROOT / "proposers").iterdir() if (p / "layout.py").exists()}
    assert families >= {"dflash", "dflash2", "dspark", "eagle3", "mtp"}
    for path, names in imported_modules("proposers").items():
        mine = pathlib.Path(path).parts[1]
        others = sorted(n for n in names if n.split(".")[1:2] and n.split(".")[1] in families - {mine})
        assert not others, f"{path} imports {others}"


def test_the_layouts_load_without_torch():
    code = "import proposers.layouts as l, proposers.registry as r; [r.layout_module(n) for n in r.FAMILY_NAMES]"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert "pydantic" in loaded, "importtime output not understood"
    assert not loaded & {"torch", "transformers", "pyarrow"}, loaded & {"torch", "transformers", "pyarrow"}


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


PRODUCT = ("pipeline", "proposers", "scoring", "specreplay")


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


MAX_MODULE_LINES, MAX_FOLDER_MODULES, MAX_FUNCTION_LINES = 500, 16, 60
REASON = re.compile(r"#\s*\d+ lines:")  # a def line saying why the function is longer


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function over MAX_FUNCTION_LINES whose def line gives no reason."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not REASON.search(lines[node.lineno - 1]):
                found.append((node.name, length))
    return found


def test_the_layout_limits():
    problems = []
    for name, path in product_modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name}: {len(source.splitlines())} lines")
        problems += [f"{name}.{f}: {n} lines" for f, n in long_functions(source)]
    folders = {path.parent for path in product_modules().values()}
    for folder in sorted(folders):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_FOLDER_MODULES:
            problems.append(f"{folder.relative_to(ROOT)}/: {len(modules)} modules")
    assert not problems, problems


def test_the_limit_checker_finds_a_long_function_and_takes_a_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def f():  # 61 lines: a table\n{body}\n") == []
    assert long_functions("def g():\n    return 1\n") == []


def test_every_product_folder_is_a_package():
    """A folder without __init__.py is a namespace package: it imports from the checkout, but
    setuptools' find (pyproject.toml) leaves it out of an install, where the console script fails."""
    folders = {path.parent for path in product_modules().values()}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, missing
