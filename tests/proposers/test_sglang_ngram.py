"""SGLang's n-gram proposer (proposers/ngram/sglang*.py) against SGLang 0.5.23's own n-gram corpus,
its C++ compiled for CPU by `make setup` (tools/sglang_ngram.py), driven by `sglang_loop`, the decode
loop of SGLang's NGRAMWorker (srt/speculative/ngram_worker.py) one request at a time: per step the
corpus synchronized, matched with the request's last max_trie_depth tokens under its own state id
(_prepare_draft_tokens, 232-305), the tree verified greedily against the target's tokens (the
stream's: eagle.cuh VerifyTreeGreedy over ngram_worker.py:48-73's links), the same window inserted
(_update_ngram_corpus, 396-420) and the state of a request that left the batch erased (528-536);
under the overlap schedule a finished request's extra step (`overlap_step`, managers/scheduler.py).

At every step of token streams built to repeat themselves (random over small vocabularies with
token 0, motifs copied with noise, a conversation whose prompts hold the earlier turns), several
requests in a row on one corpus, BFS and PROB, defaults and small settings (and a trie that evicts),
the proposer's tree equals SGLang's (every node's path from the root, padding included) and the
drafts the replay verifies along the stored tokens accept what SGLang's verification accepts. The
same streams tell plausible wrong rules apart (MUTATIONS). replay_walks under walk rule `sglang`,
and `score --walk-rule sglang` on a tiny target's shards (slow), take SGLang's steps and count its
acceptances; settings SGLang would refuse, another walk rule and sampled shards are one error each."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from pipeline.common.distributed import Dist
from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling
from pipeline.shards import Sample
from proposers.detect import parse_config
from proposers.interface import Chunk, PackedTokens, ServerStateful, TargetHead
from proposers.ngram import sglang as proposer_module, sglang_tree, sglang_trie
from proposers.ngram.config import ngram_proposer
from proposers.ngram.sglang import SglangSettings
from proposers.toolkit.config import DrafterConfigError
from scoring.config import ScoreConfig
from scoring.methods.chain import CHAIN
from scoring.replay.anchors import replay_walks
from scoring.replay.packing import ReplayOptions
from scoring.replay.walk import stop_mask
from scoring.score.steps import set_chain_steps, stateful_config
from specreplay.cli import main
from tests.helpers import chain_parity as parity
from tests.helpers.prompts import write_prompts

# -------------------------------------------------------------------------------------- the streams


def random_stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def motif_stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A few motifs copied one after another, a token in ten replaced: long matches and rivals."""
    motifs = [random_stream(rng, vocab, rng.randrange(3, 9)) for _ in range(3)]
    out = []
    while len(out) < length:
        out += [t if rng.random() > 0.1 else rng.randrange(vocab) for t in rng.choice(motifs)]
    return out[:length]


def novel_run(first: int) -> tuple[list[int], int]:
    """A request of tokens no earlier request holds: a run of 8, a rival branch thrice, the run again
    as the prompt; the response repeats the run. At its first step none of its suffixes is in the
    corpus; the window inserted after it gives them children, which the match state, advanced from the
    matches it did not find, does not see at the next step (a match looked up afresh does: the run's
    own continuation, not the rival's more frequent one)."""
    run = [first + i for i in range(8)]
    prompt = run + [first + 1, first + 8] * 3 + run
    return prompt + (run * 4)[:30], len(prompt)


def padding_rival() -> list[tuple[list[int], int]]:
    """Two requests: the first puts [300, 0, 301] into the corpus; the second's first step matches
    [300], whose few continuations leave the tree short (padded with 0) and give the root a real
    child 0: the target's 0 then follows that child (and 301 after it), not a padding node."""
    return [([300, 0, 301, 300, 0, 301, 310, 311, 312], 6), ([313, 300, 0, 301, 314, 315], 1)]


