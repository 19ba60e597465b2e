"""Run SGLang's own frontend test programs (`sglang.test.test_programs`) against a radixlm server.

Run by tests/e2e/test_sglang_frontend.py in a subprocess whose PYTHONPATH holds the cached `sglang` frontend
(importing `sglang` patches transformers; the test process stays clean). Usage:

    python tests/e2e/sglang_frontend_programs.py URL TOKENIZER_DIR [SHARD SHARDS]

With SHARD and SHARDS it runs the programs of shard SHARD (0-based) of SHARDS, so that several processes run
them side by side against one server (the excluded ones are listed by shard 0): the programs are dealt
longest first (COST) to the shard with the least so far.
Prints one JSON line per program: name, outcome, seconds, detail, http_errors. Outcomes: "excluded" (cannot
run on this backend whatever the server: see EXCLUDED); "ok"; "content"
(the program's own assertion on the model's answer failed, or its answer did not parse: SGLang writes them
for 8B models); "protocol" (radixlm answered a request with an error status); "error" (anything else raised).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import types
import warnings

# Programs that cannot run through `sgl.RuntimeEndpoint`, against SGLang's own server as against radixlm.
EXCLUDED = {
    "test_image_qa": "needs a multimodal model (sends image_data; radixlm serves text models: a 400)",
    "test_completion_speculative": "API speculative execution: reads backend.token_usage, which only "
    "SGLang's OpenAI-style API backends have",
    "test_chat_completion_speculative": "API speculative execution: needs backend.is_chat_model/spec_fill "
    "(SGLang's OpenAI-style API backends only)",
}
CHECK_ANSWER_ARG = {"test_select", "test_parallel_encoding", "test_expert_answer"}
# Seconds a program took on the default model, alone, on 2 loaded cores; the others took 0.7-14 s (OTHER_COST)
COST = {"test_parallel_decoding": 88, "test_decode_json_regex": 61, "test_decode_int": 45, "test_stream": 40}
OTHER_COST = 8


def shard_programs(names: list[str], shard: int, shards: int) -> list[str]:
    """The programs of shard `shard`: dealt longest first to the shard with the least cost so far."""
    loads, mine = [0.0] * shards, []
    for name in sorted(names, key=lambda n: (-COST.get(n, OTHER_COST), n)):
        least = loads.index(min(loads))
        loads[least] += COST.get(name, OTHER_COST)
        if least == shard:
            mine.append(name)
    return sorted(mine)


def main(url: str, tokenizer_dir: str, shard: int = 0, shards: int = 1) -> None:
    import sglang as sgl
    import sglang.lang.backend.runtime_endpoint as rt_endpoint

    http_errors: list[str] = []
    real_request = rt_endpoint.http_request

    def recording_request(target, *args, **kwargs):
        res = real_request(target, *args, **kwargs)
        status = getattr(res, "status_code", None) or getattr(res, "status", None)
        if status != 200:
            try:
                body = res.json()
            except Exception:
                body = getattr(res, "text", "")
            http_errors.append(f"{status} {target.removeprefix(url)}: {str(body)[:300]}")
        return res

    rt_endpoint.http_request = recording_request
    _tokenizer_helper(tokenizer_dir)

    import sglang.test.test_programs as programs

    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    backend.endpoint = backend  # test_gen_min_new_tokens reads the model name through sgl.Runtime's .endpoint
    for name, why in sorted(EXCLUDED.items()) if shard == 0 else ():
        row = {"name": name, "outcome": "excluded", "seconds": 0.0, "detail": why, "http_errors": []}
        print(json.dumps(row), flush=True)
    names = sorted(n for n in dir(programs) if n.startswith("test_") and n not in EXCLUDED)
    for name in shard_programs(names, shard, shards):
        http_errors.clear()
        t0 = time.perf_counter()
        outcome, detail = "ok", ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = getattr(programs, name)
                fn(check_answer=True) if name in CHECK_ANSWER_ARG else fn()
            except (AssertionError, ValueError) as e:
                outcome, detail = "content", f"{type(e).__name__}: {e}"
            except Exception as e:
                outcome, detail = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
        executor_errors = [str(w.message) for w in caught if "Error in stream_executor" in str(w.message)]
        if http_errors:
            outcome = "protocol"
        elif executor_errors and outcome == "ok":
            outcome, detail = "error", executor_errors[0]
        row = {
            "name": name,
            "outcome": outcome,
            "seconds": round(time.perf_counter() - t0, 1),
            "detail": detail[:600],
            "http_errors": list(http_errors),
        }
        print(json.dumps(row), flush=True)


def _tokenizer_helper(tokenizer_dir: str) -> None:
    """test_gen_min_new_tokens counts tokens with `sglang.srt.utils.hf_transformers_utils.get_tokenizer`,
    whose module needs SGLang's server dependencies (torchvision, ...): give it the served model's tokenizer
    (what that helper would load) through transformers instead."""
    from transformers import AutoTokenizer

    module = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    module.get_tokenizer = lambda *_args, **_kw: AutoTokenizer.from_pretrained(tokenizer_dir)
    sys.modules[module.__name__] = module


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), sys.argv[2], *(int(a) for a in sys.argv[3:5]))
