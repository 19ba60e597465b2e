"""Anthropic's `cache_control` breakpoints on /v1/messages, with the official client: a breakpoint's prefix
is pinned in the radix cache for its TTL (5m or 1h), and usage says honestly what was read from the cache
and what was computed and cached now (`cache_creation_input_tokens`); a bad breakpoint is a 400 naming it."""

from __future__ import annotations

import time
import uuid

import anthropic
import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S


@pytest.fixture(scope="module")
def client(server_url):
    yield anthropic.Anthropic(base_url=server_url, api_key="unused", timeout=300, max_retries=0)
    # the breakpoints' pins would hold their prefixes for up to an hour on the shared server: a flush
    # releases every pin (tests after this one count protected tokens)
    for _ in range(20):
        if requests.post(server_url + "/flush_cache", timeout=HTTP_TIMEOUT_S).status_code == 200:
            break
        time.sleep(0.5)


def info(server_url: str) -> dict:
    return requests.get(server_url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()


def system_blocks(ttl: str | None = None) -> list[dict]:
    """A long system prompt no other test sends, with a breakpoint at its end."""
    words = " ".join(f"rule-{uuid.uuid4().hex[:6]}" for _ in range(80))
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": f"Follow these house rules: {words}", "cache_control": control}]


def test_a_breakpoint_prefix_is_created_then_read_and_stays_pinned(client, server_url):
    system = system_blocks()
    before = info(server_url)
    first = client.messages.create(
        model="default", max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi"}]
    )
    u = first.usage
    assert u.cache_creation_input_tokens > 150, u  # the rules were computed now and cached
    assert u.cache_read_input_tokens < 40, u  # at most the template's head, from other requests
    total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
    after = info(server_url)
    assert after["sessions_pinned"] == before["sessions_pinned"] + 1  # the breakpoint's pin
    second = client.messages.create(
        model="default", max_tokens=2, system=system, messages=[{"role": "user", "content": "Hello there"}]
    )
    v = second.usage
    assert v.cache_creation_input_tokens == 0, v
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens + u.cache_read_input_tokens, (u, v)
    assert info(server_url)["sessions_pinned"] == after["sessions_pinned"]  # the same pin, renewed
    assert total > v.cache_read_input_tokens  # the user turn after the breakpoint is not counted as cached


def test_a_breakpoint_on_a_message_and_the_streamed_usage(client):
    text = " ".join(f"fact-{uuid.uuid4().hex[:6]}" for _ in range(60))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Summarise."},
    ]
    with client.messages.stream(model="default", max_tokens=2, messages=messages) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_creation_input_tokens > 100, final.usage
    again = client.messages.create(
        model="default", max_tokens=2, messages=messages, cache_control={"type": "ephemeral", "ttl": "1h"}
    )
    assert again.usage.cache_read_input_tokens > final.usage.cache_creation_input_tokens
    # the whole prompt was the automatic breakpoint, and all but the last token of it was already cached
    assert again.usage.cache_creation_input_tokens <= 2, again.usage


@pytest.mark.parametrize(
    "control, field",
    [
        ({"type": "ephemeral", "ttl": "2h"}, "system[0].cache_control.ttl"),
        ({"type": "persistent"}, "system[0].cache_control"),
    ],
)
def test_a_bad_breakpoint_is_a_400_naming_it(client, control, field):
    system = [{"type": "text", "text": "Be brief.", "cache_control": control}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="default", max_tokens=1, system=system, messages=[{"role": "user", "content": "Hi"}]
        )
    assert field in str(e.value)