def requests_of(seed: int) -> list[tuple[list[int], int, int]]:
    """(tokens, prompt length, max_new_tokens) of the requests served in a row: random, motif and
    conversation turns, one-token responses; every other one ends at its budget (finished by length),
    the others before it (by a stop token)."""
    rng, requests = random.Random(seed), [novel_run(100)]
    for vocab in (3, 6, 40):
        requests.append((random_stream(rng, vocab, rng.randrange(50, 110)), rng.randrange(1, 25)))
        requests.append((motif_stream(rng, vocab, rng.randrange(60, 120)), rng.randrange(1, 25)))
    history = motif_stream(rng, 12, 20)
    for _ in range(3):  # each turn's prompt the last turn's whole request and a few new tokens
        tokens = history + motif_stream(rng, 12, 50)
        requests.append((tokens, len(history)))
        history = tokens + random_stream(rng, 12, 5)
    requests += [novel_run(200), *padding_rival(), ([7, 8, 9, 7, 8], 4), ([9, 7, 8, 9, 7], 4)]
    return [(tokens, p, len(tokens) - p + (7 if i % 2 else 0)) for i, (tokens, p) in enumerate(requests)]


STREAMS = requests_of(0)

# (draft tokens, max trie depth, min breadth, max breadth, capacity, overlap schedule) per match type
SETTINGS = {
    "SGLang's defaults": (12, 18, 1, 10, 200_000, True),  # capacity above anything the streams insert
    "small tree": (6, 4, 1, 3, 200_000, True),
    "wide and shallow": (9, 2, 2, 5, 200_000, True),
    "evicting trie": (8, 5, 1, 4, 40, True),
    "no overlap schedule": (8, 6, 1, 4, 200_000, False),
}
CASES = [(name, match) for name in SETTINGS for match in ("BFS", "PROB")]


def config_of(name: str, match: str):
    n, depth, low, high, capacity, overlap = SETTINGS[name]
    raw = {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": n,
        "speculative_ngram_max_trie_depth": depth,
        "speculative_ngram_min_bfs_breadth": low,
        "speculative_ngram_max_bfs_breadth": high,
        "speculative_ngram_match_type": match,
        "speculative_ngram_capacity": capacity,
        "disable_overlap_schedule": not overlap,
    }
    return parse_config(raw, "sglang.json").config


# -------------------------------------------------------------------------------------- SGLang's loop


@pytest.fixture(scope="module")
def corpus_class():
    """tools/sglang_ngram.Corpus over the library `make setup` built; never built here."""
    from tools.sglang_ngram import Corpus, load_library

    try:
        load_library()
        missing = None
    except ImportError as error:
        missing = str(error)
    if missing:
        pytest.fail(missing, pytrace=False)
    return Corpus


def tree_links(mask: list[int], n: int) -> tuple[list[int], list[int], list[int]]:
    """(parent, first child, next sibling) of each node, as ngram_worker.py:48-73 derives them from
    the mask (the same as ngram.cuh:26-90 reconstructIndicesFromTreeMask)."""
    parent = [max((j for j in range(i) if mask[i * n + j]), default=-1) for i in range(n)]
    first = [next((k for k in range(i + 1, n) if parent[k] == i), -1) for i in range(n)]
    sibling = [next((k for k in range(i + 1, n) if parent[k] == parent[i]), -1) if parent[i] >= 0 else -1
               for i in range(n)]  # fmt: skip
    return parent, first, sibling


def verify_greedy(tokens: list[int], mask: list[int], n: int, targets: list[int]) -> int:
    """eagle.cuh:214-254 VerifyTreeGreedy for one request: drafts accepted when the target's greedy
    token after a node of depth d is targets[d] (-1 past the stream: no draft matches it);
    num_speculative_tokens = max_tree_depth = draft_token_num (ngram_info.py:48-53)."""
    parent, first, sibling = tree_links(mask, n)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
    last, accepted, cur = 0, 0, 0
    for _ in range(1, n):
        cur = first[cur]
        target = targets[depth[last]] if depth[last] < len(targets) else -1
        while cur != -1:
            if tokens[cur] == target:
                accepted, last = accepted + 1, cur
                break
            cur = sibling[cur]
        if cur == -1:
            break
    return accepted


