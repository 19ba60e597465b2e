"""LoRA adapters end to end: a server started with two PEFT adapters answers each through the OpenAI `model`
field and the native `lora_path` with transformers + peft's greedy tokens (concurrently, so adapters and the
base model share batches), keeps their cached KV apart, lists them in /v1/models, loads and unloads adapters
under traffic (admin-only with an admin key) and answers every bad adapter with a 400 naming the problem."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import threading

import pytest
import requests
import torch

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle
from tests.lora_fixtures import ALL_TARGETS, peft_model, save_random_adapter

pytestmark = [pytest.mark.timeout(900), pytest.mark.model]

ADMIN = "lora-admin-key"
PROMPTS = [
    [7, 99, 23, 401, 5, 66, 310, 12, 88, 254, 19, 3, 140, 77, 260, 31, 9, 480],
    [11, 42, 300, 17, 256, 8, 91, 133, 402, 6, 77],
]
MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_e2e")
    return {
        "tenant-a": save_random_adapter(tiny_model_dir, root / "a", seed=21, rank=8, targets=ALL_TARGETS),
        "tenant-b": save_random_adapter(
            tiny_model_dir, root / "b", seed=22, rank=4, targets=["v_proj", "up_proj"]
        ),
        "late": save_random_adapter(
            tiny_model_dir, root / "c", seed=23, rank=16, targets=["o_proj", "gate_proj"]
        ),
        "too-big": save_random_adapter(tiny_model_dir, root / "big", seed=24, rank=32, targets=["q_proj"]),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """(adapter or None, prompt index) -> transformers (+ peft)'s greedy tokens."""
    from transformers import AutoModelForCausalLM

    models = {n: peft_model(tiny_model_dir, adapters[n]) for n in ("tenant-a", "tenant-b", "late")}
    models[None] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = {}
    for name, model in models.items():
        for i, prompt in enumerate(PROMPTS):
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(MAX_NEW):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out[(name, i)] = ids[len(prompt) :]
    return out


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model (same weights) with a chat template that renders messages as their bare text, so the
    rendered ids stay inside its 512-token vocabulary and every chat front end can run on it."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("lora_chat") / "model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def srv(chat_model_dir, adapters):
    server = ServerProcess(
        model=chat_model_dir,
        extra_args=[
            *("--dtype", "float32", "--quantization", "none", "--kv-cache-dtype", "float32"),
            *("--attention-backend", "torch_native", "--speculative-algorithm", "none"),
            *("--admin-api-key", ADMIN, "--max-loras", "2", "--max-lora-rank", "16"),
            "--lora-modules",
            f"tenant-a={adapters['tenant-a']}",
            f"tenant-b={adapters['tenant-b']}",
        ],
    ).start()
    yield server
    assert server.stop(grace_s=30) == 0, server.log_tail()


def completion(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
    r = requests.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def generate(url: str, prompt: list[int], lora: str | None, status: int = 200) -> dict:
    params = {"max_new_tokens": MAX_NEW, "temperature": 0}
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    if lora is not None:
        body["lora_path"] = lora
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == status, r.text
    return r.json()


def ids_of(result: dict) -> list[int]:
    return [entry[1] for entry in result["meta_info"]["output_token_logprobs"]]


def admin(url: str, route: str, body: dict, key: str | None = ADMIN) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + route, json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def test_models_lists_adapters_with_their_parent(srv, adapters):
    data = requests.get(srv.url + "/v1/models", timeout=30).json()["data"]
    base = data[0]["id"]
    listed = {m["id"]: m for m in data[1:]}
    assert set(listed) == {"tenant-a", "tenant-b"}
    assert listed["tenant-a"]["parent"] == base and listed["tenant-a"]["root"] == adapters["tenant-a"]


def test_each_adapter_equals_peft_in_mixed_batches(srv, expected):
    """Every (adapter, prompt) at once through both APIs, so batches mix adapters and the base model: the
    native answers' tokens are peft's, and the OpenAI answers' texts are the native answers' texts."""
    base = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    jobs = [
        (n, i, api) for n in ("tenant-a", None, "tenant-b") for i in range(2) for api in ("oai", "native")
    ]

    def run(job):
        name, i, api = job
        if api == "oai":
            return completion(srv.url, name or base, PROMPTS[i])["choices"][0]["text"]
        return generate(srv.url, PROMPTS[i], name)

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(run, jobs)))
    for name, i, api in jobs:
        if api == "native":
            native = results[(name, i, api)]
            assert ids_of(native) == expected[(name, i)], (name, i)
            assert results[(name, i, "oai")] == native["text"], (name, i)


