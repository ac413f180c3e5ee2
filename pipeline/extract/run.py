"""`specreplay extract`: run the target once over a prompt set and write shards + manifest.

A run is four steps (`run_extract`); every check happens before the first byte is written
(the plan is plan.py's, the output directory and its manifest pipeline/outdir/'s):
  1. plan (`plan_extract`, pure): render and check the prompts, resolve and check layer ids,
     top-k and dtypes, size the lm_head window and the shard chunk, build the settings identity.
     Then every rank checks OUT (`finished_before`, read-only): a manifest with other settings is
     refused (the message lists each differing setting) unless `overwrite`;
  2. rank 0 prepares OUT (`prepare_out`): delete the old outputs on `overwrite`, remove
     temporary files of an interrupted run, store the target head and the tokenizer
     (OUT/tokenizer/, save_pretrained) once, write manifest.json with complete=false;
  3. every rank writes its share (`write_rank_share`): skip samples already in finished shards
     (by id), take pending[rank::world] (whole conversations of "turns" records), generate
     (batched, greedy or sampled; a conversation's turns in rounds, `run_rounds`, turns.py) +
     capture (one forward per sample), write its own shards;
  4. rank 0 finishes the manifest (`finish_manifest`): every finished shard entry (sorted by file
     name), complete=true, totals.

With --responses-from (pipeline/extract/engines/) a serving engine makes the responses: step 1
also checks every server (reachable, the model, the tokenizer) and names the engine in the
settings identity; in step 3 each rank first fetches its share's responses (kept in
OUT/responses/, never asked for twice), then runs the capture forwards.

Resume is exact because a sample is either in a finished shard (never touched again) or redone
from scratch: shards land atomically (pipeline/shards/writer.py) and settings cannot change
between runs without `--overwrite`.

A sample whose features or logits hold NaN/Inf (fp16 overflow, usually) is never written: the
entry of the next shard to land lists it under `excluded` (sample id, dataset, what, first bad
position, how many), so resume counts it as done, and the manifest's totals carry
`excluded_samples` and `excluded` (keys absent when nothing was excluded). `inspect` and
`score` report them.

Sampling (temperature > 0): each prompt without a given response becomes `num_samples` items
with ids `<id>#<k>`, k = 0..K-1 (every sampled id carries its draw, also when K = 1); a record
with a given response stays one item under its own id. A draw's generator is seeded from (seed,
prompt id, k) only (pipeline/extract/generate.py), so which batch, rank or run redoes it changes nothing.
The shards then also hold sample_logprob (pipeline/extract/capture.py); greedy shards and manifests are
exactly what they were before sampling existed.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from pipeline import shards
from pipeline.common import timing
from pipeline.common.distributed import Dist, barrier, dist_from_env, init_dist, leave_dist, resolve_device
from pipeline.common.dtypes import STORAGE_DTYPES
from pipeline.common.errors import stop_behind
from pipeline.common.layer_ids import final_prenorm_id
from pipeline.common.sampling import Sampling
from pipeline.common.settings import settings_diff
from pipeline.engines.client import Unreachable
from pipeline.extract.config import ExtractConfig
from pipeline.extract.plan import Item, Plan, known_settings, plan_extract, validate_numbers, weights_fingerprint
from pipeline.extract.progress import SilentProgress, TokenProgress
from pipeline.outdir.builder import finish_manifest, new_manifest, run_facts
from pipeline.outdir.directory import (
    check_known_settings,
    existing_outputs,
    finished_before,
    kept_on_stop,
    missing_shards,
    output_lock,
    prepare_out,
    resume_writer,
)

# ---------------------------------------------------------------------------------------------
# step 3: every rank writes its share


def write_rank_share(
    model, info, plan: Plan, config: ExtractConfig, dist: Dist, progress=None, engine=None, tokenizer=None
) -> None:
    """This rank's samples (pending ones: whole conversations, every world-th from its rank) into
    its own shards, a conversation's turns in rounds (`run_rounds`; `tokenizer` renders the later
    turns); with an `engine` (--responses-from) their responses are fetched first, then captured."""
    from pipeline.extract.capture import CaptureConfig
    from pipeline.extract.turns import rank_share

    ids = {item.sample_id for item in plan.items}
    writer, done = resume_writer(config.out, dist.rank, plan.storage, ids, config.shard_bytes, config.zstd_level)
    pending = [item for item in plan.items if item.sample_id not in done]
    mine = rank_share(pending, dist.rank, dist.world)
    capture_config = CaptureConfig(
        layer_ids=plan.storage.layer_ids,
        feature_dtype=None if plan.storage.feature_dtype is None else STORAGE_DTYPES[plan.storage.feature_dtype],
        top_k=config.top_k,
        head_budget_bytes=plan.storage.head_window_bytes,
        sampling=plan.sampling,
    )
    budget = token_budget(mine, config.max_new_tokens)
    bar = progress(budget, "extract", unit="tok") if progress is not None else SilentProgress()
    try:
        fetched = None if engine is None else engine_responses(engine, mine, plan, config, info, dist.rank, bar)
        run_rounds(model, info, mine, writer, capture_config, plan, config, bar, fetched, tokenizer, done)
        writer.close()
    except (KeyboardInterrupt, Exception) as error:  # Ctrl-C, SIGTERM raised as one, or their echo
        stop = error if isinstance(error, KeyboardInterrupt) else stop_behind(error)
        if stop is None:
            raise
        also = f" (and the engine's responses so far in {config.out}/responses/)" if engine is not None else ""
        raise kept_on_stop(writer, len(done), len(plan.items), config.out + also, stop) from None
    finally:
        bar.close()


def run_rounds(
    model, info, items, writer, capture_config, plan: Plan, config: ExtractConfig, bar, fetched, tokenizer, done
):
    """Round r generates turn r of every conversation that has one (pipeline/extract/turns.py),
    each batched as a prompt set is; a prompt set without "turns" records is one round. The
    earlier answers come from the rounds before, or from the shards of an earlier run."""
    from pipeline.extract.turns import excluded_turn, rounds, stored_answers, with_prompt

    counter = TokenProgress(bar, len(items))
    answers = stored_answers(config.out, plan.storage.tensors, items, done)
    for round_items in rounds(items):
        ready = []
        for item in round_items:
            built = with_prompt(item, answers, tokenizer, config.enable_thinking)
            if built is None:  # an earlier turn was excluded: this prompt would hold an answer no shard stores
                writer.exclude(excluded_turn(item))
                counter.written(item)
            else:
                ready.append(built)
        answers.update(
            run_items(
                model,
                info,
                ready,
                writer,
                capture_config,
                config.max_new_tokens,
                config.batch_size,
                bar,
                sampling=plan.sampling,
                seed=config.seed,
                fetched=fetched,
                counter=counter,
            )
        )


def engine_responses(engine, items: list[Item], plan: Plan, config: ExtractConfig, info, rank: int, bar) -> dict:
    """{sample_id: Response} from the engine for this rank's items without a given response,
    kept in OUT/responses/ as they arrive (pipeline/extract/engines/fetch.py); the bar moves by
    one response's token budget per response."""
    from pipeline.extract.engines.cache import ResponseStore
    from pipeline.extract.engines.fetch import fetch_responses, requests_for

    requests = requests_for(items, engine, config.max_new_tokens, info.stop_token_ids, plan.sampling, config.seed)
    store = ResponseStore(config.out, rank)
    with timing.stage("engine responses", requests=len(requests)):
        return fetch_responses(
            engine,
            requests,
            store,
            info.vocab_size,
            config.concurrency,
            on_response=lambda request: bar.update(config.max_new_tokens),
        )


