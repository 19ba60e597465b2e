"""Helpers that decide the figures of bench/json_schema_coverage.py (and its --mask-overhead mode): sampling,
output classification (truncated is never invalid), per-subset summaries. Pure Python: no model is loaded."""

from __future__ import annotations

import json
import math

import pytest

from bench import json_mask_overhead as mask
from bench import json_schema_coverage as cov
from bench.harness import datasets

STOP = {"type": "stop", "matched": None}
LENGTH = {"type": "length", "length": 64}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "uniqueItems": True}},
    "required": ["name"],
}


def test_sample_rows_is_seeded_distinct_and_bounded():
    rows = [{"id": str(i)} for i in range(50)]
    a, b = datasets.sample_rows(rows, 10, seed=3), datasets.sample_rows(rows, 10, seed=3)
    assert a == b and len({r["id"] for r in a}) == 10
    assert datasets.sample_rows(rows, 10, seed=4) != a
    assert sorted(r["id"] for r in datasets.sample_rows(rows, 500, seed=0)) == sorted(r["id"] for r in rows)
    assert datasets.sample_rows(rows, 0, seed=0) == []


def test_load_subset_reads_jsonl(tmp_path):
    folder = tmp_path / "jsonschemabench"
    folder.mkdir()
    (folder / "Tiny.jsonl").write_text(
        '{"id": "a", "schema": {"type": "integer"}}\n\n{"id": "b", "schema": {}}\n'
    )
    rows = datasets.load_subset("Tiny", data_dir=tmp_path)
    assert [r["id"] for r in rows] == ["a", "b"] and rows[0]["schema"] == {"type": "integer"}


@pytest.mark.parametrize(
    "text, finish, want",
    [
        ('{"name": "Bo"}', STOP, ("valid", None)),
        ('{"tags": []}', STOP, ("invalid", "required")),
        ('{"name": "Bo", "tags": [1, 1]}', STOP, ("invalid", "uniqueItems")),
        ('{"name": "Bo"', STOP, ("invalid", "not JSON")),
        ('{"name": "Bo"', LENGTH, ("truncated", None)),  # cut by max_new_tokens: not counted as invalid
        ('{"tags": []}', LENGTH, ("truncated", None)),
        (
            "",
            {"type": "abort", "message": "grammar allows no further token"},
            ("error", "grammar allows no further token"),
        ),
        ("", None, ("error", "None")),
    ],
)
def test_classify_output(text, finish, want):
    assert cov.classify_output(PERSON, text, finish) == want


def test_classify_output_uses_the_schema_draft_and_reports_unusable_schemas():
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "integer",
        "maximum": 5,
        "exclusiveMaximum": True,
    }  # a boolean exclusive: draft 4 only
    assert cov.classify_output(draft4, "5", STOP) == ("invalid", "maximum")
    assert cov.classify_output(draft4, "4", STOP) == ("valid", None)
    kind, detail = cov.classify_output({"$ref": "#/definitions/missing"}, "1", STOP)
    assert kind == "unchecked" and detail


def _rec(subset, compile_outcome, compile_s=None, output=None, detail=None, tokens=0):
    rec = {
        "subset": subset,
        "id": "x",
        "compile": compile_outcome,
        "compile_s": compile_s,
        "validate_s": 0.001,
    }
    if output:
        rec.update(output=output, output_detail=detail, completion_tokens=tokens)
    return rec


def test_summarize_records_shares_and_percentiles():
    records = [
        _rec("s", "ok", 0.1, "valid", tokens=10),
        _rec("s", "ok", 0.2, "valid", tokens=20),
        _rec("s", "ok", 0.3, "invalid", "uniqueItems", tokens=30),
        _rec("s", "ok", 0.4, "truncated", tokens=64),
        _rec("s", "rejected"),
        _rec("s", "timeout", 120.0),
    ]
    s = cov.summarize_records(records)
    assert s["schemas"] == 6 and s["compiled"] == 4 and s["compiled_share"] == pytest.approx(4 / 6)
    assert s["compile_outcomes"] == {"ok": 4, "rejected": 1, "timeout": 1}
    # compile times are over compiled schemas only: the timeout's 120 s is not a compile time
    assert s["compile_ms"]["p50"] == pytest.approx(250.0) and s["compile_ms"]["max"] == pytest.approx(400.0)
    assert s["compile_ms"]["p95"] == pytest.approx(385.0)
    assert s["outputs"] == 4
    assert s["valid_share"] == 0.5 and s["invalid_share"] == 0.25 and s["truncated_share"] == 0.25
    assert s["error_share"] == 0.0 and s["valid_of_all_schemas"] == pytest.approx(2 / 6)
    assert s["invalid_keywords"] == {"uniqueItems": 1}
    assert s["completion_tokens_mean"] == 31.0
    row = cov.table_row("s", s)
    assert row["compiles %"] == pytest.approx(400 / 6) and row["truncated %"] == 25.0 and row["timeouts"] == 1


def test_summarize_records_without_outputs_or_compiles():
    s = cov.summarize_records([_rec("s", "rejected"), _rec("s", "error")])
    assert s["compiled_share"] == 0.0 and s["outputs"] == 0 and s["valid_share"] is None
    assert math.isnan(s["compile_ms"]["p50"]) and s["completion_tokens_mean"] is None
    json.dumps(cov.table_row("s", s))  # a result file can hold it
    assert cov.summarize_records([])["compiled_share"] is None


