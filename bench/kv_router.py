"""KV router: the shared-prefix agent workload on 2 radixlm replicas behind a router; each policy's cache hit
rate over the replicas and requests/s.

Sides, each launched afresh as `radixlm serve --dp-size 2 --num-threads T` (replicas with their own radix
cache): `round_robin` (sglang-router sends each request to the next replica, ignoring prefixes),
`cache_aware` (sglang-router's approximate prefix tree of the text it sent to each replica, load-balanced),
and `dynamo-kv`: NVIDIA Dynamo's frontend with `--router-mode kv`, whose router follows the blocks each
replica says it cached in its `--kv-events-config` stream (vLLM's wire format), relayed by
`bench/router_dynamo_worker.py` (one per replica, in `.peers/dynamo-venv`; file discovery and a ZMQ event
plane, so no etcd or NATS). Dynamo's frontend renders prompts with its own chat template handling, so the
`dynamo-kv` agents render radixlm's tool prompt and tool-call regex themselves (as `bench.agent_loop`'s
`hf` side does) and send the text to `/v1/completions` with `guided_regex` (prompts of the same length as
on the chat route: 1,826 against 1,824 tokens a step in bench/results/kv_router.json).

The workload is `bench.agent_loop`'s: A agents x N tool-calling steps over `bench.agent_catalogue`'s
~1.6k-token tool catalogue, every agent at once, each step one `/v1/chat/completions` request through the
router (so requests/s = steps/s). Before the measured run each replica is warmed directly (grammar compiled,
code hot) and flushed. The hit rate is sum(cached tokens) / sum(prompt tokens) over both replicas, from the
change of each replica's `/get_server_info` counters over the run; each replica's share of the prompt
tokens shows how the router spread the load.

Bound: a step's prompt is the catalogue (shared by every agent) plus the agent's own history. A router that
keeps an agent on one replica hits the catalogue and the history (agent_loop: ~0.97 after the first step);
round-robin sends an agent's next step to the other replica about half the time, where only the catalogue
and whatever that replica saw of the history are cached.

    python -m bench.kv_router --quick
    python -m bench.kv_router --num-agents 6 --steps 4 --max-tokens 48 --threads 1
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import agent_catalogue as cat
from bench import agent_loop
from bench.harness import common

POLICIES = ("round_robin", "cache_aware")
DYNAMO = "dynamo-kv"  # NVIDIA Dynamo's frontend, --router-mode kv, fed by the replicas' KV events
DYNAMO_VENV = Path(".peers/dynamo-venv")
# radixlm counters whose change over the measured run is recorded per replica
COUNTERS = ("prompt_tokens", "cached_tokens", "generated_tokens")


def replica_figures(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    """The replicas' counter changes over a run (pure: the unit tests check it): per replica the change of
    each counter, its hit rate and its share of the prompt tokens; over all, the hit rate."""
    if len(before) != len(after):
        raise ValueError(f"replica counters: {len(before)} before, {len(after)} after")
    per = []
    for i, (b, a) in enumerate(zip(before, after)):
        delta = {k: a[k] - b[k] for k in COUNTERS}
        if any(v < 0 for v in delta.values()):
            raise ValueError(f"replica {i}: a counter went down ({delta}); was it restarted?")
        per.append(delta)
    prompt = sum(d["prompt_tokens"] for d in per)
    cached = sum(d["cached_tokens"] for d in per)
    for d in per:
        d["cache_hit_rate"] = d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else None
        d["prompt_share"] = d["prompt_tokens"] / prompt if prompt else None
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else None,
        "replicas": per,
    }


def _counters(url: str) -> dict[str, float]:
    import requests

    info = requests.get(url + "/get_server_info", timeout=60).json()
    return {k: float(info.get(k) or 0) for k in COUNTERS}


def _launch_replicas(policy: str, args: Any, tag: str, kv_events_port: int | None = None):
    """`radixlm serve --dp-size N`, sglang-router with `policy` in front; (server, replicas, kwargs, cmd)."""
    from bench.serving import LaunchedServer

    port, base = agent_loop._free_port(), agent_loop._free_port()
    kw: dict[str, Any] = {
        "dp_size": args.replicas,
        "router_policy": policy,
        "dp_base_port": base,
        "num_threads": args.threads,
        "dtype": args.dtype,
        "log_level": "warning",
    }
    if kv_events_port is not None:  # replica r publishes on kv_events_port + r
        kw["kv_events_config"] = json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{kv_events_port}",
            }
        )
    cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port), *agent_loop.server_flags(kw)]
    log = Path(args.results_dir) / f"{args.name or 'kv_router'}_{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LaunchedServer(cmd, port, log, timeout=900)
    # replica r serves --dp-base-port + r (the router's /workers may list them only later)
    replicas = [f"http://127.0.0.1:{base + r}" for r in range(args.replicas)]
    try:
        for url in replicas:
            _counters(url)
    except Exception:
        server.stop()
        raise
    return server, replicas, kw, cmd


def _run_measured(
    step_url: str, replicas: list[str], args: Any, task_list: list[str], warm: list[str], step=None
):
    """Warm each replica directly (and compile the regex of a `step` that has one), flush it, then run the
    agents through `step_url`; the figures with the replicas' counters."""
    import requests

    for url in replicas:
        agent_loop.run_agents(_side(url, args), warm, 1)
        regex = getattr(step, "regex", None)
        if regex is not None:  # the grammar the measured requests use, compiled before the run
            sampling = {"max_new_tokens": args.max_tokens, "temperature": 0, "regex": regex}
            body = {"text": "Hi", "sampling_params": sampling}
            r = requests.post(url + "/generate", json=body, timeout=1800)
            if r.status_code != 200:
                raise RuntimeError(f"warming the regex on {url}: HTTP {r.status_code}: {r.text[:300]}")
        requests.post(url + "/flush_cache", timeout=120).raise_for_status()
    before, load = [_counters(u) for u in replicas], common.load_average()
    side = (
        _side(step_url, args) if step is None else agent_loop.OpenChatSide(step_url, step, {}, 0.0, step_url)
    )
    traces, wall = agent_loop.run_agents(side, task_list, args.steps)
    after = [_counters(u) for u in replicas]
    fig = agent_loop.figures(traces, wall)
    fig["requests_per_s"] = fig.pop("steps_per_s")
    fig["load_before"] = load
    fig["server_counters"] = replica_figures(before, after)
    return fig


