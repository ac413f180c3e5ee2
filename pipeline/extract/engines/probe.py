"""Before any response is asked for (and before anything is written): every server in
--responses-from answers, says which engine it is, serves the model extract will name, and
tokenises like the target (same ids for the same text, same vocabulary size where it reports
one). Each failure is one EngineError line naming the server and what differs.

Which engine a server is comes from GET /v1/models `owned_by` ("llamacpp", "vllm", "sglang")
unless --engine names it (behind a proxy that rewrites the listing, say).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from pipeline.engines.client import Client, EngineError, Refused, Retry
from pipeline.engines.dialect import Dialect
from pipeline.engines.registry import pick_dialect, pick_model, served_models
from pipeline.engines.schemas import ModelCard, Tokenized, read

# Appended to the first prompts as the tokenizer probe: words, digits, code and non-ASCII text.
PROBE_TEXT = "\nThe 3 quick brown foxes (x=42.5) jumped: def f(a): return a**2 # café, naïve, 東京\n"
PROBE_PROMPTS = 3  # rendered prompts tokenised with the probe text


@dataclass
class Engine:
    """The servers extract asks, all of one engine serving one model."""

    dialect: Dialect
    clients: list[Client]
    model: str  # the served model's name, sent with every request

    def facts(self, sampling) -> dict:
        """manifest settings["responses"]: what made the responses (compared on resume; the
        servers' addresses are not, so a restarted server on another port resumes)."""
        return {"engine": self.dialect.name, "model": self.model, "sampling_rule": self.dialect.sampling_rule(sampling)}


def connect(
    urls: list[str], engine: str, served_model: str | None, tokenizer, vocab_size: int, texts: list[str], retry: Retry
) -> Engine:
    """Check every server (module docstring) and return the Engine; EngineError otherwise."""
    clients = [Client(url, retry) for url in urls]
    found = [(client, served_models(client)) for client in clients]
    dialect = pick_dialect(found, engine)
    model = pick_model(found, served_model)
    probe = "".join(texts[:PROBE_PROMPTS]) + PROBE_TEXT
    expected = list(tokenizer(probe, add_special_tokens=False).input_ids)
    for client, cards in found:
        check_vocab_size(client, next(c for c in cards if c.id == model), vocab_size, len(tokenizer))
        check_tokenizer(client, dialect, model, probe, expected)
    return Engine(dialect, clients, model)


def check_vocab_size(client: Client, card: ModelCard, vocab_size: int, tokenizer_size: int) -> None:
    """llama.cpp reports meta.n_vocab: it must be the target's embedding rows or tokenizer size."""
    n_vocab = (card.meta or {}).get("n_vocab")
    if isinstance(n_vocab, int) and n_vocab not in (vocab_size, tokenizer_size):
        raise EngineError(
            f"serving engine {client.url} model {card.id!r} has a vocabulary of {n_vocab} tokens, the target "
            f"{vocab_size} (tokenizer {tokenizer_size}); serve the target's own weights"
        )


def check_tokenizer(client: Client, dialect: Dialect, model: str, probe: str, expected: list[int]) -> None:
    """The server's token ids for the probe text equal the target tokenizer's."""
    path, body = dialect.tokenize(probe, model)
    try:
        got = read(Tokenized, client.post(path, body), client.url + path).tokens
    except Refused as error:
        if error.status != 404:
            raise
        warnings.warn(
            f"serving engine {client.url} has no {path} endpoint: its tokenizer is not checked against the "
            f"target's (the response token ids are still checked to lie inside the vocabulary)",
            stacklevel=2,
        )
        return
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise EngineError(
            f"serving engine {client.url} model {model!r} tokenizes differently from the target: a probe text "
            f"gives {len(got)} ids there, {len(expected)} here, first different at position {at} "
            f"(server {got[at : at + 4]}, target {expected[at : at + 4]}); serve the target's own model and tokenizer"
        )
