"""Every front end carries every per-request option to the scheduler (`messages.RequestOptions`):
native /generate, chat completions, completions, Responses and Messages each take `session_id` (or the
X-Session-Id header; the OpenAI ones also `prompt_cache_key`), `cache_salt`, `cache_ttl_s`, `timeout` and
`speculative_num_draft_tokens`, and each is observed where the scheduler acts on it: the session's pin under
its salt (DELETE /v1/sessions/{id}?cache_salt=...), no pin with a TTL of 0, a 504 past the deadline, and
the sampling check of the draft bound, the scheduler's count of prioritized requests; the DSL backends carry
them too. A new option added to `RequestOptions` gets a test here."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import requests

import lang
from lang.backends.base import REQUEST_OPTIONS
from runtime.entrypoints.generate_input import OPTION_FIELDS
from runtime.messages import RequestOptions
from tests.e2e.server_utils import HTTP_TIMEOUT_S

PROMPT = "Name one colour."


def native(options: dict) -> tuple[str, dict]:
    return "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, **options}


def chat(options: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        **options,
    }


def completions(options: dict) -> tuple[str, dict]:
    return "/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": 2, **options}


def responses(options: dict) -> tuple[str, dict]:
    return "/v1/responses", {"model": "default", "input": PROMPT, "max_output_tokens": 2, **options}


def messages(options: dict) -> tuple[str, dict]:
    return "/v1/messages", {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        **options,
    }


FRONT_ENDS: dict[str, Callable[[dict], tuple[str, dict]]] = {
    "native": native,
    "chat": chat,
    "completions": completions,
    "responses": responses,
    "messages": messages,
}
# where the native body puts sampling options
SAMPLING_IN_PARAMS = {"native"}


def post(url: str, front: str, options: dict, headers: dict | None = None) -> requests.Response:
    path, body = FRONT_ENDS[front]({k: v for k, v in options.items() if k != "speculative_num_draft_tokens"})
    if "speculative_num_draft_tokens" in options:
        where = body["sampling_params"] if front in SAMPLING_IN_PARAMS else body
        where["speculative_num_draft_tokens"] = options["speculative_num_draft_tokens"]
    return requests.post(url + path, json=body, headers=headers or {}, timeout=HTTP_TIMEOUT_S)


def delete_session(url: str, sid: str, salt: str | None = None) -> int:
    query = f"?cache_salt={salt}" if salt else ""
    return requests.delete(f"{url}/v1/sessions/{sid}{query}", timeout=HTTP_TIMEOUT_S).status_code


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_session_salt_and_ttl_reach_the_scheduler(server_url, front):
    sid = f"{front}-{uuid.uuid4().hex[:8]}"
    r = post(server_url, front, {"session_id": sid, "cache_salt": "tenant-a", "cache_ttl_s": 60})
    assert r.status_code == 200, r.text
    assert delete_session(server_url, sid) == 404  # not an unsalted session: the salt travelled
    assert delete_session(server_url, sid, "tenant-a") == 200  # pinned under its salt: the session did
    r = post(server_url, front, {"session_id": sid, "cache_ttl_s": 0})
    assert r.status_code == 200 and delete_session(server_url, sid) == 404  # a TTL of 0 pins nothing


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_the_session_header_names_the_session(server_url, front):
    sid = f"{front}-hdr-{uuid.uuid4().hex[:8]}"
    r = post(server_url, front, {}, headers={"X-Session-Id": sid})
    assert r.status_code == 200, r.text
    assert delete_session(server_url, sid) == 200


@pytest.mark.parametrize("front", ["chat", "completions", "responses"])
def test_prompt_cache_key_is_the_session(server_url, front):
    key = f"pck-{front}-{uuid.uuid4().hex[:8]}"
    r = post(server_url, front, {"prompt_cache_key": key})
    assert r.status_code == 200, r.text
    assert delete_session(server_url, key) == 200
    r = post(server_url, front, {"prompt_cache_key": "k" * 257})
    assert r.status_code == 400 and "prompt_cache_key" in r.text, r.text


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_timeout_and_draft_bound_reach_the_scheduler(server_url, front):
    r = post(server_url, front, {"timeout": 1e-6})
    assert r.status_code == 504 and "timed out" in r.text, (front, r.status_code, r.text)
    r = post(server_url, front, {"speculative_num_draft_tokens": 33})
    assert r.status_code == 400 and "speculative_num_draft_tokens" in r.text, (front, r.text)
    assert post(server_url, front, {"speculative_num_draft_tokens": 0}).status_code == 200


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_priority_reaches_the_scheduler(server_url, front):
    def prioritized() -> int:
        return requests.get(server_url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()[
            "requests_prioritized"
        ]

    before = prioritized()
    assert post(server_url, front, {"priority": -3}).status_code == 200
    assert prioritized() == before + 1
    r = post(server_url, front, {"priority": "high"})
    assert r.status_code == 400 and "priority" in r.text, (front, r.text)


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_program_id_reaches_the_scheduler(server_url, front):
    """A program's requests are counted by the scheduler's program table (body field or X-Program-Id)."""

    def program_requests() -> int:
        return requests.get(server_url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()[
            "program_requests"
        ]

    before = program_requests()
    assert post(server_url, front, {"program_id": f"p-{uuid.uuid4().hex[:8]}"}).status_code == 200
    assert program_requests() == before + 1
    assert post(server_url, front, {}, headers={"X-Program-Id": "p-header"}).status_code == 200
    assert program_requests() == before + 2
    assert post(server_url, front, {}).status_code == 200  # no program, no session: not counted
    assert program_requests() == before + 2


@pytest.mark.parametrize("front", list(FRONT_ENDS))
@pytest.mark.parametrize(
    "options, field",
    [
        ({"cache_salt": ""}, "cache_salt"),
        ({"session_id": ""}, "session_id"),
        ({"cache_ttl_s": 5}, "cache_ttl_s"),
        ({"timeout": -1}, "timeout"),
        ({"priority": 1.5}, "priority"),
        ({"program_id": ""}, "program_id"),
    ],
)
def test_bad_options_are_400s_naming_them(server_url, front, options, field):
    r = post(server_url, front, options)
    assert r.status_code == 400 and field in r.text, (front, r.status_code, r.text)


def test_every_option_is_named_for_the_dsl_and_the_server_alike():
    assert set(REQUEST_OPTIONS) == set(OPTION_FIELDS)
    server_filled = {"tenant", "pin_prefix_len"}
    # a LoRA adapter is each front end's own field: OpenAI's `model`, the native `lora_path`
    route_filled = {"lora"}
    fields = {"timeout" if f == "timeout_s" else f for f in RequestOptions.__struct_fields__}
    client = fields - server_filled - route_filled
    assert client == set(OPTION_FIELDS)


@lang.function
def one_turn(s):
    s += lang.user("Name a colour.")
    s += lang.assistant(lang.gen("answer", max_tokens=2, temperature=0))


@pytest.mark.parametrize("backend", ["runtime_endpoint", "openai"])
def test_dsl_backends_carry_the_options(server_url, backend):
    sid = f"dsl-{backend}-{uuid.uuid4().hex[:8]}"
    options = {"session_id": sid, "cache_salt": "dsl", "priority": -1, "timeout": 60}
    if backend == "openai":
        be = lang.OpenAI("default", base_url=server_url + "/v1", options=options)
    else:
        be = lang.RuntimeEndpoint(server_url, options=options)

    def prioritized() -> int:
        return requests.get(server_url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()[
            "requests_prioritized"
        ]

    before = prioritized()
    one_turn.run(backend=be)
    assert prioritized() > before
    assert delete_session(server_url, sid) == 404  # pinned under its salt ...
    assert delete_session(server_url, sid, "dsl") == 200  # ... where the options put it
