"""Single requests that used to take the whole server down, through a real server: each now gets its own
answer, /health stays 200, the KV accounting is exact afterwards, and another client's request finishes.

- a plain JSON Schema through jump-forward (Kubernetes' RoleRef: three required `["string", "null"]`
  properties) freed one KV slot twice and the scheduler exited on the accounting check; the same is run
  over schemas of every bundled JSON-Schema subset;
- `stop_token_ids` beyond the vocabulary with `min_new_tokens` (OpenAI `min_tokens`) made the sampler raise
  inside the scheduler's step.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K")
PER_SUBSET = int(os.environ.get("RADIXLM_HARDENING_SCHEMAS", "1"))
ROLE_REF = {
    "type": "object",
    "properties": {
        "apiGroup": {"type": ["string", "null"]},
        "kind": {"type": ["string", "null"]},
        "name": {"type": ["string", "null"]},
    },
    "required": ["apiGroup", "kind", "name"],
}


@pytest.fixture(scope="module")
def srv():
    # float32: jump-forward's retokenization paths are the same in every dtype; fp32 keeps runs repeatable
    with ServerProcess(extra_args=["--max-total-tokens", "8192", "--dtype", "float32"]) as s:
        yield s


def generate(url: str, body: dict) -> requests.Response:
    # generous: a real-world schema's first compile plus 128 tokens on 2 shared cores
    return requests.post(url + "/generate", json=body, timeout=600)


def assert_healthy_and_exact(url: str) -> None:
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert_no_kv_leak(wait_idle(url, timeout=120))


def sample_schemas() -> list[tuple[str, dict]]:
    rng = random.Random(0)
    out = [("RoleRef", ROLE_REF)]
    for name in SUBSETS:
        rows = (ROOT / "bench" / "data" / "jsonschemabench" / f"{name}.jsonl").read_text().splitlines()
        for line in rng.sample(rows, PER_SUBSET):
            row = json.loads(line)
            out.append((f"{name}/{row['id']}", row["schema"]))
    return out


@pytest.mark.parametrize(("name", "schema"), sample_schemas(), ids=[n for n, _ in sample_schemas()])
def test_json_schema_with_jump_forward_keeps_kv_exact(srv, name, schema):
    # 128 tokens: the length of the report that found the RoleRef crash; the sampled schemas need fewer
    max_new = 128 if name == "RoleRef" else 64
    params = {"max_new_tokens": max_new, "temperature": 0, "json_schema": schema}
    r = generate(srv.url, {"text": "JSON: ", "sampling_params": params})
    # 400: a schema the grammar layer rejects by name; never a 5xx, never a dead server
    assert r.status_code in (200, 400), (name, r.status_code, r.text[:500])
    if r.status_code == 400:
        assert r.json()["error"]["message"], r.text
    assert_healthy_and_exact(srv.url)


def test_out_of_vocabulary_stop_ids_are_a_400_and_others_finish(srv):
    """The victim's neighbour is mid-decode while the bad requests arrive; it finishes with all tokens."""
    result: dict = {}

    def neighbour():
        body = {
            "text": "Count: one, two,",
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
        }
        result["r"] = generate(srv.url, body)

    t = threading.Thread(target=neighbour)
    t.start()
    huge = 10**9
    r = generate(
        srv.url,
        {
            "text": "Hi",
            "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 4, "stop_token_ids": [huge]},
        },
    )
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"], r.text
    r = requests.post(
        srv.url + "/v1/completions",
        json={"model": "default", "prompt": "Hi", "max_tokens": 8, "min_tokens": 4, "stop_token_ids": [huge]},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"], r.text
    t.join(timeout=HTTP_TIMEOUT_S)
    assert result["r"].status_code == 200 and result["r"].json()["meta_info"]["completion_tokens"] == 48
    assert_healthy_and_exact(srv.url)


def test_request_timeout_is_a_504_and_frees_its_kv(srv):
    body = {
        "text": "Tell me a long story.",
        "timeout": 0.5,
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }
    r = generate(srv.url, body)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text
    r = generate(srv.url, {**body, "timeout": "soon"})
    assert r.status_code == 400 and "timeout" in r.json()["error"]["message"], r.text
    assert_healthy_and_exact(srv.url)


def test_abort_by_client_rid_reaches_every_choice_of_n(srv):
    """A request with n > 1 runs as n choices with derived ids; aborting the id the client gave must end
    all of them (it matched none before)."""
    result: dict = {}
    body = {
        "text": "Once upon a time",
        "rid": "client-rid-n3",
        "sampling_params": {"max_new_tokens": 1500, "n": 3, "temperature": 0.8, "ignore_eos": True},
    }
    t = threading.Thread(target=lambda: result.update(r=generate(srv.url, body)))
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the choices decode
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        if info["num_running_reqs"] >= 3:
            break
        time.sleep(0.2)
    r = requests.post(srv.url + "/abort_request", json={"rid": "client-rid-n3"}, timeout=30)
    assert r.status_code == 200, r.text
    t.join(timeout=120)
    assert not t.is_alive(), "the aborted choices kept generating"
    out = result["r"]
    assert out.status_code == 200, out.text
    choices = out.json()
    assert len(choices) == 3 and all(c["meta_info"]["finish_reason"]["type"] == "abort" for c in choices)
    assert_healthy_and_exact(srv.url)
