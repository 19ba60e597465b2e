"""The DSL end to end against a real server process on the default model (SmolLM2-135M-Instruct).

The server is the session-wide one from `conftest.py` (`python -m runtime.launch_server --model default
--max-total-tokens 20000` on a free port, stopped at the end; RADIXLM_TEST_SERVER_URL points the tests at a
running server instead). Every primitive runs through it, and `select` is checked against the same
normalized logprobs computed directly with transformers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests

import lang
from lang import assistant, assistant_begin, gen, gen_int, gen_string, select, system, user

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def backend(server_url: str) -> lang.RuntimeEndpoint:
    return lang.RuntimeEndpoint(server_url, timeout=120)


@pytest.fixture(scope="module")
def hf():
    """(tokenizer, model) of the converted default model, loaded with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.models.gguf import float_folder
    from runtime.models.model_loader import load_tokenizer, resolve_model_path

    path = resolve_model_path("default")
    model = AutoModelForCausalLM.from_pretrained(
        float_folder(path), dtype=torch.float32, local_files_only=True
    )
    model.eval()
    return load_tokenizer(path), model


def hf_normalized_logprobs(hf, prompt: str, choices: list[str]) -> tuple[int, list[float]]:
    """Mean logprob of the tokens of prompt+choice from the first one that differs from the prompt's tokens
    (the DSL's definition), computed with transformers."""
    import torch

    tok, model = hf
    head = tok(prompt).input_ids
    scores = []
    for choice in choices:
        ids = tok(prompt + choice).input_ids
        d = next(i for i in range(len(ids)) if i >= len(head) or ids[i] != head[i])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        token_lps = [logprobs[p - 1, ids[p]].item() for p in range(d, len(ids))]
        scores.append(sum(token_lps) / len(token_lps))
    return len(head), scores


# --------------------------------------------------------------------------------------------- primitives
@lang.function
def qa(s, question):
    s += system("You are concise.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8, temperature=0))
    s += user("Is that correct? Answer yes or no.")
    s += assistant(select("verdict", choices=["yes", "no"]))


def test_roles_gen_select_and_chat_template(backend, hf):
    state = qa.run(question="What is the capital of France?", backend=backend)
    assert state["answer"].strip() and state["verdict"] in ("yes", "no")
    tok = hf[0]
    assert state.text() == tok.apply_chat_template(state.messages(), tokenize=False)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] in ("stop", "length") and 0 < meta["completion_tokens"] <= 8
    assert "<|im_end|>" not in state["answer"]


@pytest.mark.parametrize(
    "chat, question, choices",
    [
        (True, "Which is a fruit?", ["apple", "hammer", "a purple spaceship engine"]),
        (True, "What is 2 + 2?", ["4", "five hundred and twelve"]),
        # A prompt ending in a space: "yes"/"no" merge with it into " yes"/" no" tokens.
        (False, "Q: Is fire hot? Answer yes or no.\nA: ", ["yes", "no"]),
    ],
)
def test_select_matches_transformers(backend, hf, chat, question, choices):
    @lang.function
    def pick(s):
        s += user(question) + assistant_begin() if chat else question
        prompt = s.text()
        s += select("choice", choices=choices)
        return prompt

    state = pick.run(backend=backend)
    meta, prompt = state.get_meta_info("choice"), state.ret_value
    n_prompt, expected = hf_normalized_logprobs(hf, prompt, choices)
    assert meta["prompt_tokens"] == n_prompt
    assert meta["normalized_logprobs"] == pytest.approx(expected, abs=2e-2)
    assert state["choice"] == choices[max(range(len(choices)), key=lambda i: expected[i])]


def test_constrained_helpers(backend):
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}},
        "required": ["age"],
        "additionalProperties": False,
    }

    @lang.function
    def typed(s):
        s += "The number of days in a week is " + gen_int("n", max_tokens=3, temperature=0) + ".\n"
        s += "A quoted word: " + gen_string("word", max_tokens=8, temperature=0) + "\n"
        s += "Code: " + gen("code", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=12, temperature=0) + "\n"
        s += "Bob is 30. As JSON: " + gen("obj", json_schema=schema, max_tokens=24, temperature=0)

    state = typed.run(backend=backend)
    assert re.fullmatch(lang.api.INT_REGEX, state["n"]) and isinstance(int(state["n"]), int)
    if state.get_meta_info("word")["finish_reason"]["type"] == "stop":
        assert re.fullmatch(lang.api.STRING_REGEX, state["word"])
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", state["code"])
    assert set(json.loads(state["obj"])) == {"age"}


