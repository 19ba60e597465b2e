"""Agent loop: A agents x N tool-calling steps over one shared ~1.6k-token tool catalogue; radix cache on vs
off vs the HF baseline. Records steps/s and the cache hit rate.

Each step is one chat completion with the 15 tools of `bench.agent_catalogue` and `tool_choice` (`required`
by default, so the grammar forces one valid call a step; `auto` lets the model answer in text, after which
the agent is told to continue); the call is executed by the catalogue's deterministic fake tool and appended
as a `tool` message, so step k+1's prompt is step k's prompt + its output + the tool result. All agents
start at once after a cache flush, so their first steps are prefilled together, cold (a prefix is shared
only with requests that come after it was cached); later steps reuse their own history.

Sides: `radixlm` and `radixlm-noradix` (`--disable-radix-cache`) are launched servers answering
`/v1/chat/completions` (the real tool-calling path: prompt rendering, grammar, parser); `hf` renders the same
prompt with the same `runtime.entrypoints.tool_calls` functions and decodes under the same regex through
`bench.harness.hf_backend.HFBackend` (no KV kept between requests). The hit rate is
sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens) over the measured steps; the
radixlm servers' own counters are recorded too.

Bound: a step of agent a at step k re-reads the catalogue (C tokens) and its history; with the cache, only
the new output and tool result (a few dozen tokens) are prefilled, so the hit rate tends to
1 - (new tokens) / (C + history) (0.97 after the first step in bench/results/agent_loop.json), and
without it every step prefills everything.

    python -m bench.agent_loop --quick
    python -m bench.agent_loop --num-agents 8 --steps 6 --max-tokens 96
    python -m bench.agent_loop --sides radixlm-server,vllm,llama-server --threads 2

`vllm` and `llama-server` (`make bench-peers`, `bench.harness.peers`) are vLLM-CPU and llama.cpp's C++ server
answering the same requests on `/v1/chat/completions` with their own chat templates and tool handling; vLLM's
prefix cache is flushed like radixlm's (`/reset_prefix_cache`), llama-server has no flush (its slots keep the
warm-up prompt). `radixlm-server` is `radixlm serve` with its default flags beside them. Their version,
command and start-up time are in each side's `side_config`.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import agent_catalogue as cat
from bench.harness import common
from bench.harness.peers import PEERS, check_installed, flush_path, peer_spec
from bench.harness.sides import HF, add_side_args, engine_args, open_side, side_names

CONTINUE = "Continue with the next tool call."
# `radixlm serve` with its default flags (dtype, quantization, pool size: the server's own), beside the peers;
# the `radixlm*` variants instead take the bench's --dtype / --max-total-tokens / ... options.
RADIXLM_SERVER = "radixlm-server"
# radixlm server counters whose change over the measured run is recorded (generated: sampled tokens only)
_COUNTERS = ("prompt_tokens", "cached_tokens", "generated_tokens", "jump_forward_tokens", "extend_steps")


@dataclass
class Step:
    """One chat completion of an agent: its calls as (id, name, arguments JSON), content and usage."""

    calls: list[tuple[str, str, str]]
    content: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seconds: float


@dataclass
class Trace:
    steps: list[Step] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------------------------------ the agent
def history_arguments(arguments: str) -> str:
    """The arguments to write back into the history: verbatim when they are a JSON object, else "{}" (a call
    cut by max_tokens must not make the next request a 400; the tool answers it with an error)."""
    try:
        return arguments if isinstance(json.loads(arguments), dict) else "{}"
    except ValueError:
        return "{}"


def next_messages(step: Step) -> list[dict[str, Any]]:
    """What the agent appends after `step`: the assistant turn, then each call's tool result (or, when the
    model answered in text, a user turn asking for the next call)."""
    if not step.calls:
        return [{"role": "assistant", "content": step.content or ""}, {"role": "user", "content": CONTINUE}]
    calls = [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": history_arguments(args)}}
        for cid, name, args in step.calls
    ]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": step.content, "tool_calls": calls}]
    for cid, name, args in step.calls:
        out.append({"role": "tool", "tool_call_id": cid, "content": cat.run_tool(name, args)})
    return out


def run_agent(step_fn: Callable[[list[dict[str, Any]]], Step], task: str, num_steps: int) -> Trace:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": cat.SYSTEM_PROMPT},
        {"role": "user", "content": task},
    ]
    trace = Trace()
    try:
        for _ in range(num_steps):
            step = step_fn(messages)
            trace.steps.append(step)
            messages = messages + next_messages(step)
    except Exception as e:  # reported as an error count; the other agents go on
        trace.error = repr(e)[:300]
    return trace


def valid_call(name: str, arguments: str) -> bool:
    """The call names a catalogue tool and its arguments validate against that tool's schema."""
    import jsonschema

    if name not in cat.TOOL_SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(arguments), cat.TOOL_SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def trajectory(trace: Trace) -> tuple:
    """What an agent did, compared between sides: every step's calls (name, arguments) or its text."""
    return tuple(tuple((n, a) for _, n, a in s.calls) or s.content for s in trace.steps)


