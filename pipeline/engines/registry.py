"""The engines by name (`--engine`) and how a server says which one it is and what it serves:
GET /v1/models, whose `owned_by` names the engine ("llamacpp", "vllm", "sglang")."""

from __future__ import annotations

from pipeline.engines.client import Client, EngineError
from pipeline.engines.dialect import Dialect
from pipeline.engines.llamacpp import LlamaCpp
from pipeline.engines.schemas import ModelCard, ModelList, read
from pipeline.engines.sglang import Sglang
from pipeline.engines.vllm import Vllm

DIALECTS: dict[str, Dialect] = {d.name: d for d in (LlamaCpp(), Vllm(), Sglang())}
AUTO = "auto"


def served_models(client: Client) -> list[ModelCard]:
    where = client.url + "/v1/models"
    cards = read(ModelList, client.get("/v1/models"), where).data
    if not cards:
        raise EngineError(f"serving engine {where} serves no model (is it still loading?)")
    return cards


def pick_dialect(found: list[tuple[Client, list[ModelCard]]], engine: str) -> Dialect:
    if engine != AUTO:
        if engine not in DIALECTS:
            raise EngineError(f"--engine {engine!r} is not one of {', '.join([AUTO, *DIALECTS])}")
        return DIALECTS[engine]
    by_owner = {d.owned_by: d for d in DIALECTS.values()}
    named = {client.url: cards[0].owned_by for client, cards in found}
    unknown = {url: owner for url, owner in named.items() if owner not in by_owner}
    if unknown:
        url, owner = next(iter(unknown.items()))
        raise EngineError(
            f"serving engine {url}: cannot tell which engine it is (GET /v1/models says owned_by {owner!r}); "
            f"pass --engine {' or '.join(DIALECTS)}"
        )
    if len(set(named.values())) > 1:
        raise EngineError(f"the servers named are of different engines ({named}); give servers of one engine")
    return by_owner[next(iter(named.values()))]


def pick_model(found: list[tuple[Client, list[ModelCard]]], served_model: str | None) -> str:
    """--served-model, which every server must serve; without it the one model they all serve."""
    for client, cards in found:
        ids = [card.id for card in cards]
        if served_model is not None and served_model not in ids:
            raise EngineError(
                f"serving engine {client.url} does not serve model {served_model!r} (it serves {', '.join(map(repr, ids))}); "
                f"pass one of those to --served-model"
            )
        if served_model is None and len(ids) > 1:
            raise EngineError(
                f"serving engine {client.url} serves {len(ids)} models ({', '.join(map(repr, ids))}); "
                f"say which with --served-model"
            )
    names = {cards[0].id for _, cards in found}
    if served_model is None and len(names) > 1:
        raise EngineError(f"the servers named serve different models ({', '.join(sorted(names))})")
    return served_model or names.pop()