def test_fork_reuses_cached_prefix(backend):
    nonce = uuid.uuid4().hex  # a prefix no earlier request has cached

    @lang.function
    def branches(s):
        s += system(f"Session {nonce}. You list ideas, one per line.")
        s += user("Give me an idea for a weekend trip.")
        forks = s.fork(3)
        forks += assistant(gen("idea", max_tokens=3, temperature=0.8))
        return [f.get_meta_info("idea") for f in forks]

    state = branches.run(backend=backend)
    assert len(state.ret_value) == 3
    for meta in state.ret_value:
        assert meta["cached_tokens"] > 0, meta


def test_run_batch_of_100(backend, capsys):
    @lang.function
    def tiny(s, i):
        s += f"Item {i}: the number after {i} is" + gen("x", max_tokens=1, temperature=0)

    states = tiny.run_batch([{"i": i} for i in range(100)], backend=backend)
    assert len(states) == 100 and all(st.text().startswith(f"Item {i}:") for i, st in enumerate(states))
    assert all(st.get_meta_info("x")["completion_tokens"] == 1 for st in states)
    assert "100/100" in capsys.readouterr().err


def test_streaming_matches_greedy(backend):
    @lang.function
    def story(s):
        s += user("Tell me a short story about a robot.")
        s += assistant(gen("story", max_tokens=8, temperature=0, ignore_eos=True))

    streamed = story.run(backend=backend, stream=True)
    chunks = list(streamed.text_iter("story"))
    plain = story.run(backend=backend)
    assert len(chunks) > 1
    assert "".join(chunks) == streamed["story"] == plain["story"]
    assert streamed.text() == plain.text()


def test_backend_error_carries_server_message(backend, server_url):
    @lang.function
    def bad(s):
        s += "x" + gen("y", regex="(unclosed", max_tokens=4)

    with pytest.raises(lang.BackendError) as info:
        bad.run(backend=backend)
    direct = requests.post(
        server_url + "/generate",
        json={"text": "x", "sampling_params": {"regex": "(unclosed", "max_new_tokens": 4}},
        timeout=60,
    )
    assert 400 <= direct.status_code < 500 and info.value.status == direct.status_code
    assert info.value.message == direct.json()["error"]["message"] != ""
    assert isinstance(info.value, RuntimeError)


def test_openai_backend(server_url, backend):
    model = requests.get(server_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    oai = lang.OpenAI(model, base_url=server_url + "/v1")

    @lang.function
    def chat(s):
        s += user("Name a color.")
        s += assistant(gen("color", max_tokens=8, temperature=0))

    assert chat.run(backend=oai)["color"] == chat.run(backend=backend)["color"]

    @lang.function
    def pick(s):
        s += "Q: Is fire hot?\nA:" + select("a", choices=[" yes", " no"])

    # radixlm's /v1/completions gives prompt logprobs with echo, so select works through the OpenAI backend
    assert pick.run(backend=oai)["a"] == pick.run(backend=backend)["a"]
    oai.close()


# --------------------------------------------------------------------------------------------- examples
EXAMPLES = {
    "few_shot_qa.py": ["--max-tokens", "4", "--num-questions", "2"],
    "multi_turn_chat.py": ["--max-tokens", "6", "--turns", "2"],
    "json_extraction.py": ["--max-tokens", "16"],
    "react_tool_loop.py": ["--max-steps", "2", "--max-tokens", "8"],
    "agent_tools.py": ["--max-steps", "2", "--max-tokens", "32"],
    "tree_of_thought.py": ["--branches", "2", "--max-tokens", "4"],
    "client_openai.py": ["--max-tokens", "4"],
    "client_curl.sh": [],
}


@pytest.mark.slow  # ~1 min each on a loaded 2-core CPU; `-m "not slow"` skips them
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(server_url, name):
    path = ROOT / "examples" / name
    runner = ["bash"] if name.endswith(".sh") else [sys.executable]
    proc = subprocess.run(
        [*runner, str(path), "--url", server_url, *EXAMPLES[name]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.strip()