def hit_rate(steps: list[Step]) -> float | None:
    prompt = sum(s.prompt_tokens for s in steps)
    return sum(s.cached_tokens for s in steps) / prompt if prompt else None


def figures(traces: list[Trace], wall: float) -> dict[str, Any]:
    """Per-side figures of a measured run (pure: the unit tests check it)."""
    steps = [s for t in traces for s in t.steps]
    calls = [c for s in steps for c in s.calls]
    later = [s for t in traces for s in t.steps[1:]]
    errors = [t.error for t in traces if t.error]
    finishes: dict[str, int] = {}
    for s in steps:
        finishes[s.finish_reason] = finishes.get(s.finish_reason, 0) + 1
    return {
        "agents": len(traces),
        "steps": len(steps),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "steps_per_s": len(steps) / wall if wall > 0 and steps else None,
        "step_latency_s": common.summarize([s.seconds for s in steps]),
        "prompt_tokens": sum(s.prompt_tokens for s in steps),
        "cached_tokens": sum(s.cached_tokens for s in steps),
        "completion_tokens": sum(s.completion_tokens for s in steps),
        "prompt_tokens_per_step": sum(s.prompt_tokens for s in steps) / len(steps) if steps else None,
        "cache_hit_rate": hit_rate(steps),
        "cache_hit_rate_first_step": hit_rate([t.steps[0] for t in traces if t.steps]),
        "cache_hit_rate_later_steps": hit_rate(later),
        "tool_calls": len(calls),
        "valid_calls": sum(valid_call(n, a) for _, n, a in calls),
        "text_replies": sum(not s.calls for s in steps),
        "finish_reasons": finishes,
    }


def agreement(ref: list[Trace], other: list[Trace]) -> float | None:
    """Share of agents whose whole trajectory equals the reference side's (an errored agent never agrees)."""
    if not ref:
        return None
    same = sum(
        a.error is None and b.error is None and trajectory(a) == trajectory(b) for a, b in zip(ref, other)
    )
    return same / len(ref)


# ------------------------------------------------------------------------------------------ sides
def _request_body(messages: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": messages,
        "tools": cat.TOOLS,
        "tool_choice": args.tool_choice,
        "parallel_tool_calls": args.parallel_tool_calls,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }


def openai_step(url: str, args: Any) -> Callable[[list[dict[str, Any]]], Step]:
    """A step over radixlm's `/v1/chat/completions` (the tool-calling path under test)."""
    import requests

    def step(messages: list[dict[str, Any]]) -> Step:
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/chat/completions", json=_request_body(messages, args), timeout=1800)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        doc = r.json()
        choice, usage = doc["choices"][0], doc["usage"]
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        return Step(
            calls,
            choice["message"].get("content"),
            choice["finish_reason"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            time.perf_counter() - t0,
        )

    return step


def hf_step(backend: Any, args: Any) -> Callable[[list[dict[str, Any]]], Step]:
    """A step on the HF baseline: the server's prompt rendering, grammar and parser, HF's decoding."""
    from lang.backends.base import Prompt
    from runtime.entrypoints.tool_calls import ToolPlan
    from runtime.entrypoints.tool_calls.base import get_parser
    from runtime.entrypoints.tool_calls.prompt import render_messages, template_renders_tools
    from runtime.entrypoints.tool_calls.schema import forced_regex, parse_tool_choice, parse_tools

    tok = backend.tokenizer
    tools = parse_tools(cat.TOOLS)
    choice = parse_tool_choice(args.tool_choice, tools)
    parser = get_parser("auto", tok.chat_template)
    regex = forced_regex(parser, tools, choice, args.parallel_tool_calls)
    native = template_renders_tools(tok.chat_template)

    def step(messages: list[dict[str, Any]]) -> Step:
        t0 = time.perf_counter()
        rendered, tool_arg = render_messages(messages, tools, parser, native)
        kw = {"tools": tool_arg} if tool_arg else {}
        prompt = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kw)
        sampling = {"max_new_tokens": args.max_tokens, "temperature": 0, "regex": regex}
        res = backend.generate(Prompt(prompt), sampling)
        msg = ToolPlan(prompt, regex, parser, choice).message(res.text)
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])
        ]
        finish = (res.meta_info.get("finish_reason") or {}).get("type", "stop")
        finish = "tool_calls" if calls and finish == "stop" else finish
        meta = res.meta_info
        return Step(
            calls,
            msg["content"],
            finish,
            meta["prompt_tokens"],
            meta["completion_tokens"],
            0,
            time.perf_counter() - t0,
        )

    return step


