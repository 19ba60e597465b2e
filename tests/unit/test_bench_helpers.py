"""Bench helpers that decide reported figures: statistics, tables, result files, answer parsing and scoring,
dataset builders, arrival processes and serving metrics. Pure Python: no model is loaded."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import agent_catalogue, agent_loop, gsm8k, json_decode, mmlu, multi_turn_chat, serving
from bench.harness import common, datasets
from bench.run_all import HEADLINES, headline_row


# ------------------------------------------------------------------------------------------ common
def test_percentile_interpolates_and_summary_handles_empty():
    assert common.percentile([1, 2, 3, 4], 50) == 2.5
    assert common.percentile([10], 99) == 10
    assert common.percentile([4, 1, 3, 2], 100) == 4  # order does not matter
    assert common.percentile([0, 10], 99) == pytest.approx(9.9)
    s = common.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["mean"] == 22.0 and s["p50"] == 3.0 and s["n"] == 5 and s["max"] == 100.0
    empty = common.summarize([])
    assert empty["n"] == 0 and math.isnan(empty["mean"]) and math.isnan(empty["p99"])


def test_ratio_is_none_when_undefined():
    assert common.ratio(6.0, 2.0) == 3.0
    assert common.ratio(1.0, 0.0) is None
    assert common.ratio(None, 2.0) is None
    assert common.ratio(1.0, float("nan")) is None


def test_format_table_aligns_columns_and_formats_numbers():
    text = common.format_table(
        [{"side": "radixlm", "x": 12345.6, "acc": 0.25, "ok": True}, {"side": "hf", "x": 1.5, "acc": None}],
        title="T",
    )
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1].split() == ["side", "x", "acc", "ok"]
    assert "12,346" in lines[3] and "0.25" in lines[3] and "yes" in lines[3]
    assert lines[4].split() == ["hf", "1.50", "-", "-"]
    assert len({len(line) for line in lines[1:4]}) == 1  # header, rule and full rows have equal width


def test_write_results_records_config_environment_and_load(tmp_path):
    path = common.write_results(
        "unit", {"command": "x"}, {"value": 1.5}, env={"cpu_model": "test"}, results_dir=tmp_path
    )
    doc = json.loads(path.read_text())
    assert path == tmp_path / "unit.json"
    assert doc["config"] == {"command": "x"} and doc["results"] == {"value": 1.5}
    assert doc["environment"]["cpu_model"] == "test"
    assert set(doc["environment"]["load_after"]) == {"load_1m", "load_5m", "load_15m", "quiet"}


def test_result_files_record_the_python_m_command(tmp_path):
    """Benchmarks run as `python -m bench.<name>`; the recorded command says so (no absolute file path)."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "bench.run_all", "--summary-only", "--results-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run(cmd, cwd=repo, env=env, check=True, timeout=300, capture_output=True)
    doc = json.loads((tmp_path / "run_all.json").read_text())
    want = f"{Path(sys.executable).name} -m bench.run_all --summary-only --results-dir {tmp_path}"
    assert doc["config"]["command"] == want


def test_charts_write_png(tmp_path):
    bar = common.bar_chart(tmp_path / "b.png", ["a", "b"], {"s1": [1.0, None], "s2": [2.0, 3.0]}, "y", "t")
    line = common.line_chart(
        tmp_path / "l.png",
        {"s": ([1, 8, 32], [1.0, 5.0, 9.0])},
        "x",
        "y",
        "t",
        logx=True,
        hlines={"limit": 10.0},
    )
    for p in (bar, line):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_environment_names_cpu_cores_and_git():
    env = common.environment()
    assert env["cpu_cores"] >= 1 and env["cpu_model"] and env["torch"]
    assert "commit" in env["git"] and "dirty" in env["git"]


# ------------------------------------------------------------------------------------------ gsm8k
@pytest.mark.parametrize(
    "text, want",
    [
        ("so the answer is 1,234.50.", 1234.5),
        ("She has 3 apples and 18 pears. The answer is 18", 18.0),
        ("The answer is -7.", -7.0),
        ("no digits here", None),
    ],
)
def test_gsm8k_parse_number_takes_the_last_number(text, want):
    assert gsm8k.parse_number(text) == want


