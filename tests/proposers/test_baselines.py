"""Baselines named like checkpoints (proposers/baselines.py): each name stands for the JSON file of its
engine's settings, parsed like one; a wrong name is one error naming what to write instead."""

from __future__ import annotations

import pytest

from pipeline.common.errors import UserError
from proposers import baselines
from proposers.detect import parse_config

NAMES = {
    "ngram:vllm:k=4": ({"method": "ngram", "num_speculative_tokens": 4}, "ngram_vllm_k=4"),
    "ngram:vllm:k=4,min=2,max=3": (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
        "ngram_vllm_k=4_min=2_max=3",
    ),
    "ngram:vllm:num_speculative_tokens=2": (
        {"method": "ngram", "num_speculative_tokens": 2},
        "ngram_vllm_num_speculative_tokens=2",
    ),
    "ngram:llama.cpp": ({"spec-type": "ngram-simple"}, "ngram_llama.cpp"),
    "ngram:llama.cpp:n=3,m=8": (
        {"spec-type": "ngram-simple", "spec-ngram-simple-size-n": 3, "spec-ngram-simple-size-m": 8},
        "ngram_llama.cpp_n=3_m=8",
    ),
    "ngram:llama.cpp-mod:n=4,min=2,max=8": (
        {"spec-type": "ngram-mod", "spec-ngram-mod-n-match": 4, "spec-ngram-mod-n-min": 2, "spec-ngram-mod-n-max": 8},
        "ngram_llama.cpp-mod_n=4_min=2_max=8",
    ),
    "ngram:llama.cpp-map-k4v:hits=2": (
        {"spec-type": "ngram-map-k4v", "spec-ngram-map-k4v-min-hits": 2},
        "ngram_llama.cpp-map-k4v_hits=2",
    ),
    "suffix:vllm:k=8,depth=16,prob=0.2": (
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 16,
            "suffix_decoding_min_token_prob": 0.2,
        },
        "suffix_vllm_k=8_depth=16_prob=0.2",
    ),
    "draft:/models/small-lm/:n=4": (
        {"spec-type": "draft-simple", "model-draft": "/models/small-lm", "spec-draft-n-max": 4},
        "draft_small-lm_n=4",
    ),
    "draft:/models/a:b": ({"spec-type": "draft-simple", "model-draft": "/models/a:b"}, "draft_a:b"),  # ':' in a path
}


@pytest.mark.parametrize("name", NAMES)
def test_a_name_is_the_json_file_it_stands_for(name):
    raw, directory = NAMES[name]
    assert baselines.is_named(name)
    assert baselines.config_of(name) == raw
    assert baselines.dir_name(name) == directory
    parsed = parse_config(baselines.config_of(name), name).config  # what the engine settings parse to
    assert parsed.family == name.split(":")[0]


def test_a_relative_draft_path_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert baselines.config_of("draft:small:n=2")["model-draft"] == str(tmp_path / "small")


def test_a_path_that_exists_is_never_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ngram:vllm:k=4").mkdir()
    assert not baselines.is_named("ngram:vllm:k=4") and baselines.is_named("ngram:vllm:k=5")
    assert not baselines.is_named("runs/step_100") and not baselines.is_named("model.json")


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "ngram:vlm",
            "no such baseline; named ones: ngram:vllm[:k=N,min=N,max=N], ngram:llama.cpp[:n=N,m=N], ngram:llama",
        ),
        ("ngram:vllm:k", "settings 'k' are not key=value pairs separated by commas: ngram:vllm[:k=N,min=N,max=N]"),
        ("ngram:vllm:k=4,k=5", "'k' is given twice"),
        ("ngram:vllm:k=4,num_speculative_tokens=5", "'num_speculative_tokens' is given twice"),
        ("draft", "name the draft model's directory: draft:PATH[:n=N]"),
        ("draft::n=4", "name the draft model's directory"),
    ],
)
def test_a_wrong_name_is_one_error_saying_what_to_write(name, message):
    assert baselines.is_named(name)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        baselines.config_of(name)
    assert str(error.value).startswith(f"--ckpt {name!r}: ") and "\n" not in str(error.value)