def server_flags(kw: dict[str, Any]) -> list[str]:
    """ServerArgs fields as `radixlm serve` flags (True: the bare flag; False / None: left out)."""
    flags: list[str] = []
    for k, v in kw.items():
        if v is None or v is False:
            continue
        flags += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class OpenChatSide:
    name: str
    step: Callable[[list[dict[str, Any]]], Step]
    config: dict[str, Any]
    open_seconds: float
    url: str | None = None  # launched or --url servers
    flush_path: str | None = "/flush_cache"  # peers: vLLM's /reset_prefix_cache; llama-server has none
    has_counters: bool = True  # radixlm's /get_server_info

    def counters(self) -> dict[str, float]:
        import requests

        if self.url is None or not self.has_counters:
            return {}
        info = requests.get(self.url + "/get_server_info", timeout=60).json()
        return {k: float(info.get(k) or 0) for k in _COUNTERS}

    def flush(self) -> None:
        import requests

        if self.url is not None and self.flush_path is not None:
            requests.post(self.url + self.flush_path, timeout=120).raise_for_status()


@contextmanager
def open_chat_side(name: str, args: Any) -> Iterator[OpenChatSide]:
    """Open one side (a launched server, `--url`, or the HF model) and close it on exit."""
    t0 = time.perf_counter()
    if name == HF:
        side = open_side(HF, args)
        try:
            yield OpenChatSide(name, hf_step(side.backend, args), side.config, time.perf_counter() - t0)
        finally:
            side.close()
        return
    if args.url:
        if name != "radixlm":
            raise ValueError(f"side {name!r} needs its own server; with --url only `radixlm` can run")
        url = args.url.rstrip("/")
        yield OpenChatSide(name, openai_step(url, args), {"url": url}, 0.0, url)
        return
    from bench.serving import LaunchedServer

    if name in PEERS:
        port = _free_port()
        spec = peer_spec(name, port, args.threads or common.usable_cores())
        log = Path(args.results_dir) / f"{args.name or 'agent_loop'}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        server = LaunchedServer(spec.command, port, log, spec.health_path, spec.start_timeout_s, spec.env)
        print(f"[agent_loop] {name} healthy after {server.start_seconds:.1f} s", flush=True)
        try:
            cfg = {**spec.record(), "start_s": server.start_seconds}
            step = openai_step(server.url, args)
            yield OpenChatSide(
                name, step, cfg, time.perf_counter() - t0, server.url, flush_path(name), has_counters=False
            )
        finally:
            server.stop()
        return
    if name == RADIXLM_SERVER:  # `radixlm serve` as a user starts it: only the thread count is set
        kw = {"num_threads": args.threads or common.usable_cores(), "log_level": "warning"}
    else:
        kw = engine_args(args, name)
    port = _free_port()
    cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port), *server_flags(kw)]
    log = Path(args.results_dir) / f"{args.name or 'agent_loop'}_{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LaunchedServer(cmd, port, log)
    try:
        cfg = {**kw, "command": " ".join(cmd[1:]), "start_s": server.start_seconds}
        yield OpenChatSide(name, openai_step(server.url, args), cfg, time.perf_counter() - t0, server.url)
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------ measuring
def run_agents(side: OpenChatSide, task_list: list[str], num_steps: int) -> tuple[list[Trace], float]:
    """Every agent at once (one thread each); (traces in task order, wall seconds)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, len(task_list))) as pool:
        traces = list(pool.map(lambda t: run_agent(side.step, t, num_steps), task_list))
    return traces, time.perf_counter() - t0


def measure(side: OpenChatSide, task_list: list[str], warm: list[str], num_steps: int) -> tuple[dict, list]:
    """Warm up (grammar compiled, code hot), flush the prefix cache, run the agents; (figures, traces)."""
    run_agents(side, warm, 1)
    side.flush()
    before, load = side.counters(), common.load_average()
    traces, wall = run_agents(side, task_list, num_steps)
    after = side.counters()
    fig = figures(traces, wall)
    fig.update(side=side.name, load_before=load, open_s=side.open_seconds, side_config=side.config)
    if after:
        fig["server_counters"] = {k: after[k] - before[k] for k in after}
    return fig, traces


def summary_rows(per_side: dict[str, dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    rows = []
    for name, f in per_side.items():
        rows.append(
            {
                "side": name,
                "steps/s": f["steps_per_s"],
                **({f"x {baseline}": f.get(f"speedup_vs_{baseline}")} if baseline else {}),
                "step p50 s": f["step_latency_s"]["p50"],
                "prompt tok/step": f["prompt_tokens_per_step"],
                "cache hit": f["cache_hit_rate"],
                "hit later steps": f["cache_hit_rate_later_steps"],
                "valid calls": f"{f['valid_calls']}/{f['tool_calls']}",
                "errors": f["errors"],
                "load": f["load_before"]["load_1m"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_side_args(p, default_sides="radixlm,radixlm-noradix,hf")
    p.add_argument("--num-agents", type=int, default=8, help="agents running at once")
    p.add_argument("--steps", type=int, default=6, help="tool-calling steps per agent")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens of each step")
    p.add_argument("--tool-choice", default="required", choices=("required", "auto"))
    p.add_argument(
        "--parallel-tool-calls", action="store_true", help="let a step make several calls (default: one)"
    )
    p.add_argument("--seed", type=int, default=0, help="task sampling seed")
    args = p.parse_args(argv)
    if args.quick:
        args.num_agents, args.steps, args.max_tokens = 2, 3, 64
    common.setup_env()
    env = common.environment()
    env["load_before"] = common.load_average()
    names = side_names(args.sides, (RADIXLM_SERVER, *PEERS))
    check_installed([n for n in names if n in PEERS])  # the install hint before any side runs
    task_list = cat.tasks(args.num_agents, args.seed)
    warm = cat.tasks(1, args.seed + 1)
    per_side: dict[str, dict[str, Any]] = {}
    traces: dict[str, list[Trace]] = {}
    for name in names:
        print(f"[agent_loop] opening {name} ...", flush=True)
        with open_chat_side(name, args) as side:
            per_side[name], traces[name] = measure(side, task_list, warm, args.steps)
    baseline = "radixlm-noradix" if "radixlm-noradix" in per_side else (HF if HF in per_side else None)
    for other in {baseline, HF, *PEERS} - {None}:
        if other in per_side:
            for f in per_side.values():
                f[f"speedup_vs_{other}"] = common.ratio(f["steps_per_s"], per_side[other]["steps_per_s"])
    results: dict[str, Any] = {"sides": per_side, "baseline": baseline}
    if len(names) > 1:
        results["agreement"] = {"reference": names[0]}
        results["agreement"] |= {n: agreement(traces[names[0]], traces[n]) for n in names[1:]}
    config = {
        "command": common.command_line(),
        "num_agents": args.num_agents,
        "steps": args.steps,
        "max_tokens": args.max_tokens,
        "tool_choice": args.tool_choice,
        "parallel_tool_calls": args.parallel_tool_calls,
        "tools": len(cat.TOOLS),
        "sides": names,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    name = args.name or "agent_loop"
    print()
    common.print_table(summary_rows(per_side, baseline), title="== agent_loop ==")
    if "agreement" in results:
        print("trajectory agreement:", {k: v for k, v in results["agreement"].items()})
    common.bar_chart(
        common.plot_path(name, args.results_dir),
        list(per_side),
        {"steps/s": [f["steps_per_s"] for f in per_side.values()]},
        "agent steps / s",
        f"{name}: {args.num_agents} agents x {args.steps} steps, {len(cat.TOOLS)} tools",
    )
    common.write_results(name, config, results, env, args.results_dir)
    return results


if __name__ == "__main__":
    main()