def measure_policy(policy: str, args: Any, task_list: list[str], warm: list[str]) -> dict[str, Any]:
    """Launch N replicas behind sglang-router with `policy` and run the agents through the router."""
    t0 = time.perf_counter()
    server, replicas, kw, cmd = _launch_replicas(policy, args, policy)
    try:
        fig = _run_measured(server.url, replicas, args, task_list, warm)
    finally:
        server.stop()
    fig.update(
        router=f"sglang-router {policy}",
        start_s=server.start_seconds,
        open_s=time.perf_counter() - t0,
        side_config={**kw, "command": " ".join(cmd[1:])},
    )
    return fig


# ----------------------------------------------------------------------------------------- Dynamo's KV router
def completions_step(url: str, model_dir: str, args: Any):
    """An agent step over an OpenAI `/v1/completions` route: the prompt rendered and the tool-call regex built
    as radixlm's chat route does (the `hf` side of bench.agent_loop), sent as text with `guided_regex`, and
    the answer parsed by radixlm's tool-call parser. Dynamo's frontend tokenizes the text with the model's
    tokenizer and passes the regex to the worker as `guided_decoding`."""
    import requests
    from transformers import AutoTokenizer

    from runtime.entrypoints.tool_calls import ToolPlan
    from runtime.entrypoints.tool_calls.base import get_parser
    from runtime.entrypoints.tool_calls.prompt import render_messages, template_renders_tools
    from runtime.entrypoints.tool_calls.schema import forced_regex, parse_tool_choice, parse_tools

    tok = AutoTokenizer.from_pretrained(model_dir)
    tools = parse_tools(cat.TOOLS)
    choice = parse_tool_choice(args.tool_choice, tools)
    parser = get_parser("auto", tok.chat_template)
    regex = forced_regex(parser, tools, choice, args.parallel_tool_calls)
    native = template_renders_tools(tok.chat_template)

    def step(messages: list[dict[str, Any]]) -> agent_loop.Step:
        t0 = time.perf_counter()
        rendered, tool_arg = render_messages(messages, tools, parser, native)
        kw = {"tools": tool_arg} if tool_arg else {}
        prompt = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kw)
        body = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "guided_regex": regex,
        }
        r = requests.post(url + "/v1/completions", json=body, timeout=1800)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        doc = r.json()
        choice_doc, usage = doc["choices"][0], doc.get("usage") or {}
        msg = ToolPlan(prompt, regex, parser, choice).message(choice_doc["text"])
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])
        ]
        finish = choice_doc.get("finish_reason") or "stop"
        return agent_loop.Step(
            calls,
            msg["content"],
            "tool_calls" if calls and finish == "stop" else finish,
            usage.get("prompt_tokens") or 0,
            usage.get("completion_tokens") or 0,
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            time.perf_counter() - t0,
        )

    step.regex = regex  # type: ignore[attr-defined]
    return step