def test_gsm8k_reference_and_few_shot_cleaning():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"
    assert gsm8k.reference_answer(answer) == 72.0
    cleaned = gsm8k.clean_solution(answer)
    assert "<<" not in cleaned and cleaned.endswith("The answer is 72.")
    with pytest.raises(ValueError):
        gsm8k.reference_answer("no marker")


class _State(dict):
    """Stand-in for a ProgramState: variables by name."""


def test_gsm8k_score_compares_final_numbers():
    assert gsm8k.score(72.0, _State(answer=" 48 + 24 = 72. The answer is 72.")) == 1.0
    assert gsm8k.score(72.0, _State(answer=" The answer is 71")) == 0.0
    assert gsm8k.score(72.0, _State(answer=" I do not know")) == 0.0


# ------------------------------------------------------------------------------------------ mmlu
def test_mmlu_prompt_format_and_scoring():
    row = ["What is 2+2?", "3", "4", "5", "6", "B"]
    assert mmlu.format_question(row, False) == "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    assert mmlu.format_question(row, True).endswith("Answer: B\n\n")
    prefix = mmlu.few_shot_prefix("high_school_physics", [row] * 3, 2)
    assert prefix.startswith(
        "The following are multiple choice questions (with answers) about high school physics."
    )
    assert prefix.count("Answer: B") == 2
    assert mmlu.score("B", _State(answer=" B")) == 1.0 and mmlu.score("B", _State(answer=" C")) == 0.0


def test_mmlu_items_share_one_prefix_per_subject():
    items, labels = mmlu.build_items(datasets.DATA_DIR, ["global_facts", "machine_learning"], 5, 5, seed=0)
    assert len(items) == len(labels) == 10
    assert set(labels) <= set("ABCD")
    assert len({it["prefix"] for it in items}) == 2  # the shared few-shot prefix: one per subject
    assert all(it["question"].endswith("\nAnswer:") for it in items)
    again, _ = mmlu.build_items(datasets.DATA_DIR, ["global_facts", "machine_learning"], 5, 5, seed=0)
    assert again == items  # seeded order


def test_repository_data_sets_load_with_their_documented_sizes():
    """bench/data holds every data set (sizes as in bench/data/README.md); nothing is read from elsewhere."""
    repo = Path(__file__).resolve().parents[2]
    assert datasets.DATA_DIR == repo / "bench" / "data" and common.RESULTS_DIR == repo / "bench" / "results"
    test_rows = {"clinical_knowledge": 265, "global_facts": 100, "high_school_physics": 154}
    test_rows |= {"machine_learning": 105, "nutrition": 306}
    for subject in datasets.MMLU_SUBJECTS:
        assert len(datasets.mmlu_rows(subject, "dev")) == 5
        assert len(datasets.mmlu_rows(subject, "test")) == test_rows[subject]
    assert len(datasets.gsm8k_rows("test")) == 1319 and len(datasets.gsm8k_rows("train_head200")) == 200
    assert all("####" in r["answer"] for r in datasets.gsm8k_rows("train_head200"))
    sizes = {"Github_trivial": 444, "Github_easy": 1943, "Glaiveai2K": 1707}
    for subset in datasets.JSONSCHEMABENCH_SUBSETS:
        rows = datasets.load_subset(subset)
        assert len(rows) == sizes[subset] and all(isinstance(r["schema"], (dict, bool)) for r in rows)


def test_data_set_loaders_name_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nutrition"):
        datasets.mmlu_rows("nutrition", "test", data_dir=tmp_path)
    with pytest.raises(ValueError, match="split"):
        datasets.mmlu_rows("nutrition", "validation")
    with pytest.raises(ValueError, match="train"):
        datasets.gsm8k_rows("train")
    with pytest.raises(FileNotFoundError, match="Github_hard"):
        datasets.load_subset("Github_hard")


def test_mmlu_cloze_items_score_answer_texts():
    item, label = mmlu.cloze_item(["What is 2+2?", "3", " 4 ", "5", "6", "B"])
    assert item == {
        "prefix": "",
        "question": "Question: What is 2+2?\nAnswer:",
        "choices": [" 3", " 4", " 5", " 6"],
    }
    assert label == "4"
    assert mmlu.score(label, _State(answer=" 4")) == 1.0 and mmlu.score(label, _State(answer=" 5")) == 0.0
    with pytest.raises(ValueError, match="format"):
        mmlu.build_items(datasets.DATA_DIR, ["global_facts"], 1, 0, seed=0, fmt="essay")


