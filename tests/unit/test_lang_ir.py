"""The DSL without a model: IR building, sampling kwargs, chat-template rendering, and the interpreter driven
by a toy native backend (one token per character, deterministic logprobs), in-process and over a fake HTTP
server.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import lang
from lang.backends.native import NativeBackend
from lang.backends.runtime_endpoint import error_message, parse_sse
from lang.chat_template import ChatTemplate
from lang.ir import ExprList, Gen, RoleBegin, RoleEnd, Select, Text

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ALTERNATING = (  # Mistral-style: raises on a wrong order, marks assistant text with {% generation %}
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
)
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


# --------------------------------------------------------------------------------------------- toy backend
def toy_tokenize(text: str) -> list[str]:
    """One token per character, except that a space joins the character after it (" y"), so that a choice can
    merge with a prompt ending in a space, as with real BPE vocabularies."""
    return re.findall(r" [^ ]|.", text, re.S)


def toy_id(token: str) -> int:
    return int.from_bytes(token.encode(), "big")


def toy_logprob(n_prefix: int, token: str) -> float:
    """log P(token | prefix of n_prefix tokens) of the toy model: depends on both, always < 0."""
    return -((toy_id(token) * 7 + n_prefix) % 13 + 1) / 10


class ToyServer:
    """The native /generate protocol over a character-level toy model; records every request body."""

    def __init__(self, template: str = SMOLLM2, null_first: bool = False, reply: str = "hello world") -> None:
        self.template, self.null_first, self.reply = template, null_first, reply
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        return {"model_path": "toy", "chat_template": self.template, **TOKENS}

    def handle(self, body: dict[str, Any]) -> Any:
        with self.lock:
            self.bodies.append(body)
        if isinstance(body["text"], list):
            return [self.handle_one({**body, "text": t}) for t in body["text"]]
        return self.handle_one(body)

    def handle_one(self, body: dict[str, Any]) -> dict[str, Any]:
        text, params = body["text"], body["sampling_params"]
        if params.get("temperature") == 99:
            raise ValueError("temperature must be in [0, 100], got 99 (toy refusal)")
        out = self.reply[: params.get("max_new_tokens", 128)]
        toks = toy_tokenize(text)
        meta: dict[str, Any] = {"prompt_tokens": len(toks), "completion_tokens": len(out), "cached_tokens": 0}
        meta["finish_reason"] = {"type": "length" if len(out) < len(self.reply) else "stop"}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", 0)
            assert 0 <= start < len(toks), "the server rejects logprob_start_len >= prompt length"
            entries = [[toy_logprob(p, toks[p]), toy_id(toks[p]), None] for p in range(start, len(toks))]
            if self.null_first and entries:
                entries[0][0] = None
            meta["input_token_logprobs"] = entries
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        full = self.handle_one(body)
        return [{"text": full["text"][: i + 1], "meta_info": {}} for i in range(len(full["text"]))] + [full]


class ToyBackend(NativeBackend):
    def __init__(self, server: ToyServer) -> None:
        super().__init__()
        self.server = server

    def request(self, body: dict[str, Any]) -> Any:
        try:
            return self.server.handle(body)
        except ValueError as e:
            raise lang.BackendError(str(e), 400) from e

    def request_stream(self, body: dict[str, Any]):
        try:
            chunks = self.server.stream(body)
        except ValueError as e:
            raise lang.BackendError(str(e), 400) from e
        yield from chunks

    def model_info(self) -> dict[str, Any]:
        return self.server.info()


def toy_score(prompt: str, choice: str) -> float:
    """Mean logprob of the tokens of prompt+choice from where they diverge from the prompt's tokens."""
    head, full = toy_tokenize(prompt), toy_tokenize(prompt + choice)
    d = next(i for i in range(len(full)) if i >= len(head) or full[i] != head[i])
    return sum(toy_logprob(p, full[p]) for p in range(d, len(full))) / (len(full) - d)


@pytest.fixture
def toy() -> ToyServer:
    return ToyServer()


@pytest.fixture
def backend(toy: ToyServer) -> ToyBackend:
    return ToyBackend(toy)