def paths_of_mask(tokens: list[int], mask: list[int], n: int) -> list[tuple]:
    """Every node's tokens from the root (padding included), sorted: the tree whatever its layout."""
    parent, _, _ = tree_links(mask, n)
    paths = [()] * n
    for i in range(1, n):
        paths[i] = paths[parent[i]] + (tokens[i],)
    return sorted(paths[1:])


def sglang_loop(corpus_class, config, requests) -> list[tuple]:
    """(request, anchor, tree, accepted) of every step SGLang's worker takes over `requests`, and
    (request, None, None, None) where a finished request runs its extra step (`overlap_step`)."""
    s = config.sglang
    corpus = corpus_class(s.capacity, s.max_trie_depth, s.min_bfs_breadth, s.max_bfs_breadth, s.draft_token_num,
                          s.match_type)  # fmt: skip
    steps, previous = [], set()
    for rid, (tokens, prompt_len, max_new) in enumerate(requests):
        position, accepted = (
            prompt_len,
            0,
        )  # the prefill's token: no draft, nothing inserted (ngram_worker.py:311, 403-407)
        while position < len(tokens) - 1:
            out, mask = sglang_step(corpus, s, rid, tokens, position + 1, previous)
            accepted = verify_greedy(out, mask, s.draft_token_num, tokens[position + 1 :])
            steps.append((rid, position, paths_of_mask(out, mask, s.draft_token_num), accepted))
            position, previous = position + accepted + 1, {rid}
        if overlap_step(s, prompt_len, position - accepted, max_new):
            sglang_step(corpus, s, rid, tokens, position + 1, previous)
            steps.append((rid, None, None, None))
    return steps


def sglang_step(corpus, s, rid: int, tokens: list[int], length: int, previous: set):
    """One verify step of the request with its first `length` tokens: synchronize, match (batch_get),
    the window put after the verification, the requests that left the batch erased. Past the stream
    the target's tokens are unknown: an extra step's window leaves them out, as the replay must."""
    window = tokens[max(0, length - s.max_trie_depth) : length]
    corpus.synchronize()
    out, mask = corpus.batch_get([rid], [window], [length])
    corpus.batch_put([window])
    if previous - {rid}:
        corpus.erase(sorted(previous - {rid}))
    return out.tolist(), mask.tolist()


def overlap_step(s, prompt_len: int, last_context: int, max_new: int) -> bool:
    """Whether a finished request runs one step more: the overlap schedule launches the next batch
    before processing the last result (managers/scheduler.py:2083-2120), leaving out only the requests
    whose queued result finishes them by length, len(output_ids) + 1 >= max_new_tokens with output_ids
    one step behind (scheduler.py:4444-4457, schedule_batch.py:1661-1663). `last_context`: the request's
    length at its last step (its prompt when it had none)."""
    return s.overlap and last_context - prompt_len + 1 < max_new


# -------------------------------------------------------------------------------------- the proposer


def paths_of_draft(draft: sglang_tree.Draft) -> list[tuple]:
    paths, todo = [], [(0, ())]
    while todo:
        pos, path = todo.pop()
        for token, child in draft.children[pos].items():
            paths.append(path + (token,))
            todo.append((child, path + (token,)))
    return sorted(paths + [(sglang_tree.PAD,)] * draft.padding)


def packed_of(tokens: list[int], prompt_len: int) -> PackedTokens:
    one = torch.tensor([1])
    return PackedTokens(torch.tensor(tokens), one * 0, one * len(tokens), one * prompt_len)


def our_loop(config, requests) -> list[tuple]:
    """The same steps with the proposer, driven as replay_walks drives a ServerStateful one."""
    proposer, steps, trees = ngram_proposer(config), [], []
    with pytest.MonkeyPatch.context() as mp:  # each step's tree kept, whichever corpus drafts it
        draft = proposer_module.SglangCorpus.draft
        mp.setattr(proposer_module.SglangCorpus, "draft", lambda *args: trees.append(draft(*args)) or trees[-1])
        for rid, (tokens, prompt_len, max_new) in enumerate(requests):
            steps += our_request(proposer, rid, tokens, prompt_len, max_new, trees)
    return steps


