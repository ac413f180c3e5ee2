"""score's console notes say which samples are not exact walks and what made the responses
(extract --responses-from), and the report's worst-samples table says it per sample."""

from __future__ import annotations

from scoring.report.tables import _exact_cell
from scoring.score.console import notes

OVERALL = {"inexact_samples": 2, "samples": 6, "argmax_mismatches": 4}
ENGINE = {"engine": "llama.cpp", "model": "smol.gguf", "sampling_rule": "llama.cpp samplers [temperature] at 0"}


def test_notes_name_the_engine_and_the_samples_with_mismatches():
    record = {"shards": {"responses": ENGINE, "mismatched_samples": {"q3": 3, "q5": 1}}}
    found = notes(OVERALL, record)
    assert found[0] == "responses from llama.cpp serving 'smol.gguf', teacher-forced through the target"
    assert found[1].endswith("with mismatches in the shards: q3 (3 positions), q5 (1 position)")
    assert "2 of 6 samples are not exact walks" in found[1]


def test_notes_of_results_without_those_facts_are_what_they_were():
    found = notes(OVERALL, {"shards": {}})
    assert len(found) == 1 and found[0].endswith("their walk numbers approximate the online loop")


def test_exact_walk_cells():
    assert _exact_cell({"exact": True, "argmax_mismatches": 0}) == "yes"
    assert _exact_cell({"exact": False, "argmax_mismatches": 3}) == "no: 3 argmax mismatches"
    assert _exact_cell({"exact": False, "argmax_mismatches": 0}) == "no"  # a given response
    assert _exact_cell({}) == "–"