def connect_engine(config: ExtractConfig, tokenizer, info, plan: Plan):
    """The checked servers of --responses-from (pipeline/extract/engines/probe.py), or None."""
    if not config.responses_from:
        return None
    from pipeline.engines.client import Retry
    from pipeline.extract.engines.probe import connect

    retry = Retry(timeout=config.request_timeout, retries=config.retries)
    texts = [item.prompt_text for item in plan.items]
    return connect(config.responses_from, config.engine, config.served_model, tokenizer, info.vocab_size, texts, retry)


def with_engine(plan: Plan, engine) -> Plan:
    """The plan whose settings identity also names what made the responses (settings["responses"])."""
    if engine is None:
        return plan
    return replace(plan, source=replace(plan.source, responses=engine.facts(plan.sampling)))


def finished_with_engine(out: str, settings: dict, overwrite: bool) -> dict | None:
    """OUT's complete manifest when it already holds this extract with engine responses, whichever
    servers made them: a finished run has nothing left to ask, so it needs no server up."""
    try:
        manifest, _ = existing_outputs(out)
    except shards.ShardError:
        return None
    recorded = (manifest or {}).get("settings", {})
    if overwrite or not (manifest and manifest.get("complete") and "responses" in recorded):
        return None
    if settings_diff(recorded, {**settings, "responses": recorded["responses"]}) or missing_shards(out, manifest):
        return None
    return manifest


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def token_budget(items: list[Item], max_new_tokens: int) -> int:
    """The progress bar's total in tokens: every generated sample's full budget (an upper bound;
    TokenProgress tops it up when a response stops early) plus every given response's length."""
    return sum(max_new_tokens if item.given is None else len(item.given) for item in items)