def our_request(proposer, rid: int, tokens: list[int], prompt_len: int, max_new: int, trees: list) -> list[tuple]:
    """One request's steps: begin (the last request's end), its budget, then per step the one-anchor
    draft call and its acceptance; (rid, None, None, None) for the extra step the reference records."""
    packed, steps, position, accepted = packed_of(tokens, prompt_len), [], prompt_len, 0
    proposer.begin(packed, 0)
    proposer.set_budget(max_new)
    while position < len(tokens) - 1:
        chunk = Chunk(torch.tensor([0]), torch.tensor([position]), proposer.max_drafts)
        [drafts] = proposer.propose(packed, [chunk], None, None)
        chain = drafts.tokens[0, : int(drafts.limit[0])].tolist()
        known = tokens[position + 1 : position + 1 + len(chain)]
        accepted = next((j for j, (d, t) in enumerate(zip(chain, known)) if d != t), min(len(chain), len(known)))
        proposer.accept(accepted)
        steps.append((rid, position, paths_of_draft(trees[-1]), accepted))
        position += accepted + 1
    if overlap_step(proposer.config.sglang, prompt_len, position - accepted, max_new):
        steps.append((rid, None, None, None))  # inserted at the next begin
    return steps


@pytest.fixture(scope="module")
def references(corpus_class) -> dict:
    return {case: sglang_loop(corpus_class, config_of(*case), STREAMS) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{n}" for n, m in CASES])
def test_trees_and_acceptance_equal_sglangs_at_every_step(references, case):
    expected, ours = references[case], our_loop(config_of(*case), STREAMS)
    first = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a != b), None)
    assert first is None and len(ours) == len(expected), (first, expected[first or 0], ours[first or 0])
    accepted = [step[3] for step in expected if step[1] is not None]
    padded = sum(1 for step in expected if step[1] is not None and step[2].count((0,)) > 1)
    longest = min(3, SETTINGS[case[0]][1] - 1)  # a match of d tokens drafts at most max_trie_depth - d
    assert sum(accepted) > len(accepted) // 4 and max(accepted) >= longest, accepted  # the rules decide something
    assert padded > 0  # trees short of their size, padded with token 0


# -------------------------------------------------------------------------------------- wrong rules


def teacher_forced(mp):
    """Every anchor's window inserted, as an all-anchor replay would see the corpus."""

    def accept(self, accepted):
        for position in range(self.position, self.position + accepted + 1):
            self.corpus.put(self.tokens, position + 1)
        self.position += accepted + 1

    mp.setattr(proposer_module.SglangNgramProposer, "accept", accept)


def nothing_inserted(mp):
    mp.setattr(proposer_module.SglangCorpus, "put", lambda self, tokens, length: None)


def accepted_tokens_in_the_window(mp):
    """The window taken after the step's tokens are appended (req.output_ids updated first)."""

    def accept(self, accepted):
        self.corpus.put(self.tokens, self.position + accepted + 2)
        self.position += accepted + 1

    mp.setattr(proposer_module.SglangNgramProposer, "accept", accept)


def prompt_inserted(mp):
    begin = proposer_module.SglangNgramProposer.begin

    def with_prompt(self, packed, sample_idx):
        begin(self, packed, sample_idx)
        self.corpus.trie.insert(self.tokens[: self.position])

    mp.setattr(proposer_module.SglangNgramProposer, "begin", with_prompt)


def state_rebuilt(mp):
    """No match state kept from step to step: every suffix looked up afresh."""
    match = sglang_trie.Trie.match

    def afresh(self, context, state, total_len):
        state.epoch = 0
        return match(self, context, state, total_len)

    mp.setattr(sglang_trie.Trie, "match", afresh)


