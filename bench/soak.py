"""Soak test: N minutes of mixed load against a radixlm server, watching for leaks and errors.

Load (seeded): native /generate streaming and not, OpenAI chat streaming and not, n > 1, constrained output
(when the server accepts it), prompts sharing prefixes (radix cache), clients that vanish mid-stream or mid-
request, /abort_request of running requests, and hostile requests (each must get its expected status: bodies
that once took a server down, oversized fields, a cross-site text/plain abort, a deadline). A sampler records
the RSS of the server and each child and /get_server_info over time. Burst phases (`--bursts`, spread over
the run) open `--burst-size` streaming chat requests at once beside that load (bench/burst.py's client); the
scheduler's RSS after the last burst may exceed its RSS after the first by at most BURST_GROWTH_MB_PER_1K per
1,000 burst requests in between plus BURST_GROWTH_SLACK_MB (the mixed load's own transients). At the end the
server must be idle with every KV slot free or cached, and a flush must free them all.

With `--tenants N` the server it starts takes an --api-keys-file of N tenants: each client thread and each
burst sends one tenant's key, and a `tenant_probe` request kind looks for cross-tenant observations: a
tenant caches a fresh prompt under a session, then another tenant sends the same prompt naming the same
session, and must find none of it cached and get no cache-miss explanation. Any observation fails the run.

    python -m bench.soak --minutes 10               # starts its own server on a free port
    python -m bench.soak --minutes 2 --url http://127.0.0.1:30000 --server-pid 1234
    python -m bench.soak --minutes 10 --tenants 2 --out bench/results/soak_two_tenants.json

Prints a summary table and writes bench/results/soak.json and soak.png (or --out) (a server it starts logs to
$TMPDIR/radixlm-soak-server-<pid>.log). Exit status 1 if the accounting check fails, the server died, any
request got a 5xx other than an overload 503, the bursts' growth bound is missed, or a tenant observed
another's data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from bench.harness import common

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIXES = (
    "You are a helpful assistant. Answer briefly.\n",
    "You are a pirate. Stay in character and use nautical words in every answer.\n",
    "System: the user is a student of chemistry. Explain step by step, with one example.\n",
)
QUESTIONS = (
    "What is the boiling point of water?",
    "Name three prime numbers.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What does a compiler do?",
    "How many legs does a spider have?",
)
REGEX = r"(yes|no), because [a-z ]{5,20}\."
BURST_GROWTH_MB_PER_1K = 50.0  # bench/burst.py's target, per 1,000 burst requests
BURST_GROWTH_SLACK_MB = 64.0  # what the soak's own mixed requests hold at any moment
SCHEMA = {
    "type": "object",
    "required": ["answer", "confidence"],
    "properties": {
        "answer": {"type": "string", "maxLength": 20},
        "confidence": {"type": "integer", "maximum": 99},
    },
}
# request kind -> weight in the mix
MIX = {"plain": 4, "stream": 3, "chat": 2, "chat_stream": 2, "n_choices": 1, "constrained": 2}
MIX.update({"drop_stream": 1, "drop_plain": 1, "abort": 1, "hostile": 2, "tenant_probe": 1})
# A probe's prompt is ~200 tokens of random words after "Repeat: ": the other tenant may find the head its
# own earlier probes share with it cached (a few tokens), never the words (a leak shows as ~200).
PROBE_CACHED_MAX = 16


class CrossTenant(Exception):
    """A tenant's request observed another tenant's data."""


class Tenants:
    """--tenants N: the keys file the started server reads, and each tenant's key (plus an admin's)."""

    def __init__(self, count: int, directory: Path):
        self.names = [f"tenant{i}" for i in range(count)]
        self.keys = {name: f"soak-{name}-{os.urandom(8).hex()}" for name in [*self.names, "ops"]}
        self.path = directory / "soak-api-keys"
        lines = [f"{key} {name}{' admin' if name == 'ops' else ''}" for name, key in self.keys.items()]
        self.path.write_text("\n".join(lines) + "\n")
        self.path.chmod(0o600)

    def headers(self, name: str = "ops") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[name]}"}


NULLABLE = {"type": ["string", "null"]}
ROLE_REF = {"type": "object", "properties": {"apiGroup": NULLABLE, "kind": NULLABLE, "name": NULLABLE},
            "required": ["apiGroup", "kind", "name"]}  # fmt: skip


def _deep_schema_body(depth: int) -> bytes:
    """A /generate body whose json_schema nests `depth` objects: raw bytes (json.dumps would recurse)."""
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    return b'{"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": ' + schema.encode() + b"}}"


# (name, path, JSON body or raw bytes, content type, expected status). Raw bytes go as they are.
HOSTILE = [
    ("roleref_jump_forward", "/generate", {"text": "JSON: ", "sampling_params": {
        "max_new_tokens": 64, "temperature": 0, "json_schema": ROLE_REF}}, "application/json", 200),
    ("oov_stop_ids_min_tokens", "/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 8, "min_new_tokens": 4, "stop_token_ids": [10**9]}}, "application/json", 400),
    ("oov_stop_ids_openai", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 8,
        "min_tokens": 4, "stop_token_ids": [10**9]}, "application/json", 400),
    ("text_plain_abort_all", "/abort_request", b"{}", "text/plain", 415),
    ("deep_schema", "/generate", _deep_schema_body(3000), "application/json", 400),
    ("huge_stop_string", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4,
        "stop": ["s" * 100_000]}}, "application/json", 400),
    ("long_rid", "/generate", {"text": "x", "rid": "r" * 100_000, "sampling_params": {
        "max_new_tokens": 2}}, "application/json", 400),
    ("n_seed_int64_max", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 2,
        "temperature": 0.8, "seed": 2**63 - 1}}, "application/json", 200),
    ("deadline", "/generate", {"text": "A long story:", "timeout": 0.3, "sampling_params": {
        "max_new_tokens": 4000, "ignore_eos": True}}, "application/json", 504),
]  # fmt: skip
INFO_KEYS = ("num_running_reqs", "num_queued_reqs", "requests_in_flight", "free_slots", "cache_tokens")
FINAL_KEYS = ("free_slots", "cache_tokens", "request_held_tokens", "max_total_tokens", "requests_aborted")


@dataclass
class Record:
    t: float  # start, seconds since the run began
    kind: str
    latency: float
    status: int  # HTTP status; 0 = no response (the client left on purpose, or a transport error)
    tokens: int
    error: str = ""
    expected: int = 0  # hostile requests: the status they must get (0: any success)
    tenant: str = ""  # whose key sent it (--tenants)


# ---- the server process ----------------------------------------------------------------------------------
def start_server(extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "runtime.launch_server", "--model", "default", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log_path.open("w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} during startup; see {log_path}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("server did not become healthy in 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and stops its children), SIGKILL to its group after 120 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def process_roles(pid: int) -> dict[str, str]:
    """pid -> role: the server, and its children told apart by the ipc:// socket each binds."""
    paths = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and "radixlm-ipc-" in f[7]:
            paths[f"socket:[{f[6]}]"] = os.path.basename(f[7])
    roles = {}
    for p in process_tree(pid):
        held = set()
        for fd in Path(f"/proc/{p}/fd").glob("*"):
            try:
                held.add(paths.get(os.readlink(fd)))
            except OSError:  # closed while we looked
                continue
        bound = sorted(held - {None, "tokenizer"}) if p != pid else ["http+tokenizer"]
        try:
            helper = (
                "resource_tracker"
                if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes()
                else "helper"
            )
        except OSError:
            helper = "helper"
        roles[str(p)] = bound[0] if bound else helper
    return roles


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ---- load --------------------------------------------------------------------------------------------------
class Load:
    """Request kinds are `do_<kind>` methods returning (HTTP status or 0, completion tokens)."""

    def __init__(self, url: str, seed: int, max_new: int, constrained: bool, tenants: Tenants | None = None):
        self.url, self.seed, self.max_new, self.constrained = url, seed, max_new, constrained
        self.tenants = tenants
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.local = threading.local()  # the worker thread's tenant

    @property
    def tenant(self) -> str:
        return getattr(self.local, "tenant", "")

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        if self.tenants is None:
            return {}
        return self.tenants.headers(tenant or self.tenant)

    def worker(self, wid: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + wid)
        if self.tenants is not None:
            self.local.tenant = self.tenants.names[wid % len(self.tenants.names)]
        kinds = [k for k in MIX if k != "constrained" or self.constrained]
        if self.tenants is None or len(self.tenants.names) < 2:
            kinds.remove("tenant_probe")
        first_pass = kinds[wid % len(kinds) :] + kinds[: wid % len(kinds)]  # every kind early, then the mix
        while time.monotonic() < deadline:
            kind = first_pass.pop(0) if first_pass else rng.choices(kinds, [MIX[k] for k in kinds])[0]
            start = time.monotonic()
            expected = 0
            try:
                if kind == "hostile":
                    (status, tokens, expected), err = self.do_hostile(rng), ""
                else:
                    (status, tokens), err = getattr(self, "do_" + kind)(rng), ""
            except requests.RequestException as e:
                status, tokens, err = 0, 0, f"{type(e).__name__}: {e}"[:200]
            except CrossTenant as e:
                status, tokens, err = 200, 0, f"cross_tenant: {e}"[:400]
            with self.lock:
                self.records.append(
                    Record(start - self.t0, kind, time.monotonic() - start, status, tokens, err, expected,
                           self.tenant)
                )  # fmt: skip

    # -- building blocks
    def prompt(self, rng: random.Random) -> str:
        return rng.choice(PREFIXES) + rng.choice(QUESTIONS)

    def params(self, rng: random.Random, **extra) -> dict:
        p = {"max_new_tokens": rng.randint(4, self.max_new), "temperature": 0}
        if rng.random() < 0.5:
            p.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 1 << 30))
        return {**p, **extra}

    def chat_body(self, rng: random.Random) -> dict:
        p = self.params(rng)
        messages = [{"role": "system", "content": rng.choice(PREFIXES)}]
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        return {"model": "default", "max_tokens": p["max_new_tokens"], "temperature": p["temperature"],
                "messages": messages}  # fmt: skip

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict | list | None]:
        r = requests.post(self.url + path, json=body, timeout=timeout, headers=self.headers())
        return r.status_code, r.json() if r.status_code == 200 else None

    def stream(self, path: str, body: dict, stop_after: int | None = None) -> tuple[int, int]:
        body = {**body, "stream": True}
        with requests.post(self.url + path, json=body, stream=True, timeout=300, headers=self.headers()) as r:
            if r.status_code != 200:
                return r.status_code, 0
            events, last = 0, None
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                events, last = events + 1, json.loads(line[6:])
                if "error" in last:  # a failure after the 200 went out
                    return int(last["error"].get("code") or 500), 0
                if stop_after is not None and events >= stop_after:
                    return 0, events  # vanish mid-stream
        if path == "/generate":
            return 200, last["meta_info"]["completion_tokens"] if last else 0
        return 200, events

    # -- request kinds
    def do_plain(self, rng):
        status, out = self.post("/generate", {"text": self.prompt(rng), "sampling_params": self.params(rng)})
        return status, out["meta_info"]["completion_tokens"] if out else 0

    def do_stream(self, rng):
        return self.stream("/generate", {"text": self.prompt(rng), "sampling_params": self.params(rng)})

    def do_chat(self, rng):
        status, out = self.post("/v1/chat/completions", self.chat_body(rng))
        return status, out["usage"]["completion_tokens"] if out else 0

    def do_chat_stream(self, rng):
        return self.stream("/v1/chat/completions", self.chat_body(rng))

    def do_n_choices(self, rng):
        params = self.params(rng, n=rng.randint(2, 3), temperature=0.9)
        status, out = self.post("/generate", {"text": self.prompt(rng), "sampling_params": params})
        return status, sum(o["meta_info"]["completion_tokens"] for o in out) if out else 0

    def do_constrained(self, rng):
        grammar = {"regex": REGEX} if rng.random() < 0.5 else {"json_schema": SCHEMA}
        params = {"max_new_tokens": 48, "temperature": 0, **grammar}
        status, out = self.post("/generate", {"text": self.prompt(rng), "sampling_params": params})
        return status, out["meta_info"]["completion_tokens"] if out else 0

    def long_body(self, rng: random.Random, **extra) -> dict:
        params = {"max_new_tokens": 4 * self.max_new, "temperature": 0, "ignore_eos": True}
        return {"text": self.prompt(rng), "sampling_params": params, **extra}

    def do_drop_stream(self, rng):
        return self.stream("/generate", self.long_body(rng), stop_after=rng.randint(1, 6))

    def do_drop_plain(self, rng):
        try:
            return self.post("/generate", self.long_body(rng), timeout=rng.uniform(0.3, 2.0))[0], 0
        except requests.Timeout:
            return 0, 0

    def do_abort(self, rng):
        rid = f"soak-abort-{rng.getrandbits(64):x}"
        timer = threading.Timer(rng.uniform(0.2, 2.0), requests.post, args=(self.url + "/abort_request",),
                                kwargs={"json": {"rid": rid}, "timeout": 30,
                                        "headers": self.headers()})  # fmt: skip
        timer.start()
        try:
            status, out = self.post("/generate", self.long_body(rng, rid=rid))
        finally:
            timer.cancel()
        return status, out["meta_info"]["completion_tokens"] if out else 0

    def do_hostile(self, rng) -> tuple[int, int, int]:
        name, path, body, ctype, expected = rng.choice(HOSTILE)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(self.url + path, data=data, headers={**self.headers(), "Content-Type": ctype},
                          timeout=300)  # fmt: skip
        return r.status_code, 0, expected

    def do_tenant_probe(self, rng):
        """This tenant caches a fresh prompt under a session; the next tenant sends it naming that session.
        Its status is the other tenant's; an observation is recorded as an error (`cross_tenant`)."""
        names = self.tenants.names
        other = names[(names.index(self.tenant) + 1) % len(names)]
        canary = " ".join(f"c{rng.getrandbits(32):x}" for _ in range(48))
        body = {"text": f"Repeat: {canary}", "session_id": f"probe-{rng.getrandbits(64):x}",
                "cache_ttl_s": 30, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}  # fmt: skip
        for _ in range(2):
            status, _ = self.post("/generate", body)
            if status != 200:
                return status, 0
        r = requests.post(self.url + "/generate", json=body, timeout=300, headers=self.headers(other))
        if r.status_code != 200:
            return r.status_code, 0
        meta = r.json()["meta_info"]
        if meta["cached_tokens"] > PROBE_CACHED_MAX or "cache_miss" in meta:
            raise CrossTenant(f"{other} saw {self.tenant}'s prompt: cached {meta['cached_tokens']}, "
                              f"cache_miss {meta.get('cache_miss')}")  # fmt: skip
        return 200, meta["completion_tokens"]