def run_items(
    model,
    info,
    items: list[Item],
    writer: shards.ShardWriter,
    capture_config,
    max_new_tokens: int,
    batch_size: int,
    progress,
    sampling: Sampling | None = None,
    seed: int = 0,
    fetched: dict | None = None,
    counter: TokenProgress | None = None,
) -> dict[str, list[int] | None]:
    """Generate in batches, then one capture forward per sample, written in item order; `progress`
    (a tqdm-like bar of token_budget(items) tokens) advances every decode step. Responses are
    drawn from `sampling` when it is set (None: greedy), each draw seeded from `seed` (draw_seed);
    with `fetched` ({sample_id: Response} from a serving engine) nothing is generated here.
    Returns the answers a later turn reads: {sample id: response tokens, None when excluded} of
    the conversation turns among `items` (turns.py)."""
    from pipeline.extract.generate import given_response

    counter = counter or TokenProgress(progress, len(items))
    answers: dict[str, list[int] | None] = {}
    for batch in batches(items, batch_size):
        if fetched is not None:
            responses = [fetched[i.sample_id] if i.given is None else given_response(i.given) for i in batch]
        else:
            responses = batch_responses(model, info, batch, max_new_tokens, counter, sampling, seed)
        for item, response in zip(batch, responses):
            written = capture_and_write(model, item, response, capture_config, writer)
            if item.turn is not None:
                answers[item.sample_id] = response.token_ids if written else None
            counter.written(item)
    return answers


def batch_responses(model, info, batch: list[Item], max_new_tokens: int, counter, sampling, seed: int) -> list:
    """One batch's responses: given ones as they are, the others generated (greedy or drawn)."""
    from pipeline.extract.generate import draw_seed, generate_responses

    return generate_responses(
        model,
        [i.prompt_ids for i in batch],
        [i.given for i in batch],
        max_new_tokens,
        info.stop_token_ids,
        info.pad_token_id,
        on_tokens=counter.tokens,
        sampling=sampling,
        seeds=[None if i.draw is None else draw_seed(seed, i.prompt_id, i.draw) for i in batch],
    )


def capture_and_write(model, item: Item, response, capture_config, writer: shards.ShardWriter) -> bool:
    """One capture forward over prompt + response, written as one sample; a sample with NaN/Inf
    in a feature layer or its logits is never written, only recorded as excluded (where first).
    Whether it was written."""
    from pipeline.extract.capture import capture_sample, nonfinite_values

    input_ids = item.prompt_ids + response.token_ids
    tensors = capture_sample(model, input_ids, len(item.prompt_ids), capture_config)
    bad = nonfinite_values(tensors, getattr(capture_config, "layer_ids", None), len(item.prompt_ids))
    if bad is not None:
        writer.exclude({"sample_id": item.sample_id, "dataset": item.dataset, **bad})
        return False
    writer.write(
        shards.Sample(
            sample_id=item.sample_id,
            dataset=item.dataset,
            prompt_text=item.prompt_text,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            prompt_len=len(item.prompt_ids),
            finish_reason=response.finish_reason,
            greedy=response.greedy,
            tensors=tensors,
        )
    )
    # The writer owns the tensors now; returning drops our reference, so the next forward
    # does not keep them alive.
    return True


# ---------------------------------------------------------------------------------------------
# the run