def never_evicted(mp):
    """The capacity ignored: nothing squeezed out of the trie."""
    mp.setattr(sglang_trie.Trie, "squeeze", lambda self, count: setattr(self, "free", self.free + count))


def no_extra_step(mp):
    """The overlap schedule's extra step at a request's end left out (the sync schedule's rule)."""
    mp.setattr(proposer_module.SglangNgramProposer, "_finish", lambda self: None)


def extra_step_always(mp):
    """The extra step run even where the scheduler knew the request finished by length."""

    def finish(self):
        if self.config.sglang.overlap and self.tokens and self.max_new_tokens is not None:
            context, accepted = self.last_step or (self.prompt_len, 0)
            self.corpus.put(self.tokens, context + accepted + 1)

    mp.setattr(proposer_module.SglangNgramProposer, "_finish", finish)


def fresh_corpus_per_request(mp):
    begin = proposer_module.SglangNgramProposer.begin

    def afresh(self, packed, sample_idx):
        self.corpus = proposer_module.SglangCorpus(self.config.sglang)
        begin(self, packed, sample_idx)

    mp.setattr(proposer_module.SglangNgramProposer, "begin", afresh)


def oldest_child_first(mp):
    mp.setattr(sglang_trie.TrieNode, "by_recency", lambda self: iter(self.children.values()))


def ties_first_in_first_out(mp):
    """PROB's equal probabilities popped in push order, not as std::priority_queue leaves them."""

    class Stable(sglang_tree.CppMaxHeap):
        def push(self, value):
            self.items.append(value)

        def pop(self):
            best = max(range(len(self.items)), key=lambda i: (self.items[i][2], -i))
            return self.items.pop(best)

    mp.setattr(sglang_tree, "CppMaxHeap", Stable)


def padding_never_accepted(mp):
    verified = sglang_tree.verified_path

    def without(draft, targets):
        return verified(sglang_tree.Draft(draft.children, 0), targets)

    mp.setattr(proposer_module, "verified_path", without)


def padding_before_real_children(mp):
    """A padding node tried before the root's real child 0 (verification tries them in layout order)."""
    verified = sglang_tree.verified_path

    def padding_first(draft, targets):
        if targets and targets[0] == sglang_tree.PAD and draft.padding:
            return [sglang_tree.PAD], False
        return verified(draft, targets)

    mp.setattr(proposer_module, "verified_path", padding_first)