# ------------------------------------------------------------------------------------------ json_decode
def test_json_field_accuracy_and_validity():
    rec = json_decode.city_record(random.Random(0))
    assert set(rec) == set(json_decode.CITY_SCHEMA["required"])
    assert json_decode.field_accuracy(rec, json.dumps(rec)) == 1.0
    wrong = dict(rec, population_count=rec["population_count"] + 1, city_name=rec["city_name"].upper())
    assert json_decode.field_accuracy(rec, json.dumps(wrong)) == pytest.approx(6 / 7)  # case-blind strings
    assert json_decode.field_accuracy(rec, '{"city_name": "x"') == 0.0  # truncated JSON
    assert json_decode.schema_valid(json_decode.CITY_SCHEMA, json.dumps(rec)) == 1.0
    assert json_decode.schema_valid(json_decode.CITY_SCHEMA, json.dumps(dict(rec, extra=1))) == 0.0
    text = json_decode.describe(rec)
    assert rec["city_name"] in text and str(rec["population_count"]) in text


def test_json_extraction_items_are_seeded():
    a, la = json_decode.extraction_items(3, seed=5)
    b, lb = json_decode.extraction_items(3, seed=5)
    assert a == b and la == lb and len({it["instruction"] for it in a}) == 3


# ------------------------------------------------------------------------------------------ multi-turn
def test_multi_turn_conversations_are_seeded_with_four_turns():
    convs = multi_turn_chat.conversations(3, 20, seed=1)
    assert convs == multi_turn_chat.conversations(3, 20, seed=1)
    assert all(len(c["turns"]) == multi_turn_chat.NUM_TURNS for c in convs)
    assert all(len(t.split()) == 20 for c in convs for t in c["turns"])


# ------------------------------------------------------------------------------------------ serving
def test_poisson_arrival_gaps():
    gaps = serving.arrival_gaps(4000, 8.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.08)
    assert serving.arrival_gaps(5, float("inf"), seed=0) == [0.0] * 5


