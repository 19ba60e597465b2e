"""The OpenAI-compatible API end to end, driven by the official `openai` client against the shared server.

Greedy answers are cross-checked against the native /generate on the same prompt (the chat prompt built
with the server's own chat template), so the translation layer cannot silently change what is generated.
"""

from __future__ import annotations

import uuid

import jinja2
import openai
import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S

pytestmark = pytest.mark.timeout(600)  # includes the session server's startup for the first test

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)


def native(url: str, text: str, **params) -> dict:
    r = requests.post(
        url + "/generate", json={"text": text, "sampling_params": params}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def chat_reference(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert resp.choices[0].message.content
    return resp


@pytest.fixture(scope="module")
def completion_reference(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text
    return resp


def test_models(client, server_url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "radixlm"
    raw = requests.get(server_url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 8192


def test_chat_matches_native_generate(server_url, chat_reference):
    resp = chat_reference
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert len(resp.choices) == 1 and choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    usage = resp.usage
    assert 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Render the server's chat template ourselves and ask the native API: same prompt, same tokens.
    info = requests.get(server_url + "/get_model_info", timeout=HTTP_TIMEOUT_S).json()
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(info["chat_template"])
    prompt = template.render(
        messages=MESSAGES,
        add_generation_prompt=True,
        bos_token=info["bos_token"],
        eos_token=info["eos_token"],
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    out = native(server_url, prompt, max_new_tokens=MAX_TOKENS, temperature=0)
    assert out["meta_info"]["prompt_tokens"] == usage.prompt_tokens
    assert out["text"] == choice.message.content
    assert out["meta_info"]["completion_tokens"] == usage.completion_tokens


def test_completion_matches_native_generate(server_url, completion_reference):
    resp = completion_reference
    assert resp.object == "text_completion" and resp.model == MODEL
    out = native(server_url, PROMPT, max_new_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == out["text"]
    assert resp.usage.prompt_tokens == out["meta_info"]["prompt_tokens"] == 5
    assert resp.usage.completion_tokens == out["meta_info"]["completion_tokens"]
    assert (
        resp.choices[0].finish_reason
        == {"length": "length", "stop": "stop"}[out["meta_info"]["finish_reason"]["type"]]
    )


def test_chat_stream_with_usage(client, chat_reference):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    content_chunks = chunks[:-1]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == chat_reference.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finishes == [chat_reference.choices[0].finish_reason]
    assert content_chunks[-1].choices[0].finish_reason is not None
    usage = chunks[-1].usage
    assert usage.completion_tokens == chat_reference.usage.completion_tokens
    assert usage.prompt_tokens == chat_reference.usage.prompt_tokens


def test_completion_stream(client, completion_reference):
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert "".join(c.choices[0].text for c in chunks[:-1]) == completion_reference.choices[0].text
    assert chunks[-1].usage.completion_tokens == completion_reference.usage.completion_tokens
    # Without stream_options no chunk carries usage.
    plain = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stream=True)
    )
    assert plain and all(c.usage is None for c in plain)
    assert completion_reference.choices[0].text.startswith("".join(c.choices[0].text for c in plain))


def test_n_and_seed_are_reproducible(client):
    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=1.0, n=2, seed=7
        )

    first = ask()
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts[0] != texts[1]  # each choice gets its own seed
    assert first.usage.completion_tokens <= 8
    assert [c.message.content for c in ask().choices] == texts


def test_seed_reproducible_on_completions(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0}
    a = client.completions.create(seed=42, **kw).choices[0].text
    b = client.completions.create(seed=42, **kw).choices[0].text
    assert a == b


def test_stop(client, completion_reference):
    full = completion_reference.choices[0].text
    assert "." in full, full
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=["."]
    )
    assert resp.choices[0].text == full[: full.index(".")]
    assert resp.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop="capital"
    )
    assert "capital" not in chat.choices[0].message.content


def test_chat_logprobs(client, chat_reference):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0
        assert bytes(tok.bytes).decode() == tok.token
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tok.top_logprobs[0].token == tok.token  # greedy picks the most likely token
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-5)
    assert "".join(t.token for t in content) == choice.message.content
    assert chat_reference.choices[0].message.content.startswith(choice.message.content)


def test_completion_logprobs(client, completion_reference):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5) and tok in top
    assert completion_reference.choices[0].text.startswith(choice.text)