def test_every_front_end_names_the_adapter_by_model(srv):
    """Chat completions, Responses and Messages with `model` naming an adapter give the same answer (the same
    prompt through the same template), one the base model does not give; an unknown name is a 404 on each."""
    base = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    text = "1234567"

    def answers(model: str) -> list[str]:
        msgs = [{"role": "user", "content": text}]
        common = {"model": model, "temperature": 0}
        bodies = {
            "/v1/chat/completions": {**common, "messages": msgs, "max_tokens": MAX_NEW},
            "/v1/responses": {**common, "input": text, "max_output_tokens": MAX_NEW},
            "/v1/messages": {**common, "messages": msgs, "max_tokens": MAX_NEW},
        }
        chat, resp, msg = (requests.post(srv.url + route, json=b, timeout=60) for route, b in bodies.items())
        if model == "nope":
            return [r.status_code for r in (chat, resp, msg)]
        assert [r.status_code for r in (chat, resp, msg)] == [200] * 3, (chat.text, resp.text, msg.text)
        return [
            chat.json()["choices"][0]["message"]["content"],
            resp.json()["output"][-1]["content"][0]["text"],
            msg.json()["content"][0]["text"],
        ]

    adapted, plain = answers("tenant-a"), answers(base)
    assert len(set(adapted)) == 1 and len(set(plain)) == 1, (adapted, plain)
    assert adapted[0] != plain[0], adapted
    assert answers("nope") == [404, 404, 404]