def run_extract(config: ExtractConfig, progress=None, loaded=None) -> dict:
    """Run (or resume) an extract; returns the final manifest. See the module docstring.

    `progress`: called once per rank as progress(total, desc, unit="tok") with the tokens this
    rank will generate or teacher-force (token_budget); returns a bar (specreplay/progress.py:
    update(n, **postfix), close), advanced every decode step. None: nothing is shown.
    `loaded`: the (model, tokenizer, info) that pipeline.extract.target.load_target returned, to reuse
    instead of loading config.model again.
    """
    from pipeline.extract.prompts import load_prompts
    from pipeline.extract.turns import refuse_engine_turns

    dist = dist_from_env()
    validate_numbers(config)
    records = load_prompts(config.prompts, limit=config.limit)  # parse errors surface before any load
    refuse_engine_turns(config.responses_from, records)
    check_known_settings(config.out, known_settings(config, records), config.overwrite, whole=("sampling",))
    init_dist(dist)
    lock = output_lock(config.out, "extract") if dist.main else None  # ranks of one job share rank 0's lock
    try:
        with lock or contextlib.nullcontext():
            return _run(config, dist, records, progress, loaded)
    finally:
        leave_dist(dist)


def load_model_once(config: ExtractConfig, dist: Dist, device: str):
    """Rank 0 loads first: the first load of a GGUF target converts it into a shared cache dir."""
    from pipeline.extract.target import load_target

    if not dist.main:
        barrier(dist)
    with timing.stage("load target"):
        loaded = load_target(config.model, dtype=config.dtype, device=device)
    if dist.main:
        barrier(dist)
    return loaded


def target_head(model, plan: Plan):
    """What prepare_out stores as the target head: the loaded model's embedding and lm_head, and its
    final norm's weight when the features include id L, the final hidden state before that norm
    (MTP heads read it, after the norm)."""
    from pipeline.extract.target import final_norm_weight, input_embedding_weight, output_head_weight

    prenorm = final_prenorm_id(plan.source.target.num_layers) in plan.storage.layer_ids
    return lambda: (
        input_embedding_weight(model),
        output_head_weight(model),
        final_norm_weight(model) if prenorm else None,
    )


def with_streams(plan: Plan, text, info, config: ExtractConfig) -> Plan:
    """`plan`, its storage sized for id L stored as a hyper-connection target's streams (hc_mult times a
    layer's width; capture.stream_layer_ids, which refuses that id beside others)."""
    from pipeline.extract.capture import stream_layer_ids
    from pipeline.outdir.storage import plan_storage

    storage = plan.storage
    if not stream_layer_ids(text, info.num_layers, storage.layer_ids):
        return plan
    wide = plan_storage(
        storage.layer_ids, storage.feature_dtype, storage.top_k, info.hidden_size * text.hc_mult,
        config.memory_bytes, sampled=plan.sampling is not None,
    )  # fmt: skip
    return replace(plan, storage=wide)


def _run(config: ExtractConfig, dist: Dist, records, progress, loaded) -> dict:
    from pipeline.extract.target import text_config

    device = resolve_device(config.device, dist)
    model, tokenizer, info = loaded if loaded is not None else load_model_once(config, dist, device)
    with timing.stage("weights fingerprint"):
        fingerprint = weights_fingerprint(model)
    # Planning and check_out_dir only read: a bad input leaves OUT untouched.
    max_positions = getattr(text_config(model), "max_position_embeddings", None)
    plan = plan_extract(config, records, tokenizer, info, fingerprint, max_positions)
    plan = with_streams(plan, text_config(model), info, config)  # a refusal touches no OUT either
    try:
        engine = connect_engine(config, tokenizer, info, plan)  # its checks too write nothing
    except Unreachable:
        finished = finished_with_engine(config.out, plan.settings, config.overwrite)
        if finished is None:
            raise
        return finished  # done before: the servers may be down
    plan = with_engine(plan, engine)
    finished = finished_before(config.out, plan.settings, config.overwrite)  # every rank, so all refuse together
    if finished is not None:
        return finished  # already done with these settings: touch nothing

    run = run_facts(dist.world, device, config.shard_bytes, config.zstd_level, config.memory_bytes, config.batch_size)
    manifest = new_manifest(plan.source, plan.storage, run)
    if dist.main:
        prepare_out(config.out, manifest, plan.storage, config.overwrite, target_head(model, plan), tokenizer)
    barrier(dist)
    write_rank_share(model, info, plan, config, dist, progress, engine, tokenizer)
    barrier(dist)
    if dist.main:
        finish_manifest(config.out, manifest, plan.storage, [item.sample_id for item in plan.items])
    barrier(dist)
    return manifest if dist.main else shards.read_manifest(config.out)