# each wrong rule, and the match types on which it must change the steps
MUTATIONS = {
    "teacher-forced corpus": (teacher_forced, ("BFS", "PROB")),
    "accepted windows not inserted": (nothing_inserted, ("BFS", "PROB")),
    "the step's tokens in its window": (accepted_tokens_in_the_window, ("BFS", "PROB")),
    "prompt inserted at prefill": (prompt_inserted, ("BFS", "PROB")),
    "match state rebuilt every step": (state_rebuilt, ("BFS", "PROB")),
    "a fresh corpus per request": (fresh_corpus_per_request, ("BFS", "PROB")),
    "the capacity ignored": (never_evicted, ("BFS", "PROB")),
    "no extra step at a request's end": (no_extra_step, ("BFS", "PROB")),
    "an extra step even when finished by length": (extra_step_always, ("BFS", "PROB")),
    "BFS takes the oldest children": (oldest_child_first, ("BFS",)),
    "PROB ties first in, first out": (ties_first_in_first_out, ("PROB",)),
    "padding never accepted": (padding_never_accepted, ("BFS", "PROB")),
    "padding before a real child 0": (padding_before_real_children, ("BFS", "PROB")),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_plausible_wrong_rule_gives_other_steps(references, name):
    mutate, matches = MUTATIONS[name]
    with pytest.MonkeyPatch.context() as mp:
        mutate(mp)
        for match in matches:
            differing = [
                case for case in CASES if case[1] == match and our_loop(config_of(*case), STREAMS) != references[case]
            ]
            assert differing, f"{name} gives SGLang's steps on every {match} case"


# -------------------------------------------------------------------------------------- the replay


def sample_of(index: int, tokens: list[int], prompt_len: int) -> Sample:
    rows = len(tokens) - prompt_len + 1
    return Sample(
        f"s{index}", "d", "", torch.tensor(tokens), prompt_len, "length", True,
        {"topk_ids": torch.zeros(rows, 2, dtype=torch.long), "topk_logprobs": torch.zeros(rows, 2)},
    )  # fmt: skip


def replayed_steps(proposer, requests, walk_rule: str = "sglang") -> list[tuple]:
    """(request, anchor, accepted) of each step replay_walks takes, one request at a time as
    scoring/score/steps.py runs a ServerStateful proposer (groups of one sample, the shards' order)."""
    vocab = max(max(tokens) for tokens, _, _ in requests) + 1
    head = TargetHead(torch.zeros(vocab, 4), torch.zeros(vocab, 4))
    options, steps = ReplayOptions(methods={}, walk_rule=walk_rule), []
    for rid, (tokens, prompt_len, max_new) in enumerate(requests):
        sample = sample_of(rid, tokens, prompt_len)
        is_stop = stop_mask(sample.input_ids, [])
        [result] = replay_walks(proposer, head, [sample], lambda f: f, [max_new], [CHAIN], [is_stop], options)
        position = prompt_len
        while position < len(tokens) - 1:
            row = position - prompt_len
            depth = int(result.depth[row])
            hits = (result.draft_tokens[row, :depth] == result.target_tokens[row, :depth]).long().cumprod(0)
            steps.append((rid, position, int(hits.sum())))
            position += int(hits.sum()) + 1
    return steps


@pytest.mark.parametrize("case", [("SGLang's defaults", "BFS"), ("evicting trie", "PROB")], ids=["BFS", "PROB"])
def test_replay_walks_takes_sglangs_steps_and_counts(references, case):
    """The replay drives the proposer (begin, one-anchor drafts, accept) along SGLang's own walk:
    the same anchors, the same accepted drafts, request after request on one corpus."""
    config = config_of(*case)
    steps = replayed_steps(ngram_proposer(config), STREAMS)
    assert steps == [
        (rid, position, accepted) for rid, position, _, accepted in references[case] if position is not None
    ]


# -------------------------------------------------------------------------------------- the settings


def test_the_config_takes_sglangs_flags_and_defaults():
    config = parse_config({"speculative_algorithm": "NGRAM"}, "sglang.json").config
    assert (config.layout, config.rule, config.block_size) == ("sglang", "sglang", 11)
    assert config.sglang == SglangSettings(12, 18, 1, 10, "BFS", 10_000_000)  # spec.py:250-283, 12 drafts
    proposer = ngram_proposer(config)
    assert isinstance(proposer, ServerStateful) and proposer.walk_rule == "sglang" and proposer.max_drafts == 11
    no_corpus = {"speculative_ngram_external_sam_budget": 4, "speculative_ngram_external_corpus_max_tokens": 9}
    assert parse_config({"speculative_algorithm": "NGRAM", **no_corpus}, "s.json").config.sglang == config.sglang


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens"),
        ({"speculative_num_draft_tokens": 1025}, "speculative_num_draft_tokens"),
        ({"speculative_ngram_max_trie_depth": 1}, "speculative_ngram_max_trie_depth"),
        ({"speculative_ngram_min_bfs_breadth": 0}, "speculative_ngram_min_bfs_breadth"),
        ({"speculative_ngram_min_bfs_breadth": 4, "speculative_ngram_max_bfs_breadth": 3},
         "speculative_ngram_min_bfs_breadth 4 exceeds speculative_ngram_max_bfs_breadth 3"),
        ({"speculative_ngram_capacity": 18}, "speculative_ngram_capacity 18 must exceed speculative_ngram_max_trie"),
        ({"speculative_ngram_match_type": "DFS"}, "speculative_ngram_match_type"),
        ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
        ({"speculative_eagle_topk": 4}, "speculative_eagle_topk"),  # SGLang sets it from the breadth itself
    ],
)  # fmt: skip
def test_a_setting_sglang_would_refuse_is_refused_by_name(fields, message):
    with pytest.raises(DrafterConfigError, match=message) as error:
        parse_config({"speculative_algorithm": "NGRAM", **fields}, "sglang.json")
    assert str(error.value).startswith("sglang.json: ") and "\n" not in str(error.value)


