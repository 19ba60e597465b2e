"""SGLang wire compatibility end to end: SGLang's own frontend (`sgl.RuntimeEndpoint`) runs its test programs
against the shared real server, and the native /generate takes SGLang's `stop_regex` and sampling parameters.

The frontend is the `sglang` package from PyPI installed with --no-deps (plus the few modules its frontend
imports) into the private cache dir, keyed by version, once; without network the frontend test is skipped
with pip's reason. Its programs are written for 8B models: on the 135M default model their answers may be
wrong, which is reported in a table, not asserted; what is asserted is that radixlm never answers the frontend
with an error (no "protocol" outcome) and that nothing else breaks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from runtime.cache_dir import cache_subdir
from tests.e2e.server_utils import HTTP_TIMEOUT_S, ROOT

SGLANG_VERSION = "0.5.23"
# what `sglang/__init__` and its frontend import beyond radixlm's own dependencies
FRONTEND_EXTRAS = ["pybase64==1.5.1", "ipython==9.18.1", "traitlets==5.16.1"]
PROGRAMS_TIMEOUT_S = float(os.environ.get("RADIXLM_SGLANG_PROGRAMS_TIMEOUT", "3000"))
PROMPT = "The capital of France is"
PROGRAM_SHARDS = 3

pytestmark = pytest.mark.slow


def generate(url: str, body: dict, status: int = 200) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == status, r.text
    return r.json()


# ---- the frontend's own programs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sglang_frontend() -> Path:
    """The folder holding the `sglang` frontend (for PYTHONPATH), installed on first use: into a scratch
    folder first, renamed into place only once every package is in (a broken install is never reused)."""
    target = cache_subdir("sglang-frontend") / SGLANG_VERSION
    if (target / ".installed").exists():
        return target
    scratch = target.with_name(f"{SGLANG_VERSION}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    specs = [f"sglang=={SGLANG_VERSION}", *FRONTEND_EXTRAS]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(scratch), *specs]
    try:
        r = subprocess.run(pip, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        shutil.rmtree(scratch, ignore_errors=True)
        pytest.skip(f"installing {' '.join(specs)} took more than 900 s (no network?)")
    if r.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"cannot install {' '.join(specs)} (no network, or no such version?): {last}")
    (scratch / ".installed").write_text(" ".join(specs))
    shutil.rmtree(target, ignore_errors=True)
    scratch.rename(target)
    return target


@pytest.mark.timeout(PROGRAMS_TIMEOUT_S + 600)  # the shared server's startup, then ~20 programs on 135M
def test_sglang_frontend_programs_run_without_protocol_errors(sglang_frontend, server_url):
    info = requests.get(server_url + "/get_model_info", timeout=HTTP_TIMEOUT_S).json()
    env = {**os.environ, "PYTHONPATH": f"{sglang_frontend}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    script = Path(__file__).with_name("sglang_frontend_programs.py")
    # The programs run in PROGRAM_SHARDS processes side by side: the server batches their requests (decoding
    # a 135M model is memory-bound: a batch of two costs about what one request does).
    shards = [
        subprocess.Popen(
            [sys.executable, str(script), server_url, info["tokenizer_path"], str(i), str(PROGRAM_SHARDS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(PROGRAM_SHARDS)
    ]
    stdout = stderr = ""
    deadline = time.monotonic() + PROGRAMS_TIMEOUT_S
    try:
        for proc in shards:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += "\ntimed out"
            stdout, stderr = stdout + out, stderr + err
    finally:  # interrupted (pytest-timeout, ^C): no program process outlives the test
        for proc in shards:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    print(f"\nSGLang {SGLANG_VERSION} frontend programs against radixlm ({info['model_path']}):")
    for row in rows:
        print(f"  {row['name']:34s} {row['outcome']:9s} {row['seconds']:7.1f}s  {row['detail'][:120]!r}")
        for err in row["http_errors"]:
            print(f"      HTTP {err}")
    assert sum(row["outcome"] != "excluded" for row in rows) >= 14, (
        f"the programs did not all run:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    )
    bad = [row for row in rows if row["outcome"] in ("protocol", "error")]
    assert not bad, "\n".join(f"{b['name']}: {b['outcome']} {b['http_errors']} {b['detail']}" for b in bad)


# ---- stop_regex over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full(server_url) -> str:
    out = generate(server_url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert len(out["text"].split()) >= 3, out
    return out["text"]


def _pattern_for(text: str) -> tuple[str, re.Match]:
    """A stop regex that first matches the text's second word: its first character, then any non-spaces."""
    word = text.split()[1]
    pattern = re.escape(word[0]) + f"[^ ]{{{len(word) - 1}}}"
    return pattern, re.search(pattern, text)


