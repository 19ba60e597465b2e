"""Program-level scheduling over HTTP (`--schedule-policy program`, `--kv-retention auto`, and vLLM's
`--scheduling-policy fcfs`, which refuses a `priority`): a long agent
program and many short ones share a server that runs one request at a time; the long program's next call
arrives before the short programs' calls, yet every short one finishes before it completes. Its earlier calls
were retained without the client asking, and nothing leaks. The tools an answer called reach automatic
retention from every API (OpenAI chat, streamed or not; Anthropic Messages), which learns each tool's
pause."""

from __future__ import annotations

import threading
import time
import uuid

import anthropic
import openai
import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, server_info, wait_idle

SHORT = 4


@pytest.fixture(scope="module")
def url():
    srv = ServerProcess(
        extra_args=[
            "--schedule-policy",
            "program",
            "--kv-retention",
            "auto",
            "--max-running-requests",
            "1",
            "--max-total-tokens",
            "8192",
            "--scheduling-policy",
            "fcfs",
        ]
    ).start()
    try:
        yield srv.url
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()


def generate(url: str, text: str, max_new: int, program: str | None = None, rid: str | None = None):
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    if program:
        body["program_id"] = program
    if rid:
        body["rid"] = rid
    return requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)


def chat(url: str, text: str, max_new: int, program: str):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_new,
        "temperature": 0,
    }
    headers = {"X-Program-Id": program}  # the header names the program when the body does not
    return requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def wait_queued(url: str, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server_info(url)["num_queued_reqs"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests queued after {timeout:.0f} s"
        time.sleep(0.05)


def test_short_programs_finish_before_the_long_programs_next_step(url):
    long_id = f"long-{uuid.uuid4().hex[:8]}"
    history = "You are an agent with many tools. " + " ".join(
        f"Observation {i}: value {i * 7}." for i in range(90)
    )
    for turn in range(3):  # the long program computes well past the first PLAS level
        r = generate(url, history, 16, program=long_id)
        assert r.status_code == 200, r.text
        history += r.json()["text"] + f" Tool result {turn}: ok."
    info = server_info(url)
    assert info["programs_tracked"] >= 1 and info["retain_device"] >= 1  # retained without a session field

    done: dict[str, float] = {}
    errors: list[str] = []

    def run(name: str, call) -> None:
        r = call()
        done[name] = time.monotonic()
        if r.status_code != 200 and name != "blocker":
            errors.append(f"{name}: {r.status_code} {r.text[:200]}")

    blocker = threading.Thread(
        target=run, args=("blocker", lambda: generate(url, "Count slowly.", 2000, rid="blocker"))
    )
    blocker.start()
    deadline = time.monotonic() + 60
    while server_info(url)["num_running_reqs"] < 1:  # the blocker holds the one running slot
        assert time.monotonic() < deadline
        time.sleep(0.05)
    threads = [
        threading.Thread(target=run, args=("long", lambda: generate(url, history, 16, program=long_id)))
    ]
    threads[0].start()
    wait_queued(url, 1)  # the long program's next step is queued first ...
    for i in range(SHORT):
        pid = f"short-{i}-{uuid.uuid4().hex[:8]}"
        t = threading.Thread(
            target=run, args=(f"short{i}", lambda pid=pid: chat(url, f"Say hi {pid}.", 8, pid))
        )
        t.start()
        threads.append(t)
    wait_queued(url, 1 + SHORT)  # ... then every short program's call
    requests.post(url + "/abort_request", json={"rid": "blocker"}, timeout=HTTP_TIMEOUT_S)
    for t in [blocker, *threads]:
        t.join(timeout=600)
    assert not errors, errors
    shorts = [done[f"short{i}"] for i in range(SHORT)]
    assert max(shorts) < done["long"], {k: round(v - done["blocker"], 3) for k, v in done.items()}
    info = wait_idle(url)
    assert_no_kv_leak(info)
    assert info["program_requests"] >= 4 + SHORT


def test_a_chat_client_naming_no_program_is_one_program_and_retained(url):
    """An OpenAI chat client that sends no program or session field: each call resends the conversation, so
    the server infers one program from the prompts and retains its history between calls."""
    before = server_info(url)
    messages = [
        {"role": "system", "content": "You are a careful agent. " * 20},
        {"role": "user", "content": f"Task {uuid.uuid4().hex}: list three colours."},
    ]
    cached = []
    for turn in range(3):
        body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        out = r.json()
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [
            {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Tool result {turn}: ok. Go on."},
        ]
    info = wait_idle(url)
    assert info["lineage_continued"] - before["lineage_continued"] == 2, info
    assert info["retain_device"] - before["retain_device"] >= 2, info
    assert cached[1] > 0 and cached[2] > cached[1], cached
    assert_no_kv_leak(info)


def test_a_priority_is_refused_under_scheduling_policy_fcfs(url):
    """vLLM's `--scheduling-policy fcfs`: a request naming a priority is a 400 naming the field; priority 0 is
    served."""
    body = {"text": "Hi.", "sampling_params": {"max_new_tokens": 2}, "priority": 2}
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400 and "'priority'" in r.text and "fcfs" in r.text, r.text
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    r = requests.post(url + "/v1/chat/completions", json={**chat, "priority": -1}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400 and "'priority'" in r.text, r.text
    assert (
        requests.post(
            url + "/v1/chat/completions", json={**chat, "priority": 0}, timeout=HTTP_TIMEOUT_S
        ).status_code
        == 200
    )


TOOLS = {
    "search_web": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    "read_file": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


def test_the_tools_an_answer_called_reach_automatic_retention_from_every_api(url):
    """An agent whose answers are forced to call a named tool (alternating), answered after each tool's own
    pause: every answer's tool names reach the scheduler (OpenAI chat, non-streamed and streamed, and
    Anthropic Messages), and the next call's gap is learned as that tool's."""
    pid = f"tools-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    messages = [{"role": "user", "content": "Find the capital of Norway and read notes.txt."}]
    before = server_info(url)
    for turn, name in enumerate(["search_web", "read_file", "search_web", "read_file"]):
        kwargs = dict(
            model="default",
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=48,
            temperature=0,
            extra_headers={"X-Program-Id": pid},
        )
        if turn < 2:
            call = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
            call_id, args = call.id, call.function.arguments
            assert call.function.name == name
        else:  # streamed: the call's name comes in its first delta
            call_id, args, names = None, "", []
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    call_id = call_id or tc.id
                    names += [tc.function.name] if tc.function.name else []
                    args += tc.function.arguments or ""
            assert names == [name]
        messages += [
            {"role": "assistant", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "ok"},
        ]  # fmt: skip
        time.sleep(0.6 if name == "search_web" else 0.1)  # the tool runs
    info = server_info(url)
    assert info["retain_tool_timed"] - before["retain_tool_timed"] == 4, info
    assert info["retain_tools_known"] >= 2, info  # each tool's pause was learned from the call after it

    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S)
    kwargs = dict(
        model="default",
        max_tokens=48,
        messages=[{"role": "user", "content": "Search for the capital of Norway."}],
        tools=[{"name": n, "input_schema": p} for n, p in TOOLS.items()],
        tool_choice={"type": "tool", "name": "search_web"},
        extra_headers={"X-Program-Id": pid + "-messages"},
    )
    msg = claude.messages.create(**kwargs)
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["search_web"]
    with claude.messages.stream(**kwargs) as stream:  # streamed (the Responses stream shares this path)
        msg = stream.get_final_message()
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["search_web"]
    info = wait_idle(url)
    assert info["retain_tool_timed"] - before["retain_tool_timed"] == 6, info
    assert_no_kv_leak(info)