@pytest.mark.parametrize("n", [1, 2])
def test_completion_stream_echo_logprobs_equals_non_streamed(client, n):
    """echo + logprobs streamed: each choice's first chunk carries the prompt and its logprobs, and the chunks
    concatenate to the non-streamed choice (text, tokens, logprobs, top logprobs, text offsets)."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    whole = client.completions.create(n=n, **kw)
    n_prompt = whole.usage.prompt_tokens
    got = {i: {"text": "", "tokens": [], "lps": [], "tops": [], "offsets": []} for i in range(n)}
    firsts = {}
    for chunk in client.completions.create(n=n, stream=True, **kw):
        for c in chunk.choices:
            g = got[c.index]
            firsts.setdefault(c.index, c)
            g["text"] += c.text
            if c.logprobs is not None:
                g["tokens"] += c.logprobs.tokens
                g["lps"] += c.logprobs.token_logprobs
                g["tops"] += c.logprobs.top_logprobs
                g["offsets"] += c.logprobs.text_offset
    for i in range(n):
        want = whole.choices[i]
        first = firsts[i]
        assert first.text.startswith(PROMPT)  # the echoed prompt goes out first ...
        assert (
            len(first.logprobs.tokens) >= n_prompt and first.logprobs.token_logprobs[0] is None
        )  # ... scored
        g = got[i]
        assert g["text"] == want.text and want.text.startswith(PROMPT)
        assert g["tokens"] == want.logprobs.tokens
        assert len(want.logprobs.tokens) > n_prompt  # prompt and output tokens
        assert g["lps"][0] is None and want.logprobs.token_logprobs[0] is None
        # The second request finds the first's prompt cached: its logprobs come through the paged-attention
        # kernel's short-extend / decode path instead of the prefill's SDPA, which agree to ~1e-5 in float32.
        tol = 1e-4
        assert g["lps"][1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=tol)
        assert g["offsets"] == want.logprobs.text_offset
        assert len(g["tops"]) == len(want.logprobs.top_logprobs)
        for a, b in zip(g["tops"][1:], want.logprobs.top_logprobs[1:], strict=True):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=tol)


def test_cached_tokens_on_repeated_long_prompt(client):
    prompt = f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * 30
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > 300
    assert first.usage.prompt_tokens_details.cached_tokens < 4  # a leading token may be shared with others
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text


def test_extra_body_top_k_and_min_p(client, completion_reference):
    greedy = completion_reference.choices[0].text
    # top_k=1 and min_p=1 each leave only the most likely token: temperature 1 then samples greedily.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        resp = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, extra_body=extra
        )
        assert resp.choices[0].text == greedy, extra


def test_cache_salt_in_extra_body(client):
    """vLLM's `cache_salt` on the OpenAI routes: a salted chat shares no cached prefix with unsalted ones."""
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] count to three"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**kw)
    salted = client.chat.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    again = client.chat.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    plain = client.chat.completions.create(**kw)  # again: the unsalted copy hits its own cache
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(**kw, extra_body={"cache_salt": ""})


def test_session_cache_miss_explainer(server_url):
    """An agent re-sends its history with one character changed: the answer says where the prompt left the
    session's previous request, with the text on both sides."""
    sid = f"agent-{uuid.uuid4().hex[:8]}"
    url = server_url + "/v1/chat/completions"
    history = [{"role": "user", "content": f"[{sid}] list three colours of the rainbow, please"}]
    first = requests.post(
        url,
        json={"model": MODEL, "messages": history, "max_tokens": 4, "temperature": 0, "session_id": sid},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    reply = first["choices"][0]["message"]["content"]
    turn2 = [
        {"role": "user", "content": history[0]["content"].replace("rainbow", "rainbov")},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and two more?"},
    ]
    r = requests.post(
        url,
        json={"model": MODEL, "messages": turn2, "max_tokens": 1, "session_id": sid},
        timeout=HTTP_TIMEOUT_S,
    )
    details = r.json()["usage"]["prompt_tokens_details"]
    miss = details["cache_miss"]
    assert miss["reason"] == "diverged", miss
    assert details["cached_tokens"] <= miss["index"] < r.json()["usage"]["prompt_tokens"]
    assert "rainbow" in miss["previous_text"] and "rainbov" in miss["new_text"], miss
    requests.delete(f"{server_url}/v1/sessions/{sid}", timeout=HTTP_TIMEOUT_S)


def test_session_of_another_salt_reveals_nothing(server_url):
    """A session is its id within its cache salt: a request of another salt naming a victim's session id
    gets no explanation (no text of the victim's), does not replace the victim's pin and cannot delete it."""
    sid = f"victim-{uuid.uuid4().hex[:8]}"
    url = server_url + "/v1/chat/completions"
    secret = f"[{sid}] my secret passphrase is purple-otter-42, remember it"
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "session_id": sid}
    victim = {**body, "messages": [{"role": "user", "content": secret}], "cache_salt": "victim"}
    r = requests.post(url, json=victim, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    probe = {
        **body,
        "messages": [{"role": "user", "content": secret[:20] + " guess"}],
        "cache_salt": "attacker",
    }
    r = requests.post(url, json=probe, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    assert "cache_miss" not in details and "purple" not in r.text, details
    assert requests.delete(f"{server_url}/v1/sessions/{sid}", timeout=HTTP_TIMEOUT_S).status_code == 404
    r = requests.delete(f"{server_url}/v1/sessions/{sid}?cache_salt=attacker", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200  # the attacker's own session (its probe was pinned under its salt)
    r = requests.delete(f"{server_url}/v1/sessions/{sid}?cache_salt=victim", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["released_tokens"] > 0, r.text