def test_serving_metrics_from_outcomes():
    a = serving.Outcome(ok=True, prompt_len=10, output_tokens=5, ttft=0.5, e2e=1.3, itls=[0.2] * 4)
    b = serving.Outcome(ok=True, prompt_len=20, output_tokens=1, ttft=0.1, e2e=0.1)
    c = serving.Outcome(ok=False, error="HTTP 503")
    m = serving.metrics([a, b, c], wall=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["first_error"] == "HTTP 503"
    assert m["request_throughput"] == 1.0
    assert m["input_token_throughput"] == 15.0 and m["output_token_throughput"] == 3.0
    assert m["tpot_ms"]["n"] == 1 and m["tpot_ms"]["mean"] == pytest.approx(200.0)  # (1.3 - 0.5) / 4
    assert m["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert m["itl_ms"]["n"] == 4


class _FakeTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return 50000

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text):
        return text.split()


def test_shared_prefix_dataset_groups_share_system_prompts():
    reqs = serving.shared_prefix_dataset(
        _FakeTokenizer(), groups=3, per_group=4, system_len=50, question_len=5, output_len=7, seed=0
    )
    assert len(reqs) == 12 and all(r.output_len == 7 for r in reqs)
    systems = {r.prompt.split("\n\nQuestion: ")[0] for r in reqs}
    assert len(systems) == 3
    assert len({r.prompt for r in reqs}) == 12
    rnd = serving.random_dataset(_FakeTokenizer(), 20, 100, 10, 0.5, seed=0)
    assert all(50 <= r.prompt_len <= 100 and 5 <= r.output_len <= 10 for r in rnd)


# ------------------------------------------------------------------------------------------ run_all
def test_headline_ratio_and_target():
    doc = {
        "results": {
            "sides": {
                "radixlm": {"programs_per_s": 6.0, "accuracy": 0.3},
                "hf": {"programs_per_s": 1.0, "accuracy": 0.3},
            }
        }
    }
    prog = next(h for h in HEADLINES if h.bench == "mmlu" and h.metric == "programs/s")
    acc = next(h for h in HEADLINES if h.bench == "mmlu" and h.metric == "accuracy")
    row = headline_row(prog, doc)
    assert row["ratio"] == 6.0 and row["met"] is True
    assert headline_row(acc, doc)["met"] is True  # identical accuracy
    assert headline_row(prog, None)["ratio"] is None
    dec = next(h for h in HEADLINES if h.bench == "decode_throughput")
    ddoc = {
        "results": {
            "by_dtype": {
                "float32": {
                    "batch_sizes": {
                        "1": {"radixlm": {"decode_tok_s": 5.0}, "hf": {"decode_tok_s": 5.0}},
                        "8": {"radixlm": {"decode_tok_s": 30.0}, "hf": {"decode_tok_s": 25.0}},
                    }
                }
            }
        }
    }
    r = headline_row(dec, ddoc)  # no batch 32 measured: the largest one is reported
    assert r["ratio"] == pytest.approx(1.2) and r["met"] is False


# ------------------------------------------------------------------------------------------ agent_loop
def _step(calls=(), content=None, prompt=100, cached=0, finish="tool_calls") -> agent_loop.Step:
    return agent_loop.Step(list(calls), content, finish, prompt, 5, cached, 0.1)


def test_agent_catalogue_tools_are_valid_and_fake_tools_deterministic():
    from runtime.entrypoints.tool_calls.schema import parse_tools

    assert 15 <= len(parse_tools(agent_catalogue.TOOLS)) <= 25  # every schema passes the server's checks
    args = '{"city": "Oslo", "unit": "celsius"}'
    first = json.loads(agent_catalogue.run_tool("get_weather", args))
    assert first == json.loads(agent_catalogue.run_tool("get_weather", args)) and first["city"] == "Oslo"
    assert first != json.loads(agent_catalogue.run_tool("get_weather", '{"city": "Lima", "unit": "celsius"}'))
    assert json.loads(agent_catalogue.run_tool("calculator", '{"expression": "(12 + 30) * 7 / 2"}')) == {
        "expression": "(12 + 30) * 7 / 2",
        "value": 147.0,
    }
    for name, arguments, needle in [
        ("calculator", '{"expression": "__import__(1)"}', "unsupported"),
        ("calculator", '{"expression": "1/0"}', "ZeroDivisionError"),
        ("nope", "{}", "unknown tool"),
        ("get_weather", '{"city": "Oslo"', "not valid JSON"),
        ("get_weather", "[1]", "JSON object"),
        ("get_weather", '{"unit": "celsius"}', "missing required arguments ['city']"),
        ("get_forecast", '{"city": "Oslo", "days": "x"}', "bad arguments"),
    ]:
        assert needle in json.loads(agent_catalogue.run_tool(name, arguments))["error"], (name, arguments)
    assert agent_catalogue.tasks(3, seed=4) == agent_catalogue.tasks(3, seed=4)
    assert len(set(agent_catalogue.tasks(8, seed=4))) > 1


def test_agent_loop_appends_calls_tool_results_and_text_nudges():
    seen = []

    def step_fn(messages):
        seen.append(list(messages))
        if len(seen) == 2:
            return _step(content="I think it is sunny.", finish="stop")
        return _step([("c1", "get_weather", '{"city": "Oslo", "unit": "celsius"}')])

    trace = agent_loop.run_agent(step_fn, "Weather in Oslo?", 3)
    assert len(trace.steps) == 3 and trace.error is None
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert [m["role"] for m in seen[1]][2:] == ["assistant", "tool"]
    assert seen[1][2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "unit": "celsius"}'
    assert seen[1][3] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": agent_catalogue.run_tool("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
    }
    assert seen[2][:4] == seen[1] and seen[2][4:] == [
        {"role": "assistant", "content": "I think it is sunny."},
        {"role": "user", "content": agent_loop.CONTINUE},
    ]

    def failing(messages):
        raise RuntimeError("HTTP 500: boom")

    bad = agent_loop.run_agent(failing, "x", 2)
    assert bad.steps == [] and "boom" in bad.error


def test_agent_loop_cut_calls_get_empty_history_arguments():
    assert agent_loop.history_arguments('{"a": 1}') == '{"a": 1}'
    assert agent_loop.history_arguments('{"a": ') == "{}"  # cut by max_tokens
    assert agent_loop.history_arguments("[1, 2]") == "{}"
    msgs = agent_loop.next_messages(_step([("c1", "calculator", '{"expression": "1+')]))
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert "not valid JSON" in msgs[1]["content"]


