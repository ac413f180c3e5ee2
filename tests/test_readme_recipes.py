"""The README's polars recipes run against real results laid out as the README says.

Two checkpoints are fitted and scored exactly as the quick start does it (runs/tiny/step_150 and
step_300, `score --out data/results`), then every top-level expression of every python block
under "Polars recipes" is evaluated in that directory and must give a non-empty table whose
numbers come from the results (an empty table, a ComputeError or a recipe naming a column the
results lack fails here first)."""

from __future__ import annotations

import ast
import os
import re

import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.extract.run import ExtractConfig, run_extract
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.prompts import write_prompts

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def recipe_blocks() -> list[str]:
    text = open(README).read()
    section = text[text.index("### Polars recipes") :]
    section = section[: section.index("\n## ")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def results_cwd(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("readme")
    prompts = write_prompts(
        tmp / "prompts.jsonl",
        [{"id": f"p{i}", "prompt": f"Add {i} and {2 * i}.", "dataset": ["gsm8k", "mt-bench"][i % 2]} for i in range(4)],
    )
    shards = str(tmp / "data" / "shards" / "tiny")
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir, prompts=prompts, out=shards, max_new_tokens=16, layer_ids=[1, 3], dtype="fp32"
        )
    )
    fitted_drafters(
        shards, tmp / "runs" / "tiny", block_size=4, layer_ids=[1, 3], steps=300, save_every=150, anchors_per_step=8
    )
    old = os.getcwd()
    os.chdir(tmp)
    try:
        result = CliRunner().invoke(
            main, ["score", "--ckpt", "runs/tiny/step_*", "--shards", shards, "--out", "data/results", "--quiet"]
        )
        assert result.exit_code == 0, result.output
        yield tmp
    finally:
        os.chdir(old)


def test_readme_has_the_recipes():
    blocks = recipe_blocks()
    assert len(blocks) == 1 and blocks[0].count("pl.scan_parquet") == 2


def test_every_recipe_gives_a_nonempty_table(results_cwd):
    assert sorted(os.listdir("data/results")) == ["tiny_step_150", "tiny_step_300"]
    namespace: dict = {}
    evaluated = 0
    for block in recipe_blocks():
        for node in ast.parse(block).body:
            code = ast.unparse(node)
            if isinstance(node, ast.Expr):
                value = eval(code, namespace)
                assert isinstance(value, pl.DataFrame) and value.height > 0, code
                assert value.null_count().sum_horizontal()[0] < value.height * value.width, code
                evaluated += 1
            else:
                exec(code, namespace)
    assert evaluated == 3
    # recipe 1 pivots to one column per method: both checkpoints' steps, the chain's tau as scored
    summary = pl.read_parquet("data/results/*/summary.parquet")
    namespace_tau = eval(ast.unparse(ast.parse(recipe_blocks()[0]).body[2]), namespace)
    assert sorted(namespace_tau["checkpoint_step"].unique().to_list()) == [150, 300]
    row = namespace_tau.filter((pl.col("checkpoint_step") == 300) & (pl.col("dataset") == "(all)"))
    expected = summary.filter(
        (pl.col("checkpoint_step") == 300) & (pl.col("dataset") == "(all)") & (pl.col("method") == "chain")
    )["tau"][0]
    assert row["chain"][0] == expected
    # recipe 3 shows each prompt as the user wrote it, not the chat-template render around it
    differ = eval(ast.unparse(ast.parse(recipe_blocks()[0]).body[-1]), namespace)
    written = {f"p{i}": f"Add {i} and {2 * i}." for i in range(4)}
    assert {r["sample_id"]: r["prompt_message"] for r in differ.iter_rows(named=True)} == {
        s: written[s] for s in differ["sample_id"]
    }