class _Proc:
    """A command in its own process group with its output in a log; `stop()` ends that group (only it)."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]):
        import os
        import subprocess

        self.cmd, self._log = cmd, open(log, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=common.REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.cmd[1:3]} exited with {self.proc.returncode}; see {self._log.name}")

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def _wait_model(url: str, procs: list[_Proc], timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            p.check()
        try:
            if requests.get(url + "/v1/models", timeout=5).json().get("data"):
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(2.0)
    raise RuntimeError(f"Dynamo's frontend listed no model within {timeout:.0f} s")


def measure_dynamo(args: Any, task_list: list[str], warm: list[str]) -> dict[str, Any]:
    """N replicas publishing KV events, one `bench/router_dynamo_worker.py` each, Dynamo's frontend with
    `--router-mode kv` in front; the agents go through the frontend's `/v1/completions`."""
    import tempfile

    from runtime.models.model_loader import resolve_model_path

    python = common.REPO_ROOT / DYNAMO_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"dynamo-kv side: {python} is missing; run bash bench/dynamo_venv.sh")
    t0 = time.perf_counter()
    model_dir = resolve_model_path("default")
    events_port = agent_loop._free_port()
    server, replicas, kw, cmd = _launch_replicas("round_robin", args, "dynamo-kv", events_port)
    procs: list[_Proc] = []
    store = tempfile.mkdtemp(prefix="kv_router_dynamo_")
    env = {"DYN_FILE_KV": store, "DYN_LOG": "warn"}
    front_port = agent_loop._free_port()
    front_cmd = [
        str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(front_port),
        "--router-mode", "kv", "--discovery-backend", "file", "--request-plane", "tcp",
        "--event-plane", "zmq", "--kv-cache-block-size", "16", "--namespace", "radixlm",
    ]  # fmt: skip
    stem = Path(args.results_dir) / f"{args.name or 'kv_router'}_dynamo"
    try:
        wcmd = [
            str(python),
            str(common.REPO_ROOT / "bench" / "router_dynamo_worker.py"),
            "--model-path",
            model_dir,
        ]
        for rank, url in enumerate(replicas):  # replica r publishes on events_port + r
            wcmd += ["--replica", f"{url}=tcp://127.0.0.1:{events_port + rank}"]
        procs.append(_Proc(wcmd, Path(f"{stem}_worker.log"), env))
        procs.append(_Proc(front_cmd, Path(f"{stem}_frontend.log"), env))
        _wait_model(f"http://127.0.0.1:{front_port}", procs, 600)
        url = f"http://127.0.0.1:{front_port}"
        fig = _run_measured(url, replicas, args, task_list, warm, completions_step(url, model_dir, args))
    finally:
        for p in reversed(procs):
            p.stop()
        server.stop()
    fig.update(
        router="dynamo-kv",
        start_s=server.start_seconds,
        open_s=time.perf_counter() - t0,
        side_config={
            **kw,
            "command": " ".join(cmd[1:]),
            "frontend": " ".join(front_cmd[1:]),
            "worker": " ".join(wcmd[1:]),
        },
    )
    return fig


