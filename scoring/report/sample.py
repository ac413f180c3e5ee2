"""The report's per-sample view: a response token by token, coloured by how the chain walk
produced each token.

A walk step at `anchor` appends positions anchor+1 .. anchor+produced of the sample's tokens: the
first min(accepted_len, produced - 1) are accepted draft tokens, the last is the target's bonus
token (scoring/results.py WALK). When the step was not cut short, the drafter's guess at the bonus
token's position is walk.draft_tokens[accepted_len]: the guess the target rejected, shown struck
through beside the bonus token. The first response token (position prompt_len) comes from the
target's prefill, before any step.

Token ids come from the shards (run.json's uri, or --shards), token texts from the tokenizer that
extract saved beside them (or --tokenizer); each id is decoded on its own. Anything missing
degrades to a note (ids instead of text, no view instead of a traceback).
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass, field

import polars as pl

from scoring.methods.chain import CHAIN
from scoring.prompts import user_message
from scoring.report.data import ReportError, Results, fmt, reference_label
from scoring.results import FILES

PREFILL, ACCEPTED, BONUS, UNWALKED = "pre", "acc", "bon", "unwalked"
QUESTION_PREVIEW_CHARS = 300
# Whitespace and control characters made visible; a newline keeps its line break after the glyph.
_VISIBLE = {"\n": "↵\n", "\t": "⇥\t", "\r": "␍"}


@dataclass
class SampleViews:
    """Which samples get a token view, and where their tokens and texts come from."""

    count: int = 3  # worst and best samples by chain tau
    ids: list[str] = field(default_factory=list)  # sample ids picked with --sample
    shards: str | None = None  # overrides run.json's shards uri
    tokenizer: str | None = None  # used instead of the tokenizer saved with the shards


@dataclass
class Token:
    position: int
    token_id: int
    kind: str  # PREFILL, ACCEPTED, BONUS or UNWALKED
    step: int | None = None
    rejected: int | None = None  # bonus tokens: the drafter's guess the target rejected here
    cut: bool = False  # bonus tokens: the step was cut by the end of the response or a stop token


# ---------------------------------------------------------------- choosing samples


def _key(row: dict) -> tuple[str, str]:
    return str(row["dataset"]), str(row["sample_id"])


def anchor_id(dataset: str, sample_id: str) -> str:
    """The page anchor of a sample's view (report.html#sample-gsm8k-q3)."""
    return "sample-" + re.sub(r"[^A-Za-z0-9_-]+", "-", f"{dataset}-{sample_id}")


def _picked(rows: pl.DataFrame, wanted: str, directory: str) -> list[dict]:
    """The rows a --sample value names: its sample id, or dataset/sample id."""
    hit = rows.filter(pl.col("sample_id") == wanted)
    if not hit.height and "/" in wanted:
        dataset, sample_id = wanted.split("/", 1)
        hit = rows.filter((pl.col("dataset") == dataset) & (pl.col("sample_id") == sample_id))
    if not hit.height:
        valid = rows["sample_id"].unique(maintain_order=True).to_list()
        raise ReportError(
            f"--sample {wanted!r}: no such sample in {directory} ({len(valid)} samples); "
            f"valid ids include {', '.join(map(str, valid[:8]))}"
        )
    return hit.to_dicts()


def choose_samples(results: Results, views: SampleViews) -> list[tuple[dict, str]]:
    """(samples row, tag) for every view, in page order: the worst `count` by chain tau of the
    reference checkpoint, then the best (not already shown), then the --sample ones. An unknown
    --sample id is a ReportError listing some valid ones."""
    reference = reference_label(results)
    if reference is None:
        if views.ids:
            raise ReportError(f"--sample {views.ids[0]!r}: these results have no samples.parquet to find it in")
        return []
    rows = results.samples.filter(pl.col("label") == reference)
    scored = rows.filter(pl.col("tau").is_not_null()).sort("tau", maintain_order=True)
    worst = scored.head(views.count).to_dicts() if views.count else []
    shown = {_key(r) for r in worst}
    best = [r for r in scored.reverse().head(views.count).to_dicts() if _key(r) not in shown] if views.count else []
    chosen = [(r, f"worst #{i}") for i, r in enumerate(worst, 1)] + [(r, f"best #{i}") for i, r in enumerate(best, 1)]
    shown |= {_key(r) for r in best}
    for wanted in views.ids:
        for row in _picked(rows, wanted, results.dir_of[reference]):
            if _key(row) not in shown:
                chosen.append((row, "picked"))
                shown.add(_key(row))
    return chosen