class Sampler(threading.Thread):
    """Every `interval` s: RSS of the server and its children (when we know its pid), /get_server_info."""

    def __init__(self, url: str, pid: int | None, interval: float, t0: float, headers: dict[str, str]):
        super().__init__(daemon=True)
        self.url, self.pid, self.interval, self.t0 = url, pid, interval, t0
        self.headers = headers
        self.samples: list[dict] = []
        self.roles: dict[str, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            s: dict = {"t": round(time.monotonic() - self.t0, 2)}
            if self.pid:
                s["rss_mb"] = {str(p): round(rss_mb(p), 1) for p in process_tree(self.pid)}
                if not self.roles:
                    self.roles = process_roles(self.pid)
            try:
                info = requests.get(self.url + "/get_server_info", timeout=30, headers=self.headers).json()
                s.update({k: info.get(k) for k in INFO_KEYS})
            except (requests.RequestException, ValueError) as e:
                s["error"] = str(e)[:100]
            self.samples.append(s)
            self.stop.wait(self.interval)


class Bursts(threading.Thread):
    """`count` bursts of `size` concurrent streaming chat requests, at (i + 0.5) / count of the load phase;
    after each, the scheduler's RSS (its own memory report)."""

    def __init__(
        self, url: str, count: int, size: int, seed: int, t0: float, deadline: float, tenants: Tenants | None
    ):
        super().__init__(daemon=True)
        self.url, self.count, self.size, self.seed = url, count, size, seed
        self.tenants = tenants
        self.at = [t0 + (i + 0.5) / count * (deadline - t0) for i in range(count)] if count else []
        self.results: list[dict] = []
        self.t0 = t0

    def run(self) -> None:
        import asyncio

        from bench.burst import one_round, prompts

        client = argparse.Namespace(max_new_tokens=16, temperature=0.7, request_timeout=600.0)
        for i, at in enumerate(self.at):
            time.sleep(max(0.0, at - time.monotonic()))
            headers = {}
            if self.tenants is not None:  # each burst one tenant's
                headers = self.tenants.headers(self.tenants.names[i % len(self.tenants.names)])
            texts = prompts("distinct", i, self.size, self.seed)
            res = asyncio.run(one_round(self.url, texts, client, headers=headers))
            admin = self.tenants.headers() if self.tenants is not None else {}
            info = requests.get(self.url + "/get_server_info", timeout=60, headers=admin).json()
            res.update(t=round(time.monotonic() - self.t0, 1), scheduler_rss_mb=info["memory"]["rss_mb"])
            self.results.append(res)

    def verdict(self) -> dict:
        """Growth of the scheduler's RSS from the first burst's end to the last's, against its bound."""
        if len(self.results) < 2:
            return {"ok": not any(r["failed"] for r in self.results), "bursts": self.results}
        first, last = self.results[0], self.results[-1]
        later = sum(r["requests"] for r in self.results[1:])
        growth = last["scheduler_rss_mb"] - first["scheduler_rss_mb"]
        bound = BURST_GROWTH_MB_PER_1K * later / 1000 + BURST_GROWTH_SLACK_MB
        failed = sum(r["failed"] for r in self.results)
        return {"growth_mb": round(growth, 1), "bound_mb": round(bound, 1), "failed": failed,
                "ok": growth <= bound and not failed, "bursts": self.results}  # fmt: skip


# ---- end-of-run checks and reporting -----------------------------------------------------------------------
def final_checks(url: str, headers: dict[str, str], idle_timeout: float = 300) -> dict:
    """Idle, no KV held by requests, free + cached == pool, and a flush frees everything. `headers`: an
    admin's key, when the server needs one."""
    t0 = time.monotonic()
    while True:
        info = requests.get(url + "/get_server_info", timeout=60, headers=headers).json()
        idle = (
            info["requests_in_flight"] == 0 and info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
        )
        if idle or time.monotonic() - t0 > idle_timeout:
            break
        time.sleep(0.5)
    out: dict = {"idle": idle, "idle_after_s": round(time.monotonic() - t0, 1)}
    out["before_flush"] = {k: info.get(k) for k in FINAL_KEYS}
    out["no_kv_held_by_requests"] = info["request_held_tokens"] == 0
    out["free_plus_cache_is_pool"] = info["free_slots"] + info["cache_tokens"] == info["max_total_tokens"]
    out["flush_status"] = requests.post(url + "/flush_cache", timeout=60, headers=headers).status_code
    after = requests.get(url + "/get_server_info", timeout=60, headers=headers).json()
    out["all_free_after_flush"] = after["free_slots"] == after["max_total_tokens"]
    out["kv_slots_leaked"] = after["max_total_tokens"] - after["free_slots"]
    out["healthy"] = requests.get(url + "/health", timeout=30).status_code == 200
    checks = ("idle", "no_kv_held_by_requests", "free_plus_cache_is_pool", "all_free_after_flush", "healthy")
    out["ok"] = all(out[k] for k in checks) and out["flush_status"] == 200
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(records: list[Record], wall: float) -> dict:
    kinds: dict = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind]
        lat = [r.latency for r in rs if r.status == 200]
        kinds[kind] = {"count": len(rs), "ok": len(lat), "503": sum(r.status == 503 for r in rs),
                       "no_response": sum(r.status == 0 for r in rs),
                       "other": sum(r.status not in (0, 200, 503) for r in rs),
                       "tokens": sum(r.tokens for r in rs),
                       **{f"p{q}_s": round(pct(lat, q / 100), 3) for q in (50, 90, 99)}}  # fmt: skip
    tokens = sum(r.tokens for r in records)
    by_status: dict[str, int] = {}
    for r in records:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    hostile = [r for r in records if r.kind == "hostile"]
    # a hostile request's expected 5xx (the deadline's 504) is its correct answer, not a server error
    errors = [r for r in records if r.status >= 500 and r.status != 503 and r.status != r.expected]
    return {"kinds": kinds, "requests": len(records), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2), "by_status": by_status,
            "hostile_unexpected": [asdict(r) for r in hostile if r.status != r.expected][:20],
            "server_errors": [asdict(r) for r in errors][:20],
            "cross_tenant_observations": [asdict(r) for r in records if r.error.startswith("cross_tenant")],
            "transport_errors": [asdict(r) for r in records if r.status == 0 and r.error][:20]}  # fmt: skip


