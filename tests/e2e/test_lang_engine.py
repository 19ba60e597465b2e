"""The DSL on an in-process `runtime.Engine` through `EngineBackend` (no HTTP)."""

from __future__ import annotations

import os

import pytest

import lang
from lang import assistant, gen, select, user

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    from runtime import Engine
except ImportError as e:  # the runtime is being built alongside the DSL
    pytest.skip(f"runtime.Engine is not importable: {e}", allow_module_level=True)


@pytest.fixture(scope="module")
def backend():
    engine = Engine(
        model="default", max_total_tokens=4000, dtype="float32", quantization="none", kv_cache_dtype="float32"
    )
    try:
        yield lang.EngineBackend(engine)
    finally:
        engine.shutdown()


@lang.function
def chat(s, question):
    s += user(question)
    s += assistant(gen("answer", max_tokens=10, temperature=0, ignore_eos=True))
    s += user("Was that helpful? Answer yes or no.")
    s += assistant(select("verdict", choices=["yes", "no"]))


def test_program_runs_on_engine(backend):
    state = chat.run(question="What is the capital of France?", backend=backend)
    assert state.get_meta_info("answer")["completion_tokens"] == 10
    assert state["verdict"] in ("yes", "no")
    assert len(state.get_meta_info("verdict")["normalized_logprobs"]) == 2
    assert state.text().endswith(f"<|im_start|>assistant\n{state['verdict']}<|im_end|>\n")

    streamed = chat.run(question="What is the capital of France?", backend=backend, stream=True)
    chunks = list(streamed.text_iter("answer"))
    assert len(chunks) > 1 and "".join(chunks) == state["answer"]
    assert streamed.text() == state.text()


def test_fork_and_errors_on_engine(backend):
    @lang.function
    def tree(s):
        s += user("List a fruit.")
        forks = s.fork(2)
        forks += assistant(gen("x", max_tokens=3, temperature=0))
        return [f.get_meta_info("x")["cached_tokens"] for f in forks]

    assert all(c > 0 for c in tree.run(backend=backend).ret_value)

    @lang.function
    def bad(s):
        s += "x" + gen("y", regex="(unclosed", max_tokens=4)

    with pytest.raises(lang.BackendError):
        bad.run(backend=backend)


def test_engine_backend_sends_its_request_options(backend):
    """`EngineBackend(engine, options=...)` carries the options to the scheduler like a body does."""
    engine = backend.engine
    before = engine.server_info()
    with_options = lang.EngineBackend(engine, options={"session_id": "dsl-engine", "priority": -2})
    chat.run(question="Name a colour.", backend=with_options)
    after = engine.server_info()
    assert after["requests_prioritized"] > before["requests_prioritized"]
    assert after["sessions_pinned"] == before["sessions_pinned"] + 1
    with pytest.raises(ValueError, match="unknown request option"):
        lang.EngineBackend(engine, options={"sesion_id": "typo"})