def _side(url: str, args: Any) -> agent_loop.OpenChatSide:
    return agent_loop.OpenChatSide(url, agent_loop.openai_step(url, args), {"url": url}, 0.0, url)


def summary_rows(per_side: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for f in per_side.values():
        c = f["server_counters"]
        rows.append(
            {
                "router": f["router"],
                "requests/s": f["requests_per_s"],
                "cache hit": c["cache_hit_rate"],
                "hit later steps (usage)": f["cache_hit_rate_later_steps"],
                "replica prompt share": "/".join(f"{r['prompt_share']:.2f}" for r in c["replicas"]),
                "step p50 s": f["step_latency_s"]["p50"],
                "errors": f["errors"],
                "load": f["load_before"]["load_1m"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--sides",
        default=",".join((*POLICIES, DYNAMO)),
        help=f"sglang-router policies ({', '.join(POLICIES)}, random) and {DYNAMO}, one side each",
    )
    p.add_argument("--replicas", type=int, default=2, help="radixlm replicas behind the router")
    p.add_argument("--threads", type=int, default=1, help="--num-threads of each replica")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-agents", type=int, default=6, help="agents running at once")
    p.add_argument("--steps", type=int, default=4, help="tool-calling steps per agent")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each step")
    p.add_argument("--seed", type=int, default=0, help="task sampling seed")
    args = p.parse_args(argv)
    if args.quick:
        args.num_agents, args.steps, args.max_tokens = 2, 2, 32
    sides = common.csv_list(args.sides)
    bad = [x for x in sides if x not in (*POLICIES, "random", DYNAMO)]
    if bad:
        raise SystemExit(f"--sides: unknown {bad}; choose from {(*POLICIES, 'random', DYNAMO)}")
    if args.replicas < 2:
        raise SystemExit(f"--replicas must be at least 2, got {args.replicas}")
    # agent_loop.openai_step's request body reads these
    args.tool_choice, args.parallel_tool_calls = "required", False
    common.setup_env()
    env = common.environment()
    env["load_before"] = common.load_average()
    task_list = cat.tasks(args.num_agents, args.seed)
    warm = cat.tasks(1, args.seed + 1)
    config = {
        "command": common.command_line(),
        "replicas": args.replicas,
        "threads_per_replica": args.threads,
        "num_agents": args.num_agents,
        "steps": args.steps,
        "max_tokens": args.max_tokens,
        "tools": len(cat.TOOLS),
        "sides": sides,
        "dtype": args.dtype,
    }
    name = args.name or "kv_router"
    per_side: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {"sides": per_side}
    for side in sides:
        print(f"[kv_router] {side} ...", flush=True)
        if side == DYNAMO:
            per_side[side] = measure_dynamo(args, task_list, warm)
        else:
            per_side[side] = measure_policy(side, args, task_list, warm)
        if "round_robin" in per_side:
            for f in per_side.values():
                f["speedup_vs_round_robin"] = common.ratio(
                    f["requests_per_s"], per_side["round_robin"]["requests_per_s"]
                )
        # after every side, so a side that fails later keeps the others' figures
        common.write_results(name, config, results, env, args.results_dir)
    print()
    common.print_table(summary_rows(per_side), title="== kv_router ==")
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        [f["router"] for f in per_side.values()],
        {"cache hit rate": [f["server_counters"]["cache_hit_rate"] for f in per_side.values()]},
        "cache hit rate over the replicas",
        f"{name}: {args.num_agents} agents x {args.steps} steps on {args.replicas} replicas",
    )
    return results


if __name__ == "__main__":
    main()