def test_mask_overhead_per_token_uses_full_batch_steps():
    steps = [(4, 0.4), (4, 0.8), (4, 0.6), (2, 0.1)]  # (batch size, seconds)
    got = mask.per_token_us(steps, 4)
    assert (
        got["steps"] == 3
        and got["p50"] == pytest.approx(150_000.0)
        and got["mean"] == pytest.approx(150_000.0)
    )
    # no full step: scaled to the batch size so the figure stays per token
    assert mask.per_token_us([(2, 0.1)], 4)["p50"] == pytest.approx(50_000.0)


def test_reason_key_groups_rejections_by_construct():
    a = cov.reason_key("`not` can only be enforced around `type` or `required` alone (got ['minimum'])")
    b = cov.reason_key("`not` can only be enforced around `type` or `required` alone (got ['enum', 'x'])")
    assert a == b and "`not` can only be enforced" in a
    t1 = cov.reason_key("compiling it took longer than the limit of 30 s (--grammar-timeout-s)")
    assert t1 == cov.reason_key("compiling it took longer than the limit of 120 s (--grammar-timeout-s)")
    assert cov.reason_key('structure {"typeof": "f"}') != cov.reason_key("`not: {}` accepts no value")


def test_compile_only_flag_and_rejections_in_the_summary():
    assert cov.parse_args(["--compile-only"]).compile_only and not cov.parse_args([]).compile_only
    records = [
        {"compile": "ok", "compile_s": 0.1},
        {"compile": "rejected", "compile_s": None, "reason": "`not: {}` accepts no value"},
        {"compile": "timeout", "compile_s": None, "reason": "took longer than the limit of 120 s"},
        {"compile": "timeout", "compile_s": None, "reason": "took longer than the limit of 30 s"},
    ]
    summary = cov.summarize_records(records)
    assert summary["rejection_reasons"] == {
        "took longer than the limit of N s": 2,
        "`not: [_]` accepts no value": 1,
    }
    assert summary["outputs"] == 0 and summary["compiled_share"] == 0.25


def test_summarize_records_mask_times_and_walks():
    records = [
        {**_rec("s", "ok", 0.1), "mask_us": [10.0, 20.0, 30.0], "walk": "valid"},
        {**_rec("s", "ok", 0.1), "mask_us": [40.0] * 97, "walk": "invalid", "walk_detail": "maxLength"},
        {**_rec("s", "ok", 0.1), "mask_us": [5000.0], "mask_cpu_us": [60.0], "walk": "unfinished"},
        _rec("s", "rejected"),
    ]
    s = cov.summarize_records(records)
    assert s["mask_cpu_us"]["max"] == 60.0  # a fill that waited for a core: its CPU time is its own work
    assert s["mask_us"]["tokens"] == 101 and s["mask_us"]["p50"] == 40.0 and s["mask_us"]["max"] == 5000.0
    assert s["mask_us"]["p99"] == pytest.approx(40.0)  # 1 slow token of 101 sits past the 99th percentile
    assert s["walks"] == {"valid": 1, "invalid": 1, "unfinished": 1} and s["walk_valid_share"] == 0.5
    assert s["walk_invalid_keywords"] == {"maxLength": 1}
    row = cov.table_row("s", s)
    assert row["mask p50 us"] == 40.0 and row["walk valid %"] == 50.0 and row["mask p99 cpu us"] == 60.0
    empty = cov.summarize_records([_rec("s", "rejected")])
    assert empty["walk_valid_share"] is None and math.isnan(empty["mask_us"]["p99"])
    assert math.isnan(empty["mask_cpu_us"]["p99"])


def _overall(share, p99, invalid=0, walk_invalid=0):
    s = cov.summarize_records([])
    s.update(compiled_share=share, mask_us={"p99": p99})
    s["output_counts"]["invalid"] = invalid
    s["walks"] = {"invalid": walk_invalid} if walk_invalid else {}
    return s


def test_auto_choice_ranks_by_targets_then_coverage_then_mask_time():
    from bench.grammar_walk import auto_choice

    got = auto_choice(
        {"slow": _overall(1.0, 5000.0), "fast": _overall(0.995, 300.0), "bad": _overall(1.0, 100, 1)}
    )
    assert got["choice"] == "fast" and got["order"] == ["fast", "slow", "bad"]
    assert got["targets_met"]["slow"] == {"compiled_share": True, "mask_p99": False, "all_valid": True}
    assert not got["targets_met"]["bad"]["all_valid"]
    # an invalid random walk counts like an invalid output; equal targets: the higher compile share wins
    got = auto_choice(
        {"a": _overall(0.9, 50.0), "b": _overall(0.95, 900.0), "c": _overall(1.0, 10, walk_invalid=2)}
    )
    assert got["order"] == ["b", "a", "c"]
    assert auto_choice({"x": _overall(1.0, math.nan)})["targets_met"]["x"]["mask_p99"] is False


def test_backends_flag_defaults_to_auto_and_every_backend():
    assert cov.parse_args([]).backends == "auto,outlines,llguidance,xgrammar"
    assert cov.parse_args(["--backends", "xgrammar", "--walk-steps", "8"]).walk_steps == 8


def test_classify_output_checks_multiple_of_as_decimals():
    """0.07 is a multiple of 0.01 although 0.07 / 0.01 is not an integer in floats; 0.075 is not one."""
    schema = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.01}}}
    assert cov.classify_output(schema, '{"p": 0.07}', {"type": "stop"}) == ("valid", None)
    assert cov.classify_output(schema, '{"p": 0.075}', {"type": "stop"}) == ("invalid", "multipleOf")
