"""SGLang's n-gram speculative decoding (SGLang 0.5.23, `--speculative-algorithm NGRAM`) as a
ServerStateful proposer (proposers/interface.py): its drafts depend on its own earlier steps and on the
requests before, so it is replayed along the online loop, greedy only, under `--walk-rule sglang`.

The worker's loop (sglang/srt/speculative/ngram_worker.py), one request at a time:

- prefill (extend, ngram_worker.py:311-312, 539-558): no draft and nothing put into the corpus; the
  prompt is never inserted whole (ngram_worker.py:403-407: "we will not insert it for now").
- every decode step verifies a tree (ngram_worker.py:301-305: "we always enforce it"). Its draft
  (_prepare_draft_tokens, 232-305): the corpus's pending inserts are waited for (280), then matched
  with the request's last max_trie_depth tokens (prompt and output, 283-295; the request's length as
  total_len) under the request's own match state (cpp_ngram/ngram_corpus.py:100-107: a state id per
  request id, trie.cpp:204-218: cached and advanced from step to step).
- after the verification (_update_ngram_corpus, 396-420, called at 527) the SAME last max_trie_depth
  tokens are inserted (the tokens the step has just accepted are not in req.output_ids yet, sync mode;
  under the overlap schedule both the match and the insert splice in the previous step's tokens,
  243-295 / 401-417, the same window): every suffix of that window (sglang_trie.Trie.insert), one
  window per step, so an n-gram's frequency grows with the steps that see it.
- a request's match state is erased once it has left the batch (528-536); the next request has its
  own anyway (a new state id). The trie is shared by every request and is only emptied by a cache
  flush (ngram_worker.py:150-152), which the replay never does.
- under the overlap schedule (SGLang's default on CUDA; `disable_overlap_schedule` turns it off, the
  CPU device too: speculative_hook.py:66-75) the scheduler launches the next step before it has
  processed the last one's result (managers/scheduler.py:2083-2120), so a request that has just
  finished runs one step more, its tokens discarded, unless the scheduler already knows the step
  before finishes it by length: len(output_ids) + 1 >= max_new_tokens with output_ids one step behind
  (scheduler.py:4444-4457 `_reqs_finishing_inflight`, schedule_batch.py:1661-1663). That step
  inserts its window too: the request's last max_trie_depth tokens through everything the last step
  accepted (the prefill's token when it had no step; the previous step's tokens are spliced in,
  ngram_worker.py:262-295, 401-417). That window can reach past the stored response: the bonus token
  after a last step that accepted the response's last token as a draft, and the drafts it accepted
  past the end where its count is a lower bound. Those tokens are unknown and left out: the window
  holds SGLang's tokens up to the stored end, so the later requests' drafts can differ from SGLang's
  by the n-grams that end in them (the one place the replay is not exact under this schedule).

The tree's verification is greedy along the target's tokens, which for the stored greedy response
are the stored tokens: the drafts accepted are the tree's path that follows them
(sglang_tree.verified_path). The proposer hands the replay that path as its chain of drafts, and one
child more where its last node has children left to try (rejected, or past the stored response:
the count is then a lower bound), so the walk's chain acceptance is the tree's. A padding token 0
counts as SGLang counts it: accepted at the root when the target's token is 0 and no real child is.
SGLang does not cut drafts to the budget: walk rule `sglang` (accepted drafts past the end counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proposers.interface import Chunk, Drafts, PackedTokens
from proposers.ngram.sglang_tree import build_bfs, build_prob, rejected_child, verified_path
from proposers.ngram.sglang_trie import MatchState, Trie
from proposers.toolkit.token_chain import TokenChain

UNPROPOSED = -1


@dataclass(frozen=True)
class SglangSettings:
    """SGLang's flags (srt/arg_groups/fields/spec.py:250-283), resolved as _handle_ngram resolves them."""

    draft_token_num: int = 12  # speculative_num_draft_tokens (speculative_hook.py:1314-1323)
    max_trie_depth: int = 18
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"
    capacity: int = 10_000_000
    overlap: bool = True  # not disable_overlap_schedule (srt/arg_groups/fields/schedule.py:193)

    @property
    def budget(self) -> int:
        """Tree nodes below the root: Param::get_draft_token_num (param.h:30-38), ngram.cpp:171."""
        return self.draft_token_num - 1


