"""The verification methods, registered in results order (chain, DDTree budgets, EAGLE trees), and
what a run plans of them: `plan` maps a method's kind to its settings for one checkpoint (the chain
always; a tree method only where it applies to the proposer, scoring/score/steps.py)."""

from __future__ import annotations

from scoring.methods.base import Method
from scoring.methods.chain import CHAIN, CHAIN_METHOD
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES

METHODS: tuple[Method, ...] = (CHAIN_METHOD, DDTREE, EAGLE_TREES)
TREES = METHODS[1:]  # the methods a plan lists settings for (the chain has one, always)


def method_of(name: str) -> tuple[Method, object]:
    """(the method, its setting) a results method name spells; ValueError for an unknown name."""
    for method in METHODS:
        setting = method.setting_of(name)
        if setting is not None:
            return method, setting
    raise ValueError(f"unknown method {name!r}: expected 'chain', 'ddtree-N' or 'eagle-tree-KxD-N'")


def planned(plan: dict) -> list[tuple[Method, object]]:
    """(method, setting) of every method a plan runs, in results order: the chain first."""
    return [(CHAIN_METHOD, CHAIN)] + [(m, s) for m in TREES for s in plan.get(m.kind, ())]


def method_names(plan: dict) -> list[str]:
    """['chain', then each planned tree method's name in the plan's order within its method]."""
    return [method.name(setting) for method, setting in planned(plan)]


def method_order(name: str) -> tuple:
    """Sort key: the registry's order of methods, then each method's own order (the tree's size
    first: the second entry); an unknown name last, by name."""
    try:
        method, setting = method_of(name)
    except ValueError:
        return (len(METHODS), 0, name)
    return (METHODS.index(method), *method.order(setting))


def accepted_column(name: str, sampled: bool = False) -> str:
    """anchors.parquet column of a method's accepted length per anchor (bonus-exclusive). On
    sampled shards the chain's is its expectation under rejection sampling."""
    method, setting = method_of(name)
    return method.column(setting, sampled)


def accepted(result, name: str, plan: dict, rows=slice(None)):
    """Accepted drafts [A] (bonus-exclusive) of the method `name` at the anchors `rows` of `result`."""
    method, setting = method_of(name)
    return method.accepted(result, setting, plan.get(method.kind, ()), rows)


def anchor_fields(plan: dict) -> list:
    """The anchors.parquet columns the planned tree methods add, in results order."""
    return [field for method in TREES for field in method.anchor_fields(plan.get(method.kind, ()))]