# ---------------------------------------------------------------- token ids and texts


def _check_tokens(row: dict, ids: list[int]) -> str | None:
    """Why these token ids are not the ones this sample was scored on, or None when they are."""
    import torch

    from scoring.score.collect import tokens_hash

    expected = row.get("tokens_hash")
    if expected and tokens_hash(torch.tensor(ids, dtype=torch.int64)) != expected:
        return f"tokens hash {tokens_hash(torch.tensor(ids))}, scored on {expected}"
    if row.get("prompt_len") is not None and row.get("response_len") is not None:
        if len(ids) != row["prompt_len"] + row["response_len"]:
            return f"{len(ids)} tokens, scored on {row['prompt_len'] + row['response_len']}"
    return None


def load_token_ids(uri: str, rows: list[dict]) -> tuple[dict[tuple[str, str], list[int]], str | None]:
    """(key -> prompt + response token ids, note when the shards cannot be read). The samples'
    shard indices are tried first (only their chunks are read), then a scan of every sample."""
    from pipeline.shards import ShardSet

    try:
        shardset = ShardSet(uri)
        wanted = {_key(r) for r in rows}
        indices = {int(r["sample_index"]) for r in rows if r.get("sample_index") is not None}
        found = _collect_ids(shardset, wanted, lambda i: i in indices)
        if wanted - set(found):
            found.update(_collect_ids(shardset, wanted - set(found), None))
    except Exception as error:  # noqa: BLE001 - moved, corrupt or foreign shards: the page says why
        return {}, f"The shards these results were scored on cannot be read at {uri} ({error})."
    return found, None


def _collect_ids(shardset, wanted: set, keep) -> dict[tuple[str, str], list[int]]:
    found = {}
    for sample in shardset.samples(tensors=[], keep=keep, prefetch=0):
        key = (str(sample.dataset), str(sample.sample_id))
        if key in wanted:
            found[key] = sample.input_ids.tolist()
    return found


def load_tokenizer(uri: str | None, explicit: str | None) -> tuple[object | None, str | None]:
    """(tokenizer, note): --tokenizer when given (failing to load it is an error), else the one
    extract saved under <shards>/tokenizer/, else None with a note saying how to get text."""
    from pipeline.shards import TOKENIZER_DIR

    if explicit:
        try:
            return _auto_tokenizer(explicit), None
        except Exception as error:  # noqa: BLE001 - transformers raises many types for a bad directory
            raise ReportError(f"--tokenizer {explicit}: cannot load a tokenizer there ({error})") from error
    saved = os.path.join(uri, TOKENIZER_DIR) if uri and "://" not in uri else None
    if saved and os.path.isdir(saved):
        try:
            return _auto_tokenizer(saved), None
        except Exception as error:  # noqa: BLE001 - a damaged tokenizer directory: show ids instead
            return None, f"The tokenizer saved at {saved} does not load ({error}); tokens are shown as ids."
    return None, (
        "These shards carry no tokenizer (extracted before specreplay saved one under <shards>/tokenizer/), so "
        "tokens are shown as ids. Pass --tokenizer PATH (the target model's directory) to see their text."
    )


def _auto_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def visible_text(text: str, breaks: bool = True) -> str:
    """A token's text with newlines, tabs and other control characters shown as glyphs (a newline
    keeps its line break after the ↵ unless `breaks` is off: a rejected guess never was text, so it
    must not break the line); spaces stay spaces, made visible by the token's background."""
    if text == "":
        return "∅"
    glyphs = _VISIBLE if breaks else {ch: glyph.strip() for ch, glyph in _VISIBLE.items()}
    return "".join(glyphs.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch) for ch in text)


def decoder(tokenizer):
    """token id -> its text on its own (cached), or ⟨id⟩ without a tokenizer."""
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in cache:
            try:
                cache[token_id] = f"⟨{token_id}⟩" if tokenizer is None else tokenizer.decode([token_id])
            except Exception:  # noqa: BLE001 - an id outside this tokenizer (a mismatched --tokenizer)
                cache[token_id] = f"⟨{token_id}⟩"
        return cache[token_id]

    return decode


# ---------------------------------------------------------------- classifying tokens


