"""The producers' layer numbering translated into the project's (pipeline/imports/layers.py), on the
27B example of docs/layer-numbering.md: 64 layers, z-lab ids [1, 16, 31, 46, 61]."""

from __future__ import annotations

import pytest

from pipeline.common.errors import UserError
from pipeline.imports.layers import POST, default_layers, describe_held, missing_layers, source_of, sources_of

L = 64


def test_before_layer_ids_are_one_more():
    # speculators' numbering of the same drafter, plus L: the final hidden state before the norm
    assert sources_of([2, 17, 32, 47, 62, 64], "before", L, "x") == [1, 16, 31, 46, 61, 64]


def test_output_of_layer_ids_are_the_projects_and_the_last_layer_is_before_the_norm():
    assert sources_of([1, 16, 31, 46, 61], "output", L, "x") == [1, 16, 31, 46, 61]
    assert source_of(L - 1, "output", L, "x") == L  # the last layer's raw output: id L, not L - 1 (after the norm)


@pytest.mark.parametrize("stated, convention", [(0, "before"), (65, "before"), (64, "output"), (-1, "output")])
def test_ids_without_an_equivalent_are_refused(stated, convention):
    with pytest.raises(UserError, match=f"captured layer id {stated}"):
        source_of(stated, convention, L, "cap/hs_0.safetensors")


def test_id_l_minus_1_is_served_after_the_norm_on_tying_targets():
    held = {1, 16, L}  # e.g. vLLM [2, 17, 64]
    assert missing_layers([1, 16, L - 1, L], held, L, ties_norm=True) == []  # L - 1 = norm(the final state)
    assert missing_layers([1, 16, L - 1, L], {1, 16, POST}, L, ties_norm=True) == [L]  # the norm is not inverted
    assert missing_layers([L - 1], {1, POST}, L, ties_norm=False) == [L - 1]  # there L - 1 is the raw output
    assert missing_layers([2], held, L, ties_norm=True) == [2]


def test_default_is_every_captured_decoder_layer():
    assert default_layers({16, 1, L, POST}, L) == [1, 16]
    assert describe_held({16, 1, L}, L) == "layers 1, 16 and the final hidden state before the norm (id 64)"