def test_stop_regex_stops_and_trims(server_url, full):
    pattern, m = _pattern_for(full)
    params = {"max_new_tokens": 12, "temperature": 0, "stop_regex": [pattern, "zzzz+q"]}
    out = generate(server_url, {"text": PROMPT, "sampling_params": params})
    assert out["text"] == full[: m.start()]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = generate(server_url, {"text": PROMPT, "sampling_params": {**params, "no_stop_trim": True}})
    assert kept["text"].startswith(full[: m.end()]) and full.startswith(kept["text"])


def test_stop_regex_stream_never_takes_text_back(server_url, full):
    pattern, m = _pattern_for(full)
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_regex": pattern},
    }
    texts = _stream_texts(server_url, body)
    assert texts[-1] == full[: m.start()]
    assert all(texts[-1].startswith(t) for t in texts)  # every event's text is a prefix of the final one


def _stream_texts(url: str, body: dict) -> list[str]:
    with requests.post(
        url + "/generate", json={**body, "stream": True}, stream=True, timeout=HTTP_TIMEOUT_S
    ) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines(decode_unicode=True) if line and line != "data: [DONE]"]
    return [json.loads(line[len("data: ") :])["text"] for line in lines]


@pytest.mark.parametrize(
    "stop_regex, message",
    [
        (["(unclosed"], "stop_regex '(unclosed' is not a valid regular expression"),
        (["a"] * 65, "65 stop_regex patterns, more than --max-stop-strings (64)"),
        (["a" * 4097], "the stop_regex patterns have 4097 characters together, more than --max-stop-chars"),
    ],
)
def test_bad_or_too_many_stop_regexes_are_a_400(server_url, stop_regex, message):
    out = generate(server_url, {"text": PROMPT, "sampling_params": {"stop_regex": stop_regex}}, status=400)
    assert message in out["error"]["message"]


# ---- SGLang's other sampling parameters and routes ---------------------------------------------------------
SGLANG_DEFAULTS = {
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
}


def test_sglang_defaults_are_accepted_and_unsupported_values_named(server_url):
    generate(server_url, {"text": PROMPT, "sampling_params": {**SGLANG_DEFAULTS, "max_new_tokens": 1}})
    for name, value in [("ebnf", 'root ::= "a"'), ("custom_params", {"a": 1})]:
        out = generate(server_url, {"text": PROMPT, "sampling_params": {name: value}}, status=400)
        assert out["error"]["message"].startswith(f"{name} is not supported by radixlm"), out
    # logit_bias is implemented: +100 on one token makes the greedy output that token, over the vocabulary
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"42": 100}}
    assert generate(server_url, {"text": PROMPT, "sampling_params": params})["output_ids"] == [42, 42, 42]
    params["logit_bias"] = {"10000000": 1}
    out = generate(server_url, {"text": PROMPT, "sampling_params": params}, status=400)
    assert out["error"]["message"].startswith("logit_bias: token ids must be in [0, "), out


def test_per_request_stream_interval(server_url):
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    every_token = _stream_texts(server_url, {"text": PROMPT, "sampling_params": params})
    every_four = _stream_texts(
        server_url, {"text": PROMPT, "sampling_params": {**params, "stream_interval": 4}}
    )
    assert len(every_token) >= 6 and len(every_four) <= 3, (every_token, every_four)
    assert every_four[-1] == every_token[-1]


def test_concate_and_append_request(server_url):
    r = requests.post(
        server_url + "/concate_and_append_request",
        json={"src_rids": ["a", "b"], "dst_rid": "c"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 200 and r.json() == {"success": True}
    r = requests.post(
        server_url + "/concate_and_append_request", json={"src_rids": "a"}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 400 and "src_rids" in r.text