def test_what_the_replay_does_not_run_is_one_line_naming_why():
    """An external corpus (a suffix automaton beside the trie), another walk rule, sampled shards."""
    raw = {"speculative_algorithm": "NGRAM", "speculative_ngram_external_corpus_path": "corpus.jsonl"}
    with pytest.raises(UserError, match="'speculative_ngram_external_corpus_path': SGLang's external n-gram corpus"):
        parse_config(raw, "sglang.json")
    config = parse_config({"speculative_algorithm": "NGRAM"}, "sglang.json").config
    proposer, info = ngram_proposer(config), SimpleNamespace(name="ngram_sglang", config_raw={})
    with pytest.raises(UserError, match="SGLang's NGRAM keeps state along the server's loop.*--walk-rule sglang$"):
        stateful_config(ScoreConfig([], "", "", walk_rule="vllm"), info, Sampling(), Dist(), proposer)
    with pytest.raises(UserError, match="SGLang's NGRAM keeps state .* greedy shards only"):
        stateful_config(ScoreConfig([], "", "", walk_rule="sglang"), info, Sampling(temperature=0.7), Dist(), proposer)
    replayed = stateful_config(ScoreConfig([], "", "", walk_rule="sglang"), info, Sampling(), Dist(), proposer)
    assert (replayed.anchors, replayed.walk_group_tokens) == ("walk", 0)
    with pytest.raises(UserError, match="--steps: SGLang's NGRAM drafts a tree of speculative_num_draft_tokens - 1"):
        set_chain_steps(4, config, "ngram_sglang", "sglang")


# -------------------------------------------------------------------------------------- end to end

MAX_NEW = 40


@pytest.fixture(scope="module")
def shards(tiny_qwen3_dir, tmp_path_factory) -> str:
    """The tiny target's greedy responses to prompts that repeat themselves, no feature layer."""
    tmp = tmp_path_factory.mktemp("sglang_ngram")
    prompts = [ids + ids[:6] + ids for ids in parity.prompt_ids(3)]
    path = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompts)])
    return parity.extract(tmp / "shards", tiny_qwen3_dir, path, MAX_NEW, [])


@pytest.mark.slow
def test_score_reports_sglangs_steps(shards, corpus_class, tmp_path):
    """`score --ckpt sglang.json --walk-rule sglang` under SGLang's defaults: walk.parquet's accepted
    drafts, step by step and sample after sample in the shards' order, are those of SGLang's loop over
    the stored responses."""
    from pipeline.shards import ShardSet

    raw = {"speculative_algorithm": "NGRAM"}
    config = tmp_path / "sglang.json"
    config.write_text(json.dumps(raw))
    out = tmp_path / "out"
    args = ["score", "--ckpt", str(config), "--shards", shards, "--out", str(out), "--walk-rule", "sglang"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    [results] = list(out.glob("*/walk.parquet"))
    walk = pl.read_parquet(results).filter(pl.col("method") == "chain")
    samples = list(ShardSet(shards).samples(tensors=[]))
    requests = [(s.input_ids.tolist(), s.prompt_len, MAX_NEW) for s in samples]
    expected = sglang_loop(corpus_class, parse_config(raw, "sglang.json").config, requests)
    for rid, sample in enumerate(samples):
        steps = walk.filter(pl.col("sample_id") == sample.sample_id).sort("step")
        assert steps["accepted_len"].to_list() == [a for r, p, _, a in expected if r == rid and p is not None]
    assert sum(step[3] or 0 for step in expected) > 0
    assert json.loads((results.parent / "run.json").read_text())["requests"].startswith("one at a time")