def classify(ids: list[int], prompt_len: int, steps: list[dict]) -> list[Token]:
    """Every response token with how the chain walk produced it (see the module docstring)."""
    tokens = {p: Token(p, ids[p], UNWALKED) for p in range(prompt_len, len(ids))}
    if prompt_len < len(ids):
        tokens[prompt_len].kind = PREFILL
    for row in sorted(steps, key=lambda r: r["step"]):
        anchor, produced, accepted = int(row["anchor"]), int(row["produced"]), int(row["accepted_len"])
        draft = row.get("draft_tokens")
        for j in range(1, produced + 1):
            position = anchor + j
            if position not in tokens:
                continue
            token = tokens[position]
            token.step = int(row["step"])
            token.kind = ACCEPTED if j <= min(accepted, produced - 1) else BONUS
            if token.kind == BONUS:
                token.cut = accepted >= produced  # the step ended before the draft was rejected
                if not token.cut and draft is not None and accepted < len(draft):
                    token.rejected = int(draft[accepted])
    return [tokens[p] for p in sorted(tokens)]


# ---------------------------------------------------------------- HTML


def _token_html(token: Token, decode) -> str:
    text = decode(token.token_id)
    where = f"step {token.step + 1}" if token.step is not None else ""
    if token.kind == ACCEPTED:
        title = f"accepted draft token · {where} · id {token.token_id}"
    elif token.kind == BONUS:
        title = f"target's bonus token · {where} · id {token.token_id}"
        if token.rejected is not None:
            title += f" · the drafter guessed {decode(token.rejected)!r} (id {token.rejected})"
        elif token.cut:
            title += " · step cut by the end of the response or a stop token"
        else:
            title += " · every draft token of the block was accepted"
    elif token.kind == PREFILL:
        title = f"first response token, from the target's prefill · id {token.token_id}"
    else:
        title = f"not visited by the walk · id {token.token_id}"
    out = f'<span class="tok {token.kind}" title="{html.escape(title)}">{html.escape(visible_text(text))}</span>'
    if token.rejected is not None:
        guess = decode(token.rejected)
        out += (
            f'<s class="rej" data-tok="{token.rejected}" title="{html.escape(f"rejected draft guess {guess!r}")}">'
            f"{html.escape(visible_text(guess, breaks=False))}</s>"
        )
    return out


LEGEND = (
    '<p class="legend"><span class="tok acc">accepted draft token</span> '
    '<span class="tok bon">target\'s bonus token</span> '
    '<s class="rej">guess</s> the drafter\'s rejected guess at that position '
    '<span class="tok pre">first token (target prefill)</span> '
    "· ↵ newline, ⇥ tab, ⟨id⟩ a token without text · hover a token for its step and id</p>"
)


def _sample_html(row: dict, tag: str, tokens: list[Token], decode) -> str:
    counts = {kind: sum(t.kind == kind for t in tokens) for kind in (ACCEPTED, BONUS)}
    rejected = sum(t.rejected is not None for t in tokens)
    dataset, sample_id = _key(row)
    question = user_message(row.get("prompt_text"))
    if len(question) > QUESTION_PREVIEW_CHARS:
        question = question[:QUESTION_PREVIEW_CHARS].rstrip() + "…"
    body = "".join(_token_html(t, decode) for t in tokens)
    return (
        f'<section class="sample" id="{anchor_id(dataset, sample_id)}" data-sample="{html.escape(f"{dataset}/{sample_id}")}">'
        f"<h3>{html.escape(dataset)} / {html.escape(sample_id)} <span class=tag>{html.escape(tag)}</span></h3>"
        f'<p class="meta">τ {fmt(row.get("tau"), 2)} (chain) · {fmt(row.get("steps"))} steps · '
        f"{fmt(row.get('response_len'))} response tokens · finish {html.escape(str(row.get('finish_reason') or '–'))} · "
        f"{counts[ACCEPTED]} accepted draft tokens, {counts[BONUS]} bonus tokens, {rejected} rejected guesses shown</p>"
        f'<div class="question">{html.escape(question) or "<span class=muted>(no prompt text)</span>"}</div>'
        f'<div class="tokens">{body}</div></section>'
    )


def _sample_note(row: dict, tag: str, note: str) -> str:
    dataset, sample_id = _key(row)
    return (
        f'<section class="sample" id="{anchor_id(dataset, sample_id)}">'
        f"<h3>{html.escape(dataset)} / {html.escape(sample_id)} <span class=tag>{html.escape(tag)}</span></h3>"
        f'<p class="note">{html.escape(note)}</p></section>'
    )


