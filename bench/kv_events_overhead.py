"""What KV cache events cost the scheduler: the share of its step time spent making and publishing them.

The real `Scheduler` with the default model runs a shared-prefix workload at batch 32 (every request one
long shared system prompt plus its own question; new requests arrive as others finish, and the pool is
small enough that the radix cache evicts), twice: events off, and on (`--kv-events-config` with the ZMQ
publisher and a subscriber draining it). With events on, the time inside the event code (the radix tree's
listener: block hashes and event records; the publisher: msgpack and send; replay polling) is timed
directly, so its share of the step time does not depend on what else the machine is doing. The issue's
bound: under 1% of a decode step at batch 32, and nothing when off (no listener is attached).

    python -m bench.kv_events_overhead                     # 96 requests, batch 32
    python -m bench.kv_events_overhead --requests 64 --name kv_events_overhead_small

Writes bench/results/<name>.json: per side, steps, mean decode step, and (events on) events' seconds, their
share of all step time and per decode step, events and batches published.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from typing import Any

import zmq

from bench.harness.common import command_line, write_results
from runtime.managers.scheduler import kv_events
from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq
from runtime.models.model_loader import load_tokenizer, resolve_model_path
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

TIMED = (
    (kv_events.BlockEvents, ("stored", "removed", "cleared")),
    (kv_events.ZmqEventPublisher, ("publish", "serve_replay")),
)


class EventClock:
    """Seconds spent inside the event code: wraps the listener's and publisher's methods while active."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> EventClock:
        for cls, names in TIMED:
            for name in names:
                original = getattr(cls, name)
                self._saved.append((cls, name, original))
                setattr(cls, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return wrapper


def drain(endpoint: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """A subscriber, as a router would run one: receives every batch until `stop`."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 100)
    sock.connect(endpoint)
    while not stop.is_set():
        try:
            sock.recv_multipart()
            counts["received"] += 1
        except zmq.Again:
            continue
    sock.close(0)


def workload(tokenizer, n: int, prefix_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prefix = [rng.randrange(1000, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(1000, vocab) for _ in range(rng.randint(32, 96))] for _ in range(n)]


def run_side(args, model_dir: str, tokenizer, prompts: list[list[int]], events_config: str | None) -> dict:
    server_args = ServerArgs(
        model=model_dir,
        max_running_requests=args.batch,
        max_total_tokens=args.max_total_tokens,
        log_interval=0,
        kv_events_config=events_config,
    )
    s = Scheduler(server_args, model_dir, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=0)
    pending = list(enumerate(prompts))
    step_seconds, decode_seconds, decode_steps = 0.0, 0.0, 0
    clock = EventClock()
    with clock:
        while pending or s.has_work():
            while pending and len(s.live_requests()) < args.batch + 4:  # a few waiting: arrivals keep up
                i, prompt = pending.pop(0)
                s.handle(GenerateReq(rid=f"r{i}", input_ids=prompt, params=params))
            before = s.stats["decode_steps"]
            t0 = time.perf_counter()
            s.step()
            if s.kv_publisher is not None:
                s.publish_events()  # the process loop does this after every step
            dt = time.perf_counter() - t0
            step_seconds += dt
            if s.stats["decode_steps"] > before:
                decode_seconds += dt
                decode_steps += 1
    out = {
        "steps_seconds": round(step_seconds, 3),
        "decode_steps": decode_steps,
        "decode_step_ms": round(1000 * decode_seconds / max(decode_steps, 1), 2),
        "generated_tokens": int(s.stats["generated_tokens"]),
    }
    if s.kv_publisher is not None:
        out.update(
            events_seconds=round(clock.seconds, 4),
            events_share_of_step_time=round(clock.seconds / step_seconds, 5),
            events_ms_per_decode_step=round(1000 * clock.seconds / max(decode_steps, 1), 4),
            **s.kv_publisher.info(),
        )
        s.kv_publisher.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--max-total-tokens", type=int, default=12000, help="small enough that the cache evicts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="kv_events_overhead")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = workload(tokenizer, args.requests, args.prefix_tokens, args.seed)
    endpoint = "ipc:///tmp/radixlm-kv-events-overhead"
    stop, counts = threading.Event(), {"received": 0}
    consumer = threading.Thread(target=drain, args=(endpoint, stop, counts), daemon=True)
    consumer.start()
    config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{endpoint}"}}'
    results = {}
    for side, side_config in (("events_off", None), ("events_on", config)):
        results[side] = run_side(args, model_dir, tokenizer, prompts, side_config)
        print(side, results[side], flush=True)
    time.sleep(0.3)
    stop.set()
    consumer.join()
    results["events_on"]["batches_received_by_subscriber"] = counts["received"]
    on, off = results["events_on"], results["events_off"]
    print(f"events off: {off['decode_steps']} decode steps, {off['decode_step_ms']} ms each")
    print(
        f"events on:  {on['decode_steps']} decode steps, {on['decode_step_ms']} ms each; events "
        f"{on['events_seconds']} s = {100 * on['events_share_of_step_time']:.3f}% of step time, "
        f"{on['events_ms_per_decode_step']} ms per decode step; {on['kv_event_batches']} batches "
        f"({counts['received']} received)"
    )
    write_results(args.name, {**vars(args), "command": command_line()}, results)


if __name__ == "__main__":
    main()