# --------------------------------------------------------------------------------------------- IR and kwargs
def test_plus_builds_flat_lists_and_roles_wrap_their_body():
    expr = "Q: " + lang.gen("a", max_tokens=3) + "\n" + lang.select("b", choices=["x", "y"])
    assert isinstance(expr, ExprList)
    assert [type(i) for i in expr.items] == [Text, Gen, Text, Select]
    role = lang.assistant("hi " + lang.gen("g"))
    assert role.items[0] == RoleBegin("assistant") and role.items[-1] == RoleEnd("assistant")
    assert [type(i) for i in role.items] == [RoleBegin, Text, Gen, RoleEnd]
    with pytest.raises(TypeError):
        lang.user("x") + 3  # noqa: B018


def test_gen_kwargs_use_sampling_params_names_and_are_validated_early():
    g = lang.gen("x", max_tokens=5, stop="\n", temperature=0, json_schema={"type": "integer"})
    assert g.sampling == {
        "max_new_tokens": 5,
        "stop": ["\n"],
        "temperature": 0,
        "json_schema": '{"type": "integer"}',
    }
    assert lang.gen("x").sampling == {}  # unset values are left to the server
    with pytest.raises(ValueError, match="unknown sampling parameter 'max_length'"):
        lang.gen("x", max_length=3)
    with pytest.raises(ValueError, match="top_p"):
        lang.gen("x", top_p=0)
    assert lang.gen_int("n").sampling["regex"] == lang.api.INT_REGEX
    with pytest.raises(ValueError, match="choices"):
        lang.select("s", choices="yes")


# --------------------------------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("template", [SMOLLM2, LLAMA3, ALTERNATING])
def test_role_affixes_reproduce_transformers_rendering(template: str):
    tpl = ChatTemplate(template, TOKENS)
    roles = (
        ["user", "assistant", "user", "assistant"]
        if template == ALTERNATING
        else ["system", "user", "assistant", "user", "assistant"]
    )
    history: list[dict[str, str]] = []
    text = ""
    for i, role in enumerate(roles):
        prefix, suffix = tpl.role_affixes(history, role)
        content = f"message {i} from {role}"
        text += prefix + content + suffix
        history.append({"role": role, "content": content})
        expected = render_jinja_template([history], chat_template=template, **TOKENS)[0][0]
        assert text == expected


def test_template_errors_are_program_errors():
    tpl = ChatTemplate(ALTERNATING, TOKENS)
    with pytest.raises(lang.ProgramError, match="roles must alternate"):
        tpl.role_affixes([], "assistant")
    with pytest.raises(lang.ProgramError, match="no chat template"):
        ChatTemplate(None).role_affixes([], "user")


# --------------------------------------------------------------------------------------------- interpreter
@lang.function
def chat(s, question):
    s += lang.system("Be brief.")
    s += lang.user(question)
    s += lang.assistant(lang.gen("answer", max_tokens=5))