def _walk_steps(directory: str, rows: list[dict]) -> tuple[pl.DataFrame | None, bool]:
    """(chain walk rows of these samples, whether they carry draft_tokens)."""
    path = os.path.join(directory, FILES["walk"])
    if not os.path.exists(path):
        return None, False
    frame = pl.scan_parquet(path)
    names = frame.collect_schema().names()
    wanted = ["dataset", "sample_id", "step", "anchor", "produced", "accepted_len", "draft_tokens"]
    ids = list({str(r["sample_id"]) for r in rows})
    walk = frame.filter((pl.col("method") == CHAIN) & pl.col("sample_id").is_in(ids))
    return walk.select([c for c in wanted if c in names]).collect(), "draft_tokens" in names


def sample_section(results: Results, views: SampleViews, chosen: list[tuple[dict, str]]) -> str:
    """The "Token by token" section's body: intro, legend, notes, one view per chosen sample."""
    reference = reference_label(results)
    if not chosen:
        if reference is None:
            reason = "No samples.parquet in these results, so no token view."
        elif not views.count and not views.ids:
            reason = "Not requested (--sample-views 0 and no --sample)."
        else:
            reason = "No sample has a decoding step to show."
        return f'<p class="note">{reason}</p>'
    directory = results.dir_of[reference]
    uri = views.shards or results.runs.get(directory, {}).get("shards", {}).get("uri")
    intro = _intro(reference, chosen)
    walk, has_draft = _walk_steps(directory, [r for r, _ in chosen])
    if walk is None:
        return intro + f'<p class="note">No walk.parquet in {html.escape(directory)}, so no token view.</p>'
    if not uri:
        return intro + '<p class="note">run.json names no shards; pass --shards DIR to see the tokens.</p>'
    ids, shards_note = load_token_ids(uri, [r for r, _ in chosen])
    if shards_note:
        return intro + f'<p class="note">{html.escape(shards_note)} Pass --shards DIR to see the tokens.</p>'
    tokenizer, tokenizer_note = load_tokenizer(uri, views.tokenizer)
    notes = [tokenizer_note] if tokenizer_note else []
    if not has_draft:
        notes.append(
            "This walk.parquet predates draft_tokens, so rejected guesses are not shown; re-score to see them."
        )
    parts = [intro, LEGEND] + [f'<p class="note">{html.escape(n)}</p>' for n in notes] + [_index(chosen)]
    decode = decoder(tokenizer)
    for row, tag in chosen:
        parts.append(_one_view(row, tag, ids.get(_key(row)), walk, decode, uri))
    return "".join(parts)


def _one_view(row: dict, tag: str, ids: list[int] | None, walk: pl.DataFrame, decode, uri: str) -> str:
    if ids is None:
        return _sample_note(
            row, tag, f"This sample is not in the shards at {uri}; pass --shards DIR with the ones it was scored on."
        )
    mismatch = _check_tokens(row, ids)
    if mismatch:
        return _sample_note(
            row,
            tag,
            f"The shards at {uri} hold other tokens for this sample ({mismatch}); pass --shards DIR with the ones it was scored on.",
        )
    dataset, sample_id = _key(row)
    steps = walk.filter((pl.col("dataset") == dataset) & (pl.col("sample_id") == sample_id)).to_dicts()
    return _sample_html(row, tag, classify(ids, int(row["prompt_len"]), steps), decode)


def _intro(reference: str, chosen: list[tuple[dict, str]]) -> str:
    worst = sum(tag.startswith("worst") for _, tag in chosen)
    best = sum(tag.startswith("best") for _, tag in chosen)
    picked = len(chosen) - worst - best
    what = []
    if worst or best:
        what.append(f"the {worst} worst and {best} best samples by chain τ")
    if picked:
        what.append(f"{picked} sample(s) picked with --sample")
    return (
        f'<p class="caption">The responses of {" and ".join(what)} under <b>{html.escape(reference)}</b>, token '
        f"by token as the simulated chain walk produced them. Each step appends the draft tokens the target "
        f"accepted and then one token of the target's own (the bonus); where the target rejected a draft token, "
        f"the drafter's guess is shown struck through after the bonus token that replaced it.</p>"
    )


def _index(chosen: list[tuple[dict, str]]) -> str:
    links = " · ".join(
        f'<a href="#{anchor_id(*_key(row))}">{html.escape(_key(row)[1])}</a> ({html.escape(tag)}, τ {fmt(row.get("tau"), 2)})'
        for row, tag in chosen
    )
    return f'<p class="sample-index">{links}</p>'
