"""compare-online's run: read a results directory and its shards, ask the engine for every scored
sample's response (greedy, the extract's max_new_tokens), and judge each (verdicts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from pipeline.common.errors import UserError
from pipeline.common.sampling import sampling_of
from pipeline.shards import ShardSet
from scoring import results
from scoring.online.requests import Engine, check_engine_reports
from scoring.online.verdicts import OfflineSteps, Verdict, judge


@dataclass
class OnlineConfig:
    results_dir: str
    server: str
    engine: str = "auto"  # llama.cpp, vllm, sglang; auto: what GET /v1/models says
    engine_log: str | None = None  # llama-server's stderr (LLAMA_TRACE=1): per-step counts
    limit: int | None = None
    timeout_s: float = 600.0


def offline_walks(results_dir: str, rule: str) -> dict[str, OfflineSteps]:
    """Each scored sample's chain steps that drafted, from walk.parquet (in step order); none for a
    sample whose first response token ended it."""
    walk = pl.read_parquet(f"{results_dir}/{results.FILES['walk']}").filter(pl.col("method") == "chain")
    if "drafted" not in walk.columns:
        raise UserError(
            f"{results_dir}: walk.parquet has no per-step engine counts (scored before walk rules existed): "
            "re-score it with --force and --walk-rule for the engine"
        )
    scored = pl.read_parquet(f"{results_dir}/{results.FILES['samples']}").filter(pl.col("method") == "chain")
    walks = {sample_id: OfflineSteps([], [], True, rule) for sample_id in scored["sample_id"].to_list()}  # no step
    for (sample_id,), steps in walk.sort("sample_id", "step").group_by("sample_id", maintain_order=True):
        drafting = steps.filter(pl.col("drafted") > 0)
        walks[sample_id] = OfflineSteps(
            list(zip(drafting["counted_accepted"].to_list(), drafting["drafted"].to_list())),
            drafting["anchor"].to_list(),
            bool(drafting["counted_exact"].all()) if drafting.height else True,
            rule,
        )
    return walks


def run_compare_online(config: OnlineConfig, progress=None) -> tuple[dict, list[Verdict]]:
    """(what was compared, one Verdict per sample) in the shards' sample order."""
    record = results.read_run_record(config.results_dir)
    if record is None:
        raise UserError(f"{config.results_dir}: no run.json; pass a results directory `specreplay score` wrote")
    rule = record.get("walk_rule", "dflash")
    walks = offline_walks(config.results_dir, rule)
    shardset = ShardSet(record["shards"]["uri"])
    settings = shardset.settings
    if not sampling_of(settings).greedy:
        raise UserError(f"{shardset.uri}: sampled responses; compare-online replays greedy responses only")
    engine = Engine(config.server, config.engine, config.engine_log, config.timeout_s)
    budget, stops = int(settings["max_new_tokens"]), list(settings["target"]["stop_token_ids"])
    verdicts = []
    for sample in shardset.samples(tensors=[]):
        if sample.sample_id not in walks or (config.limit is not None and len(verdicts) >= config.limit):
            continue
        ids = sample.input_ids.tolist()
        online = engine.ask(sample.sample_id, ids[: sample.prompt_len], budget, stops)
        if not verdicts:
            check_engine_reports(engine, online, config.server)
        stored = ids[sample.prompt_len :]
        verdicts.append(
            judge(sample.sample_id, sample.dataset, stored, walks[sample.sample_id], online, engine.dialect.name)
        )
        if progress is not None:
            progress(len(verdicts), len(walks))
    facts = {
        "engine": engine.dialect.name,
        "model": engine.model,
        "walk_rule": rule,
        # per-step counts came from the log or from the engine's own answer (vLLM's detailed mode)
        "per_step": any(v.per_step for v in verdicts),
    }
    return facts, verdicts


def summary(verdicts: list[Verdict]) -> dict:
    """Counts over the samples, and the pooled totals over those whose responses are the stored ones."""
    same = [v for v in verdicts if v.response == "same" and v.online is not None]
    return {
        "compared": len(verdicts),
        "same_response": len(same),
        "equal": sum(v.verdict == "equal" for v in verdicts),
        "differs": sum(v.verdict == "differs" for v in verdicts),
        "not_comparable": sum(v.verdict == "not comparable" for v in verdicts),
        "offline_accepted": sum(v.offline[0] for v in same),
        "offline_drafted": sum(v.offline[1] for v in same),
        "online_accepted": sum(v.online[0] for v in same),
        "online_drafted": sum(v.online[1] for v in same),
    }