def test_agent_loop_figures_hit_rates_validity_and_agreement():
    weather = ("c", "get_weather", '{"city": "Oslo", "unit": "celsius"}')
    invalid = ("c", "get_weather", '{"city": "Oslo", "unit": "kelvin"}')
    a = agent_loop.Trace(
        [_step([weather], prompt=1000, cached=0), _step([invalid], prompt=1100, cached=1000)]
    )
    b = agent_loop.Trace([_step([weather], prompt=1000, cached=900), _step(content="hi", finish="stop")])
    f = agent_loop.figures([a, b], wall=2.0)
    assert f["steps"] == 4 and f["steps_per_s"] == 2.0 and f["errors"] == 0
    assert f["prompt_tokens"] == 3200 and f["cached_tokens"] == 1900
    assert f["cache_hit_rate"] == pytest.approx(1900 / 3200)
    assert f["cache_hit_rate_first_step"] == pytest.approx(900 / 2000)
    assert f["cache_hit_rate_later_steps"] == pytest.approx(1000 / 1200)
    assert f["tool_calls"] == 3 and f["valid_calls"] == 2 and f["text_replies"] == 1
    assert f["finish_reasons"] == {"tool_calls": 3, "stop": 1}
    assert agent_loop.figures([agent_loop.Trace(error="x")], 1.0)["steps_per_s"] is None
    # agreement compares whole trajectories (calls and text), never errored agents
    same = agent_loop.Trace([_step([weather], prompt=1), _step([invalid], prompt=2)])
    assert agent_loop.agreement([a, b], [same, b]) == 1.0
    assert agent_loop.agreement([a, b], [b, b]) == 0.5
    assert agent_loop.agreement([a], [agent_loop.Trace(same.steps, error="x")]) == 0.0
    assert not agent_loop.valid_call("nope", "{}") and not agent_loop.valid_call("calculator", "{")


def test_agent_loop_server_flags():
    kw = {"dtype": "float32", "disable_radix_cache": True, "num_threads": None, "max_total_tokens": 30000}
    flags = agent_loop.server_flags({**kw, "ignore_eos": False})
    assert flags == ["--dtype", "float32", "--disable-radix-cache", "--max-total-tokens", "30000"]


def test_agent_loop_headline_reads_steps_per_s():
    doc = {"results": {"sides": {"radixlm": {"steps_per_s": 0.3}, "radixlm-noradix": {"steps_per_s": 0.1}}}}
    h = next(h for h in HEADLINES if h.bench == "agent_loop" and h.reference == "radixlm-noradix")
    row = headline_row(h, doc)
    assert row["ours"] == 0.3 and row["ratio"] == pytest.approx(3.0)


def test_decode_rate_of_repeats_is_the_median_sample_not_an_outlier():
    from bench.decode_throughput import median_run

    # a stalled 1-token request makes the difference of the two timings tiny: 922 tok/s beside 97 and 107
    samples = [
        {"decode_tok_s": 97.0, "t1_s": 0.4},
        {"decode_tok_s": 922.0, "t1_s": 1.18},
        {"decode_tok_s": 107.0},
    ]
    run = median_run(samples)
    assert run["decode_tok_s"] == 107.0 and run["decode_tok_s_samples"] == [97.0, 922.0, 107.0]
    assert median_run(samples[:2])["decode_tok_s"] == 97.0  # an even count takes the lower middle
    assert median_run([{"decode_tok_s": None}])["decode_tok_s"] is None


def test_scheduler_overhead_runs_and_compares_queue_depths(tmp_path, default_model_dir):
    """The no-model scheduler bench (its runner stand-in must satisfy the Scheduler), both parts."""
    from bench import scheduler_overhead

    argv = ["--requests", "8", "--workloads", "distinct", "--queue-depths", "2,20", "--max-running", "4",
            "--max-total-tokens", "4096", "--results-dir", str(tmp_path), "--name", "so"]  # fmt: skip
    assert scheduler_overhead.main(argv) == 0
    out = json.loads((tmp_path / "so.json").read_text())
    depths = out["results"]["queue_depth"]
    assert [d["waiting"] for d in depths] == [2, 20] and all(d["running"] == 4 for d in depths)