def test_dsl_programs_run_under_the_backends_adapter(srv):
    """A DSL program on a backend made with `lora=` runs every call under that adapter: its text is the
    native API's for the same prompt and adapter, and not the base model's."""
    import lang

    @lang.function
    def count(s):
        s += "1234567"
        s += lang.gen("rest", max_tokens=MAX_NEW, temperature=0)

    def native(lora):
        body = {"text": "1234567", "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
        if lora:
            body["lora_path"] = lora
        return requests.post(srv.url + "/generate", json=body, timeout=HTTP_TIMEOUT_S).json()["text"]

    adapted = count.run(backend=lang.RuntimeEndpoint(srv.url, lora="tenant-a"))["rest"]
    plain = count.run(backend=lang.RuntimeEndpoint(srv.url))["rest"]
    assert adapted == native("tenant-a") and plain == native(None) and adapted != plain
    with pytest.raises(ValueError, match="adapter's name"):
        lang.RuntimeEndpoint(srv.url, lora="")


def test_cache_is_per_adapter(srv):
    """A prompt cached under tenant-a is no hit for tenant-b or the base model, and a hit for tenant-a."""
    prompt = [5 + (k * 37) % 500 for k in range(40)]
    assert generate(srv.url, prompt, "tenant-a")["meta_info"]["cached_tokens"] == 0
    assert generate(srv.url, prompt, "tenant-b")["meta_info"]["cached_tokens"] == 0
    assert generate(srv.url, prompt, None)["meta_info"]["cached_tokens"] == 0
    for lora in ("tenant-a", "tenant-b", None):
        assert generate(srv.url, prompt, lora)["meta_info"]["cached_tokens"] == len(prompt) - 1, lora


def test_a_session_under_an_adapter_is_released_by_naming_it(srv):
    """A session's key holds its adapter's identity: DELETE takes the adapter's name (`lora`) to find it."""
    sid = "lora-session"
    body = {"input_ids": [7 + k for k in range(40)], "session_id": sid, "lora_path": "tenant-a"}
    body["sampling_params"] = {"max_new_tokens": 2, "temperature": 0}
    assert requests.post(srv.url + "/generate", json=body, timeout=HTTP_TIMEOUT_S).status_code == 200
    url = f"{srv.url}/v1/sessions/{sid}"
    assert requests.delete(url, timeout=HTTP_TIMEOUT_S).status_code == 404  # the base model's session of it
    wrong = requests.delete(url, params={"lora": "nobody"}, timeout=HTTP_TIMEOUT_S)
    assert wrong.status_code == 400 and "lora: LoRA adapter 'nobody' is not loaded" in wrong.text
    assert requests.delete(url, params={"lora": "tenant-b"}, timeout=HTTP_TIMEOUT_S).status_code == 404
    released = requests.delete(url, params={"lora": "tenant-a"}, timeout=HTTP_TIMEOUT_S)
    assert released.status_code == 200 and released.json()["released_tokens"] >= 40, released.text


def test_bad_adapters_are_400s(srv, adapters, tmp_path):
    def load(name: str, path: str, status: int, needle: str):
        r = admin(srv.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == status, r.text
        assert needle in r.text, r.text

    load("x", str(tmp_path / "missing"), 400, "is not a directory")
    load("x", adapters["too-big"], 400, "rank 32 is above --max-lora-rank (16)")
    load("tenant-a", adapters["late"], 400, "already loaded")
    broken = tmp_path / "broken"
    shutil.copytree(adapters["tenant-b"], broken)
    conf = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["lm_head"]}))
    load("x", str(broken), 400, "'lm_head'")
    r = admin(srv.url, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and "'nope' is not loaded" in r.text
    r = admin(srv.url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.text
    # requests naming what is not served
    r = requests.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": [5, 6]}, timeout=30)
    assert r.status_code == 404 and "tenant-a" in r.text
    assert "'nope' is not loaded" in generate(srv.url, PROMPTS[0], "nope", status=400)["error"]["message"]
    body = {"input_ids": [5, 6], "lora_path": 7}
    r = requests.post(srv.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "lora_path" in r.text
    # the server still serves
    assert generate(srv.url, PROMPTS[1], "tenant-b")["meta_info"]["completion_tokens"] == MAX_NEW


def test_load_and_unload_are_admin_operations(srv, adapters):
    r = admin(
        srv.url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}, key=None
    )
    assert r.status_code == 403
    r = admin(srv.url, "/v1/unload_lora_adapter", {"lora_name": "tenant-a"}, key="wrong")
    assert r.status_code in (401, 403)


def test_load_unload_under_traffic(srv, adapters, expected):
    """Requests of tenant-a, tenant-b and the base model keep flowing (three adapters over two slots once
    `late` is loaded) while `late` is loaded, used and unloaded: none fails and every answer is its own."""
    stop = threading.Event()
    failures: list[str] = []
    done = {"n": 0}

    def traffic(name):
        i = 0
        while not stop.is_set():
            try:
                got = ids_of(generate(srv.url, PROMPTS[i % 2], name))
                if got != expected[(name, i % 2)]:
                    failures.append(f"{name}: {got}")
                done["n"] += 1
            except AssertionError as e:
                failures.append(str(e))
            i += 1

    threads = [threading.Thread(target=traffic, args=(n,)) for n in ("tenant-a", "tenant-b", None)]
    for t in threads:
        t.start()
    try:
        r = admin(srv.url, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
        assert r.status_code == 200, r.text
        assert "late" in {m["id"] for m in requests.get(srv.url + "/v1/models", timeout=30).json()["data"]}
        for i in range(2):
            assert ids_of(generate(srv.url, PROMPTS[i], "late")) == expected[("late", i)]
        r = admin(srv.url, "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert r.status_code == 200, r.text
        generate(srv.url, PROMPTS[0], "late", status=400)
        r = requests.post(srv.url + "/v1/completions", json={"model": "late", "prompt": [5, 6]}, timeout=30)
        assert r.status_code == 404
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert done["n"] >= 6
    assert_no_kv_leak(wait_idle(srv.url))


def test_offline_engine_takes_lora_path(tiny_model_dir, adapters, expected):
    """The Engine passes `lora_path` through the same body parser: one adapter per prompt of a batch."""
    from runtime.engine import Engine

    engine = Engine(
        model=tiny_model_dir,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        attention_backend="torch_native",
        speculative_algorithm="none",
        lora_modules=(f"tenant-a={adapters['tenant-a']}",),
    )
    try:
        params = {"max_new_tokens": MAX_NEW, "temperature": 0}
        out = engine.generate(
            input_ids=[PROMPTS[0], PROMPTS[0]],
            sampling_params=params,
            return_logprob=True,
            lora_path=["tenant-a", None],
        )
        assert [ids_of(r) for r in out] == [expected[("tenant-a", 0)], expected[(None, 0)]]
    finally:
        engine.shutdown()