def rss_trend(samples: list[dict], roles: dict[str, str] | None = None) -> dict:
    totals = [sum(s["rss_mb"].values()) for s in samples if s.get("rss_mb")]
    if len(totals) < 2:
        return {}
    k = max(1, len(totals) // 5)
    first, last = statistics.mean(totals[:k]), statistics.mean(totals[-k:])
    out = {"total_mb_first_fifth": round(first, 1), "total_mb_last_fifth": round(last, 1),
           "total_mb_max": round(max(totals), 1), "growth_mb": round(last - first, 1)}  # fmt: skip
    if roles:  # the scheduler process alone: the one that holds the model, the KV pool and the cache
        sched = [p for p, role in roles.items() if "scheduler" in role]
        pts = [s["rss_mb"][sched[0]] for s in samples if sched and sched[0] in s.get("rss_mb", {})]
        if pts:
            out["scheduler_mb_start"], out["scheduler_mb_end"] = pts[0], pts[-1]
    return out


def plot(samples: list[dict], roles: dict[str, str], records: list[Record], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, lat, reqs) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for p in sorted({p for s in samples for p in s.get("rss_mb", {})}, key=int):
        pts = [(s["t"], s["rss_mb"][p]) for s in samples if p in s.get("rss_mb", {})]
        rss.plot([t for t, _ in pts], [v for _, v in pts], label=f"{roles.get(p, 'pid')} ({p})")
    rss.set_ylabel("RSS (MiB)")
    rss.legend(fontsize=7)
    for kind in sorted({r.kind for r in records}):
        ok = [r for r in records if r.kind == kind and r.status == 200]
        lat.scatter([r.t + r.latency for r in ok], [r.latency for r in ok], s=8, label=kind)
    lat.set_ylabel("latency (s), at completion")
    lat.legend(fontsize=7, ncol=3)
    info = [s for s in samples if "num_running_reqs" in s]
    for key in INFO_KEYS[:3]:
        reqs.plot([s["t"] for s in info], [s[key] for s in info], label=key)
    reqs.set_ylabel("requests")
    reqs.set_xlabel("time (s)")
    reqs.legend(fontsize=7)
    fig.suptitle("radixlm soak")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(summary: dict, checks: dict, trend: dict, wall: float) -> None:
    print(f"\nsoak: {wall / 60:.1f} min, {summary['requests']} requests, {summary['tokens']} tokens "
          f"({summary['tokens_per_s']} tok/s)")  # fmt: skip
    cols = ("count", "ok", "503", "no_response", "other", "p50_s", "p90_s", "p99_s", "tokens")
    print(f"{'kind':14s}" + "".join(f"{c:>12s}" for c in cols))
    for kind, k in summary["kinds"].items():
        print(f"{kind:14s}" + "".join(f"{k[c]:12.2f}" if c.endswith("_s") else f"{k[c]:12d}" for c in cols))
    if trend:
        first, last, top = trend["total_mb_first_fifth"], trend["total_mb_last_fifth"], trend["total_mb_max"]
        print(
            f"RSS, server + children: {first:.0f} MiB (first fifth) -> {last:.0f} MiB (last), max {top:.0f}"
        )
    if "scheduler_mb_start" in trend:
        print(f"scheduler RSS: {trend['scheduler_mb_start']:.0f} -> {trend['scheduler_mb_end']:.0f} MiB")
    unexpected = len(summary["hostile_unexpected"])
    print(f"by status: {json.dumps(summary['by_status'])}; hostile requests with an unexpected status: "
          f"{unexpected}; KV slots leaked: {checks.get('kv_slots_leaked')}; cross-tenant observations: "
          f"{len(summary['cross_tenant_observations'])}")  # fmt: skip
    print(f"KV accounting and health: {'OK' if checks.get('ok') else 'FAILED'} {json.dumps(checks)}")


def run(
    args: argparse.Namespace, url: str, pid: int | None, server_alive, tenants: Tenants | None = None
) -> int:
    admin = tenants.headers() if tenants is not None else {}
    constrained = False
    if not args.no_constrained:  # only if this server supports it
        probe = requests.post(url + "/generate", timeout=300, headers=admin, json={
            "text": "Answer:", "sampling_params": {"max_new_tokens": 2, "regex": "(yes|no)"}})  # fmt: skip
        constrained = probe.status_code == 200
    load = Load(url, args.seed, args.max_new_tokens, constrained, tenants)
    sampler = Sampler(url, pid, args.sample_interval, load.t0, admin)
    sampler.start()
    deadline = load.t0 + args.minutes * 60
    workers = [
        threading.Thread(target=load.worker, args=(i, deadline), daemon=True) for i in range(args.concurrency)
    ]
    bursts = Bursts(url, args.bursts, args.burst_size, args.seed, load.t0, deadline, tenants)
    for t in [*workers, bursts]:
        t.start()
    for t in [*workers, bursts]:  # every request has a client timeout: they stop soon after the deadline
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 600)
    wall = time.monotonic() - load.t0
    burst = bursts.verdict()
    checks = final_checks(url, admin)
    sampler.stop.set()
    sampler.join(timeout=60)
    with load.lock:
        records = list(load.records)
    summary, trend = summarize(records, wall), rss_trend(sampler.samples, sampler.roles)
    ok = (
        checks["ok"]
        and not summary["server_errors"]
        and not summary["hostile_unexpected"]
        and not summary["cross_tenant_observations"]
        and burst["ok"]
        and server_alive()
    )
    out = Path(args.out)
    config = {**vars(args), "command": common.command_line()}
    result = {"name": out.stem, "ok": ok, "config": config, "constrained": load.constrained,
              "tenants": tenants.names if tenants is not None else [],
              "environment": {**common.environment(), "machine": platform.machine(), "cpus": os.cpu_count(),
                              "loadavg_end": os.getloadavg()},
              "wall_s": round(wall, 1), "summary": summary, "rss": trend, "final_checks": checks,
              "bursts": burst,
              "roles": sampler.roles, "samples": sampler.samples,
              "records": [asdict(r) for r in records]}  # fmt: skip
    out.write_text(json.dumps(result, indent=1))
    plot(sampler.samples, sampler.roles, records, out.with_suffix(".png"))
    print_table(summary, checks, trend, wall)
    if burst["bursts"]:
        rows = ", ".join(f"{r['requests'] - r['failed']}/{r['requests']} ok, {r['scheduler_rss_mb']:.0f} MB"
                         for r in burst["bursts"])  # fmt: skip
        print(f"bursts: {rows}; growth {burst.get('growth_mb')} MB (bound {burst.get('bound_mb')}): "
              f"{'OK' if burst['ok'] else 'MISSED'}")  # fmt: skip
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the load phase (default 10)")
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--server-pid", type=int, help="pid of the --url server, to sample its RSS")
    ap.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="upper bound of a normal request's length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=3, help="burst phases spread over the run (0: none)")
    ap.add_argument("--burst-size", type=int, default=500, help="concurrent streaming requests per burst")
    ap.add_argument("--no-constrained", action="store_true", help="leave regex / JSON-schema requests out")
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS / info samples")
    ap.add_argument(
        "--server-args", default="--max-total-tokens 16384", help="extra args for the started server"
    )
    ap.add_argument(
        "--tenants", type=int, default=0, help="serve N tenants from an --api-keys-file (0: no keys)"
    )
    ap.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = ap.parse_args(argv)
    if args.tenants and args.url:
        ap.error("--tenants needs a server the soak starts (it writes the keys file): leave out --url")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.url:
        return run(args, args.url.rstrip("/"), args.server_pid, lambda: True)
    log = Path(tempfile.gettempdir()) / f"radixlm-soak-server-{os.getpid()}.log"
    extra = args.server_args.split()
    with tempfile.TemporaryDirectory() as keys_dir:
        tenants = Tenants(args.tenants, Path(keys_dir)) if args.tenants else None
        if tenants is not None:
            extra += ["--api-keys-file", str(tenants.path)]
        proc, url = start_server(extra, log)
        print(f"server pid {proc.pid} at {url}, log {log}")
        try:
            return run(args, url, proc.pid, lambda: proc.poll() is None, tenants)
        finally:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
