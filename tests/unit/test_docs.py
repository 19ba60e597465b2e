"""The documentation cannot drift from what it documents.

- docs/cli.md is what `python -m tools.gen_cli` generates from `ServerArgs`, and names every flag of
  `radixlm serve -h`;
- every `<!-- bench-table:NAME -->` block in README.md and docs/ is what `python -m bench.report` renders from
  bench/results, and every result file records its machine and command;
- bench/results keeps one result per benchmark and configuration, named by what it measures;
- nothing in the repository dates itself by numbered earlier work periods.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from tools import gen_cli

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def test_cli_reference_is_generated_from_server_args():
    assert (ROOT / "docs" / "cli.md").read_text() == gen_cli.render(), "run: python -m tools.gen_cli"


def test_cli_reference_names_every_flag_of_serve_help():
    out = subprocess.run(
        [sys.executable, "-m", "runtime.entrypoints.cli", "serve", "-h"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "COLUMNS": "400"},  # argparse wraps at hyphens otherwise
    ).stdout
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", out, re.M)) - {"--help"}
    assert len(flags) > 30, out
    page = (ROOT / "docs" / "cli.md").read_text()
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", page))
    assert flags - documented == set(), "flags of `radixlm serve -h` missing from docs/cli.md"
    assert documented - flags == set(), "docs/cli.md names flags that `radixlm serve -h` does not have"


@pytest.mark.parametrize("path", report.doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_tables_match_their_result_files(path):
    text = path.read_text()
    _, changed = report.render(text)
    assert changed == [], f"{path.relative_to(ROOT)}: tables {changed} are stale: run python -m bench.report"


def test_every_bench_table_is_shown_and_the_readme_has_the_headline():
    used = {m.group(2) for p in report.doc_files() for m in report.BLOCK.finditer(p.read_text())}
    assert set(report.TABLES) <= used, f"tables rendered nowhere: {set(report.TABLES) - used}"
    assert "<!-- bench-table:headline -->" in (ROOT / "README.md").read_text()


def test_report_check_fails_on_a_stale_table(tmp_path):
    stale = "<!-- bench-table:serving_dp -->\n| made up |\n<!-- /bench-table -->\n"
    fresh, changed = report.render(stale)
    assert changed == ["serving_dp"] and "cache_aware" in fresh and "bench/results/serving_dp.json" in fresh
    assert report.render(fresh)[1] == []
    with pytest.raises(KeyError, match="unknown bench table"):
        report.render("<!-- bench-table:nope -->\n<!-- /bench-table -->")


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_records_its_machine_and_command(path):
    doc = json.loads(path.read_text())
    env = doc.get("environment") or {}
    assert env.get("cpu_model") and env.get("cpu_cores"), f"{path.name}: no CPU model or core count"
    assert report.command(doc).startswith(("python", "bash")), path.name


def test_every_tabled_result_records_its_cpu_flags(monkeypatch):
    """A table states the machine with its ISA flags (they decide which kernels ran): each result a table
    shows has `environment.cpu_flags`; add them by hand when a bench did not record them."""
    shown: list[str] = []
    real_load = report.load

    def load(name, results_dir=RESULTS):
        shown.append(name)
        return real_load(name, results_dir)

    monkeypatch.setattr(report, "load", load)
    for render in report.TABLES.values():
        render(RESULTS)
    missing = sorted({n for n in shown if "cpu_flags" not in (real_load(n).get("environment") or {})})
    assert shown and missing == [], f"results shown in tables without environment.cpu_flags: {missing}"


RUN_SUFFIX = re.compile(r"_(s\d+[a-z]?|run\d+|rerun|before|after|base|final|old|new|v\d+)(?=[_.]|$)")


def test_result_files_are_named_by_what_they_measure():
    names = sorted(p.name for p in RESULTS.iterdir())
    dated = [n for n in names if RUN_SUFFIX.search(Path(n).stem)]
    assert dated == [], f"result files named by when they ran: {dated}"
    for png in RESULTS.glob("*.png"):
        assert png.with_suffix(".json").exists(), f"{png.name} has no JSON beside it"


# A numbered work period: the word "session" or the letter s followed by a number, alone or as a name's
# suffix; the word "session" after next, previous or earlier. KV sessions (`session_id`) do not match.
WORK_PERIOD = re.compile(
    r"\bsession \d+|_s\d{2}[a-z]?\b|\bs\d{2}[a-z]?\b|\b(?:next|previous|earlier) session\b", re.I
)
TEXT_FILES = (".py", ".md", ".sh", ".toml", ".yml", ".json")


def test_nothing_dates_itself_by_work_period():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    hits = []
    for name in files:
        if name.startswith("bench/data/") or not name.endswith(TEXT_FILES):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORK_PERIOD.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)


def test_result_files_the_docs_name_exist():
    named = {
        m.group(1)
        for p in report.doc_files()
        for m in re.finditer(r"bench/results/([A-Za-z0-9_*]+\.(?:json|png))", p.read_text())
    }
    assert named, "the docs name no result file"
    missing = sorted(n for n in named if not list(RESULTS.glob(n)))
    assert missing == [], f"docs name result files that do not exist: {missing}"
