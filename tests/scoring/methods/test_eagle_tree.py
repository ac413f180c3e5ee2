"""EAGLE tree settings, names and verification on hand-built candidates (the exactness of the
drafted trees is tests/parity/test_eagle3_parity.py's)."""

from __future__ import annotations

import pytest
import torch

from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling
from proposers.interface import ROOT, Needs, TreeCandidates
from scoring.config import ScoreConfig
from scoring.methods.eagle_tree import EAGLE_TREES, EagleTree, accepted_depth, parse_eagle_trees
from scoring.methods.registry import accepted_column, method_order
from scoring.score.steps import eagle_trees_of


def test_settings_parse_name_and_sort():
    trees = parse_eagle_trees("4x5-8, 2x3-5,4x5-8")
    assert [t.method for t in trees] == ["eagle-tree-4x5-8", "eagle-tree-2x3-5"]
    assert trees[0].column == "eagle_tree_4x5_8_accepted_len"
    assert EAGLE_TREES.setting_of("eagle-tree-4x5-8") == trees[0]
    assert EAGLE_TREES.setting_of("ddtree-8") is None
    methods = ["eagle-tree-4x5-8", "ddtree-16", "chain", "eagle-tree-2x3-5", "ddtree-4"]
    assert sorted(methods, key=method_order) == [
        "chain",
        "ddtree-4",
        "ddtree-16",
        "eagle-tree-2x3-5",
        "eagle-tree-4x5-8",
    ]
    assert accepted_column("eagle-tree-2x3-5") == "eagle_tree_2x3_5_accepted_len"


@pytest.mark.parametrize("text", ["4x5", "4x0-8", "2x2-8", "4x5-1", "x5-8"])
def test_a_setting_sglang_would_not_run_is_one_line_naming_the_option(text):
    with pytest.raises(UserError, match="^--eagle-trees") as error:
        parse_eagle_trees(text)
    assert "\n" not in str(error.value)


class Chain:
    """A proposer as steps.eagle_trees_of sees it: its family, and whether it drafts its own trees."""

    layout, needs, independent_drafts, max_drafts = "speculators", Needs(), False, 3

    def __init__(self, family: str):
        self.family = family

    def block_len(self, remaining): ...
    def depth(self, block_len): ...
    def prepare(self, samples, target, options): ...
    def anchors_per_chunk(self, block_len, ctx_len, vocab, options): ...
    def propose(self, packed, chunks, target, options): ...
    def draft_logprob(self, logits, tokens, sampling): ...


class Tree(Chain):
    def tree_candidates(self, packed, chunk, topk, depth, target, options): ...


def test_eagle_trees_are_refused_for_other_families_and_skipped_when_sampled():
    dflash, eagle = Chain("dflash"), Tree("eagle3")
    given = ScoreConfig(ckpts=[], shards="", out="", eagle_trees=["4x5-8"])
    with pytest.raises(UserError, match="^--eagle-trees: ck is a DFlash drafter"):
        eagle_trees_of(given, dflash, Sampling(), "ck")
    default = ScoreConfig(ckpts=[], shards="", out="")
    assert eagle_trees_of(default, dflash, Sampling(), "ck") == ()
    assert [t.name for t in eagle_trees_of(default, eagle, Sampling(), "ck")] == ["4x5-8"]
    assert eagle_trees_of(given, eagle, Sampling(0.7, 1.0, 0), "ck") == ()


def _two_levels() -> TreeCandidates:
    """One anchor, topk 2, depth 2: depth 1 tokens 5 (0.6), 7 (0.4); beam children of 5: 9 (0.6 x
    0.5), 3 (0.6 x 0.5); of 7: 9 (0.4 x 0.9), 1 (0.4 x 0.1)."""
    scores = torch.tensor([[0.6, 0.4, 0.3, 0.3, 0.36, 0.04]])
    tokens = torch.tensor([[5, 7, 9, 3, 9, 1]])
    parents = torch.tensor([[ROOT, ROOT, 0, 0, 1, 1]])
    return TreeCandidates(scores, tokens, parents, topk=2)


@pytest.mark.parametrize(
    ("draft_tokens", "targets", "alpha"),
    [
        (5, [7, 9], 2),  # kept: 0.6, 0.4, 0.36, then 0.3 (index 2) of the tie: 7 -> 9 reached
        (3, [7, 9], 1),  # kept 0.6, 0.4: depth 2 not in the tree
        (4, [5, 3], 1),  # kept 0.6, 0.4, 0.36: of the tied 0.3s none, so 5 -> 3 is cut
        (5, [5, 3], 1),  # the tie goes to the earlier candidate (5 -> 9), not 5 -> 3
        (6, [5, 3], 2),
        (6, [1, 9], 0),  # no depth-1 node holds the target's token
        (6, [5, -1], 1),  # the target unknown past the response
    ],
)
def test_alpha_descends_the_kept_nodes_along_the_targets(draft_tokens, targets, alpha):
    tree = EagleTree(2, 2, draft_tokens)
    assert accepted_depth(_two_levels(), tree, torch.tensor([targets])).tolist() == [alpha]


def test_a_node_whose_parent_is_not_accepted_is_never_reached():
    """Token 9 is at depth 2 under both parents; only the path through the accepted parent counts."""
    tree = EagleTree(2, 2, 6)
    assert accepted_depth(_two_levels(), tree, torch.tensor([[7, 3]])).tolist() == [1]  # 3 is 5's child