class SglangCorpus:
    """The worker's NgramCorpus with one request at a time: `draft` a step's tree, `put` its window."""

    def __init__(self, settings: SglangSettings):
        self.settings = settings
        self.trie = Trie(settings.capacity, settings.max_trie_depth)

    def window(self, tokens: list[int], length: int) -> list[int]:
        """The request's last max_trie_depth tokens of its first `length` (_efficient_concat_last_n),
        those past the stored tokens left out."""
        return tokens[max(0, length - self.settings.max_trie_depth) : length]

    def draft(self, tokens: list[int], length: int, state: MatchState):
        """The tree drafted after the request's first `length` tokens (ngram.cpp:144-191, trie only:
        no external corpus, ngram.cpp:170-175)."""
        s = self.settings
        anchors = self.trie.match(self.window(tokens, length), state, length)
        if s.match_type == "BFS":
            return build_bfs(anchors, s.budget, s.max_trie_depth, s.min_bfs_breadth, s.max_bfs_breadth)
        return build_prob(anchors, s.budget, s.max_bfs_breadth)

    def put(self, tokens: list[int], length: int) -> None:
        self.trie.insert(self.window(tokens, length))


class SglangNgramProposer(TokenChain):
    """Drafts along SGLang's loop: `begin`, one-anchor `propose` calls and `accept` in walk order."""

    server = "SGLang's NGRAM"
    walk_rule = "sglang"  # the loop it is replayed under (scoring/score/steps.py stateful_config)

    def __init__(self, config):
        super().__init__(config)
        self.corpus = SglangCorpus(config.sglang)
        self.tokens: list[int] = []
        self.state = MatchState()
        self.prompt_len = 0
        self.position = 0  # the anchor of the current step: the request holds tokens[: position + 1]
        self.last_step: tuple[int, int] | None = None  # (context length, accepted) of the request's last step
        self.max_new_tokens: int | None = None  # the request's budget (set_budget); None: not finished yet

    def prepare(self, samples, target, options):
        return None, [None for _ in samples]  # the state lives across requests, in self.corpus

    def begin(self, packed: PackedTokens, sample_idx: int) -> None:
        self._finish()
        start, length = int(packed.starts[sample_idx]), int(packed.lengths[sample_idx])
        self.tokens = packed.ids[start : start + length].tolist()
        self.state = MatchState()  # a new request id, a new state id (ngram_corpus.py:44-50)
        self.prompt_len = self.position = int(packed.prompt_lens[sample_idx])  # prefill: the first response token
        self.last_step, self.max_new_tokens = None, None

    def set_budget(self, max_new_tokens: int) -> None:
        """The current request's max_new_tokens (scoring/replay/anchors.py replay_walks, after begin)."""
        self.max_new_tokens = max_new_tokens

    def _finish(self) -> None:
        """The finished request's extra step under the overlap schedule (module docstring), before the
        next request's first match; nothing reads the corpus in between."""
        if not (self.config.sglang.overlap and self.tokens and self.max_new_tokens is not None):
            return
        context, accepted = self.last_step or (self.prompt_len, 0)  # no step: the prefill's token alone
        if context - self.prompt_len + 1 >= self.max_new_tokens:  # known to finish by length: left out
            return
        self.corpus.put(self.tokens, context + accepted + 1)  # tokens past the stored ones left out

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        [chunk] = chunks  # one step at a time (scoring/replay/anchors.py replay_walks)
        assert chunk.anchors.numel() == 1, "replayed one step at a time, SGLang's loop"
        self.position = int(chunk.anchors[0])
        draft = self.corpus.draft(self.tokens, self.position + 1, self.state)
        known = self.tokens[self.position + 1 : self.position + 1 + chunk.block_len]
        path, more = verified_path(draft, known)
        chain = (path + [rejected_child(draft, path)] if more else path)[: chunk.block_len]
        out = torch.full((1, chunk.block_len), UNPROPOSED, dtype=torch.long)
        out[0, : len(chain)] = torch.tensor(chain, dtype=torch.long)
        device = chunk.anchors.device
        return [Drafts(None, out.to(device), torch.tensor([len(chain)], device=device))]

    def accept(self, accepted: int) -> None:
        """After the step's verification: its window into the corpus (ngram_worker.py:527)."""
        self.corpus.put(self.tokens, self.position + 1)
        self.last_step = (self.position + 1, accepted)
        self.position += accepted + 1