def test_program_text_equals_chat_template_output(backend: ToyBackend, toy: ToyServer):
    state = chat.run(question="Why?", backend=backend)
    assert state["answer"] == "hello"
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "hello"},
    ]
    assert state.text() == render_jinja_template([state.messages()], chat_template=SMOLLM2, **TOKENS)[0][0]
    # The gen saw the conversation up to the assistant header and stops at the role's end token.
    body = toy.bodies[-1]
    assert body["text"].endswith("<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    assert body["sampling_params"] == {"max_new_tokens": 5, "stop": ["<|im_end|>"]}
    assert state.get_meta_info("answer")["completion_tokens"] == 5


def test_run_kwargs_split_into_program_args_and_sampling_defaults(backend: ToyBackend, toy: ToyServer):
    @lang.function
    def prog(s, temperature_label):
        s += temperature_label + lang.gen("a", max_tokens=2) + lang.gen("b", temperature=0.5)

    state = prog.run(temperature_label="T:", temperature=0, max_tokens=4, backend=backend)
    assert state.text() == "T:hehell"
    assert [b["sampling_params"] for b in toy.bodies] == [
        {"temperature": 0, "max_new_tokens": 2},
        {"temperature": 0.5, "max_new_tokens": 4},
    ]


def test_role_misuse_is_reported(backend: ToyBackend):
    @lang.function
    def nested(s):
        s += lang.user_begin()
        s += lang.assistant("x")

    with pytest.raises(lang.ProgramError, match="inside the open 'user' block"):
        nested.run(backend=backend)

    @lang.function
    def unmatched(s):
        s += lang.user_begin() + "x" + lang.assistant_end()

    with pytest.raises(lang.ProgramError, match="assistant_end without a matching"):
        unmatched.run(backend=backend)


@pytest.mark.parametrize("null_first", [False, True])
@pytest.mark.parametrize("prompt", ["Answer:", "Answer: "])  # the second merges with each choice's first char
def test_select_scores_mean_choice_logprob_with_one_prefill(null_first: bool, prompt: str):
    toy = ToyServer(null_first=null_first)
    backend = ToyBackend(toy)
    choices = ["yes", " no", "maybe"]

    @lang.function
    def pick(s):
        s += prompt + lang.select("v", choices=choices)

    state = pick.run(backend=backend)
    expected = [toy_score(prompt, c) for c in choices]
    meta = state.get_meta_info("v")
    assert meta["normalized_logprobs"] == pytest.approx(expected)
    assert meta["choice_tokens"] == [
        3,
        2,
        5,
    ]  # "Answer: "+"yes" re-scores " y" (merged), "Answer:  no" does not
    assert state["v"] == choices[max(range(3), key=lambda i: expected[i])]
    assert state.text() == prompt + state["v"]
    prefill, batch = toy.bodies  # one prefill of the shared prompt, then one batch
    assert prefill.pop("program_id") == batch["program_id"]  # both calls of one run: one program
    assert prefill == {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
    assert batch["text"] == [prompt] + [prompt + c for c in choices] and batch["return_logprob"] is True
    assert batch["logprob_start_len"] == len(toy_tokenize(prompt)) - 2


def test_fork_prefills_prefix_and_forks_are_independent(backend: ToyBackend, toy: ToyServer):
    @lang.function
    def tree(s):
        s += "Root. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}: "
        forks += lang.gen("x", max_tokens=2)
        s += " | ".join(f["x"] + "/" + f.text() for f in forks)

    state = tree.run(backend=backend)
    # every call of the run, the forks' included, names the run's one program id
    assert len({b.pop("program_id") for b in toy.bodies}) == 1
    assert toy.bodies[0] == {"text": "Root. ", "sampling_params": {"max_new_tokens": 0}}
    assert sorted(b["text"] for b in toy.bodies[1:]) == [f"Root. Branch {i}: " for i in range(3)]
    assert state.text() == "Root. " + " | ".join(f"he/Root. Branch {i}: he" for i in range(3))
    assert "x" not in state  # forks' variables stay in the forks


def test_each_run_of_run_batch_is_a_program_of_its_own(backend: ToyBackend, toy: ToyServer):
    @lang.function
    def two_calls(s, topic):
        s += f"About {topic}: " + lang.gen("a", max_tokens=2)
        s += " More: " + lang.gen("b", max_tokens=2)

    two_calls.run_batch([{"topic": t} for t in "xyz"], backend=backend, progress_bar=False)
    ids: dict[str, set[str]] = {}
    for body in toy.bodies:
        ids.setdefault(body["text"].split(":")[0], set()).add(body["program_id"])
    assert sorted(ids) == ["About x", "About y", "About z"]
    assert all(len(v) == 1 for v in ids.values())  # a run's two calls: one program
    assert len(set().union(*ids.values())) == 3  # three runs: three programs
    pinned = ToyBackend(toy)
    pinned.options = {"program_id": "mine"}
    assert pinned._body("t", {}, "auto-id")["program_id"] == "mine"  # the options' own id wins


def test_run_batch_gives_every_call_of_a_run_its_runs_program_id_forks_included(
    backend: ToyBackend, toy: ToyServer
):
    @lang.function
    def tree(s, topic):
        s += f"About {topic}. "
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Branch {i}: "
        forks += lang.gen("x", max_tokens=2)
        s += "Then: " + lang.gen("y", max_tokens=2)

    tree.run_batch([{"topic": t} for t in "xyz"], backend=backend, progress_bar=False)
    ids: dict[str, list[str]] = {}
    for body in toy.bodies:
        ids.setdefault(body["text"].split(".")[0], []).append(body["program_id"])
    assert sorted(ids) == ["About x", "About y", "About z"]
    assert all(len(v) == 4 for v in ids.values())  # the prefill, two forks' gens and the run's own gen
    assert all(len(set(v)) == 1 for v in ids.values())  # ... all under the run's one program id
    assert len({v[0] for v in ids.values()}) == 3  # three runs: three programs


def test_stream_yields_chunks_and_final_text(backend: ToyBackend):
    state = chat.run(question="Why?", backend=backend, stream=True)
    chunks = list(state.text_iter("answer"))
    assert len(chunks) == 5 and "".join(chunks) == "hello" == state["answer"]
    assert "".join(state.text_iter()) == state.text()
    assert state.text() == chat.run(question="Why?", backend=backend).text()


def test_backend_errors_surface_with_the_server_message(backend: ToyBackend):
    @lang.function
    def bad(s):
        s += "a" + lang.gen("x", temperature=99)

    with pytest.raises(lang.BackendError, match="toy refusal") as info:
        bad.run(backend=backend)
    assert isinstance(info.value, RuntimeError) and info.value.status == 400
    state = bad.run(backend=backend, stream=True)
    with pytest.raises(lang.BackendError, match="toy refusal"):
        list(state.text_iter())
    with pytest.raises(lang.BackendError):
        state.text()


def test_run_batch_keeps_order_shows_progress_and_reports_failures(backend: ToyBackend, capsys):
    @lang.function
    def echo(s, i):
        s += f"{i}:" + lang.gen("x", max_tokens=i % 4, temperature=99 if i == 7 else 0)

    batch = [{"i": i} for i in range(10)]
    states = echo.run_batch(batch, backend=backend, num_threads=4, return_exceptions=True)
    assert "10/10" in capsys.readouterr().err
    assert isinstance(states[7], lang.BackendError)
    assert [s.text() for i, s in enumerate(states) if i != 7] == [
        f"{i}:" + "hello world"[: i % 4] for i in range(10) if i != 7
    ]
    with pytest.raises(lang.BackendError):
        echo.run_batch(batch, backend=backend, progress_bar=False)


def test_default_backend_and_missing_backend(backend: ToyBackend):
    lang.set_default_backend(None)
    with pytest.raises(lang.ProgramError, match="no backend"):
        chat.run(question="q")
    lang.set_default_backend(backend)
    try:
        assert chat.run(question="q")["answer"] == "hello"
    finally:
        lang.set_default_backend(None)


# --------------------------------------------------------------------------------------------- HTTP transport
def test_sse_and_error_parsing():
    lines = [b'data: {"text": "a"}', b"", b": ping", b'data: {"text": "ab"}', b"data: [DONE]", b"data: x"]
    assert [c["text"] for c in parse_sse(lines)] == ["a", "ab"]
    with pytest.raises(lang.BackendError, match="boom"):
        list(parse_sse([b'data: {"error": {"message": "boom"}}']))
    assert error_message(b'{"error": {"message": "bad regex"}}') == "bad regex"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"plain failure") == "plain failure"


@pytest.fixture
def http_toy(toy: ToyServer):
    """A fake radixlm HTTP server in a thread (requires `Authorization: Bearer k`)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(200, toy.info())

        def do_POST(self) -> None:
            if self.headers.get("Authorization") != "Bearer k":
                return self._reply(401, {"error": {"message": "invalid API key"}})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                if not body.get("stream"):
                    return self._reply(200, toy.handle(body))
                chunks = toy.stream(body)
            except ValueError as e:
                return self._reply(400, {"error": {"message": str(e)}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_runtime_endpoint_over_http(http_toy: str):
    backend = lang.RuntimeEndpoint(http_toy, api_key="k", timeout=10)
    state = chat.run(question="Why?", backend=backend)
    assert state["answer"] == "hello"
    assert state.text().endswith("<|im_start|>assistant\nhello<|im_end|>\n")
    streamed = chat.run(question="Why?", backend=backend, stream=True)
    assert list(streamed.text_iter("answer")) == list("hello")

    @lang.function
    def pick(s):
        s += "Answer: " + lang.select("v", choices=["yes", "no"])

    assert pick.run(backend=backend)["v"] == max(["yes", "no"], key=lambda c: toy_score("Answer: ", c))
    with pytest.raises(lang.BackendError, match="invalid API key") as info:
        chat.run(question="q", backend=lang.RuntimeEndpoint(http_toy))
    assert info.value.status == 401
    with pytest.raises(lang.BackendError, match="toy refusal"):
        chat.run(question="q", backend=backend, temperature=99)
    backend.close()


# --------------------------------------------------------------------------------------------- other backends
class FakeEngine:
    """`runtime.Engine`'s generate() contract over the toy server; raises like the runtime's RequestError."""

    class RequestError(Exception):
        def __init__(self, message: str, status: int = 400) -> None:
            super().__init__(message)
            self.message, self.status = message, status

    def __init__(self, toy: ToyServer) -> None:
        self.toy = toy
        self.tokenizer = type("Tok", (), {"chat_template": SMOLLM2, "special_tokens_map": TOKENS})()
        self.calls: list[dict[str, Any]] = []

    def generate(
        self, prompt, sampling_params, return_logprob=False, logprob_start_len=None, stream=False, **kw
    ):
        self.calls.append(
            {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len, "stream": stream}
        )
        body = {
            "text": prompt,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len or 0,
        }
        try:
            return iter(self.toy.stream(body)) if stream else self.toy.handle(body)
        except ValueError as e:
            raise self.RequestError(str(e)) from None


def test_engine_backend_maps_the_protocol_and_errors(toy: ToyServer):
    engine = FakeEngine(toy)
    backend = lang.EngineBackend(engine)
    state = chat.run(question="Why?", backend=backend)
    assert state["answer"] == "hello" and state.text().startswith("<|im_start|>system\nBe brief.")
    assert list(chat.run(question="Why?", backend=backend, stream=True).text_iter("answer")) == list("hello")

    @lang.function
    def pick(s):
        s += "Answer: " + lang.select("v", choices=["yes", "no"])

    assert pick.run(backend=backend)["v"] == max(["yes", "no"], key=lambda c: toy_score("Answer: ", c))
    assert engine.calls[-1] == {"return_logprob": True, "logprob_start_len": 6, "stream": False}
    with pytest.raises(lang.BackendError, match="toy refusal") as info:
        chat.run(question="q", backend=backend, temperature=99)
    assert info.value.status == 400


def test_openai_backend_request_mapping():
    pytest.importorskip("openai")
    backend = lang.OpenAI("m", base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0)
    schema = '{"type": "object"}'
    sampling = {"max_new_tokens": 8, "temperature": 0, "top_k": 5, "json_schema": schema, "stop": ["\n"]}
    chat_prompt = lang.backends.Prompt("ignored", ({"role": "user", "content": "hi"},), "assistant", "")
    use_chat, args = backend._request_args(chat_prompt, sampling)
    assert use_chat and args["messages"] == [{"role": "user", "content": "hi"}]
    assert args["max_tokens"] == 8 and args["temperature"] == 0 and args["stop"] == ["\n"]
    assert args["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert args["extra_body"] == {"top_k": 5}
    text_prompt = lang.backends.Prompt("Q: x\nA:", (), None, "")
    use_chat, args = backend._request_args(text_prompt, {"regex": "[0-9]+"})
    assert not use_chat and args["prompt"] == "Q: x\nA:" and args["extra_body"] == {"regex": "[0-9]+"}
    with pytest.raises(lang.BackendError, match="select"):  # nothing listens on port 9
        backend.select(text_prompt, ["a", "b"])
    backend.close()
