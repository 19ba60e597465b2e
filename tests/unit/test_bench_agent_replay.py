"""bench/agent_replay.py without servers: the seeded trace, the prefix a call's prompt shares with what the
server computed before, the slots llama-server needs for the longest program, the per-side medians (a peer
that reports no cached tokens gives None, not 0), and an unknown side refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench import agent_replay as ar


def _args(**over):
    base = dict(seed=3, programs=6, long_fraction=0.5, long_turns=(4, 6), short_turns=(2, 3), fork_prob=0.5)
    base.update(catalogue_tokens=50, task_tokens=20, growth_tokens=10, max_new_tokens=4, arrival_gap_s=2.0)
    base.update(pause_median_s=1.0, pause_p95_s=10.0, pause_scale=1.0)
    return SimpleNamespace(**{**base, **over})


def test_the_trace_is_seeded_and_follows_its_parameters():
    a, b = ar.make_trace(_args()), ar.make_trace(_args())
    assert a == b
    assert a != ar.make_trace(_args(seed=4))
    assert len(a["catalogue"]) == 50 and len(a["programs"]) == 6
    for p in a["programs"]:
        lo, hi = (4, 6) if p["long"] else (2, 3)
        assert lo <= len(p["calls"]) <= hi
        assert all(c["fork"] is None for c in p["calls"]) or p["long"]  # only long programs fork
    starts = [p["start"] for p in a["programs"]]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_the_longest_program_bounds_every_history_it_sends():
    args = _args()
    trace = ar.make_trace(args)
    most = ar.longest_program(trace, args)
    for p in trace["programs"]:
        n = len(trace["catalogue"]) + len(p["task"])
        for c in p["calls"]:
            n += args.max_new_tokens + len(c["tool"])
            n += args.max_new_tokens * len(c["fork"] or ())  # each fork's output joins the parent's history
            for sub in c["fork"] or ():  # a sub-agent's own prompt: the parent's history and its task
                assert n + len(sub["task"]) <= most
        assert n <= most


def test_computed_before_is_the_shared_prefix_less_the_last_tokens():
    assert ar.computed_before(None, [1, 2, 3]) == 0
    assert ar.computed_before([1, 2, 3, 9], [1, 2, 3, 9, 5, 6]) == 3  # the output's last token has no KV
    assert ar.computed_before([1, 2, 7, 8], [1, 2, 3, 4]) == 2


def test_a_side_without_reported_cached_tokens_has_none_not_zero():
    def run(p50, rec, slow=(1.0, 1.0)):
        jct = {"p50": p50, "p90": p50, "p99": p50}
        return {
            "jct_s": jct, "jct_short_s": jct, "jct_long_s": jct, "programs_per_min": 1.0,
            "call_latency_s": jct, "prefill_tokens": rec, "prefill_recomputed": rec, "kv_pool": "x",
            "server_time_s": jct, "slowdown": {"p50": slow[0], "p99": slow[1]},
        }  # fmt: skip

    peer = ar.summarize_side("llama-server", [run(3.0, None), run(5.0, 10)])
    assert peer["prefill_recomputed"] is None and peer["jct_p50_s"] == 4.0
    ours = ar.summarize_side("lpm", [run(3.0, 20, (1, 3)), run(5.0, 10, (2, 10)), run(4.0, 30, (4, 16))])
    assert ours["prefill_recomputed"] == 20 and ours["kv_pool"] == "x"
    # per trace (3, 5, 4), then the median: 4, where the medians' ratio would be 10 / 2 = 5
    assert ours["slowdown_p99_over_p50"] == 4.0 and ours["slowdown_p50"] == 2 and ours["slowdown_p99"] == 10
    assert ar._na(None) == "n/a" and ar._na(12.0) == "12"


def test_tool_time_is_the_pauses_between_calls_and_a_forks_slower_sub_agent():
    sub = lambda pause, calls: {"task": [1], "calls": calls, "pause": pause}  # noqa: E731
    prog = {
        "calls": [
            {"pause": 1.0, "tool": [1], "fork": [sub(0.5, 2), sub(2.0, 3)]},  # sub-agents pause 0.5 and 4 s
            {"pause": 3.0, "tool": [1], "fork": None},
            {"pause": 9.0, "tool": [1], "fork": None},  # the last call's pause is never slept
        ]
    }
    assert ar.tool_time(prog) == pytest.approx(1.0 + 3.0 + 4.0)


def test_scale_down_sets_defaults_that_flags_given_with_it_override():
    args = ar.parse_args(["--scale-down"])
    assert (args.programs, args.arrival_gap_s, args.long_turns) == (8, 1.0, (6, 10))
    args = ar.parse_args(["--scale-down", "--programs", "16", "--arrival-gap-s", "0.3"])
    assert (args.programs, args.arrival_gap_s, args.catalogue_tokens) == (16, 0.3, 200)


def test_an_unknown_side_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        ar.main(["--sides", "lpm,sglang"])
    assert "sglang" in capsys.readouterr().err


def test_kv_bytes_per_token_reads_the_folders_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}'
    )
    assert ar.kv_bytes_per_token(str(tmp_path)) == 30 * 3 * 64 * 2 * 2  # K and V, bfloat16


@pytest.mark.parametrize("side", [ar.VLLM, ar.LLAMA_SERVER])
def test_peers_get_radixlm_s_kv_budget_with_peer_kv_pool(side):
    from bench.harness.peers import PeerNotInstalled

    args = _args(threads=2, peer_kv="pool")
    trace = ar.make_trace(args)
    try:
        spec = ar.peer_side_spec(side, 12345, args, trace, 1195)
    except PeerNotInstalled as e:
        pytest.skip(f"{side} is not installed (make bench-peers): {e}")
    cmd = spec.command
    if side == ar.VLLM:
        assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "11"  # 1195 tokens: 10 blocks + vLLM's null
        size = int(cmd[cmd.index("--kv-cache-memory-bytes") + 1])
        assert size >= 11 * 128 * ar.kv_bytes_per_token(spec.model)
        assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env and cmd[cmd.index("--max-model-len") + 1] == "1195"
    else:
        slots = int(cmd[cmd.index("-np") + 1])
        per_slot = int(cmd[cmd.index("-c") + 1]) // slots
        assert slots * per_slot <= 1195 and per_slot >= ar.longest_program(trace, args) + args.max_new_tokens
        assert cmd[cmd.index("--cache-ram") + 1] == "0"
    assert spec.notes["kv_pool"].startswith(("1", "1280"))


def test_a_programs_slowdown_is_its_job_time_over_its_tools_and_its_time_alone():
    sub = {"task": [1], "calls": 2, "pause": 2.0}
    prog = {
        "start": 7.0,
        "calls": [{"pause": 1.0, "tool": [1], "fork": [sub]}, {"pause": 5.0, "tool": [1], "fork": None}],
    }
    bare = ar.without_pauses(prog)
    assert bare["start"] == 0.0 and ar.tool_time(bare) == 0.0
    assert bare["calls"][1]["fork"] is None and prog["calls"][0]["fork"][0]["pause"] == 2.0  # a copy
    assert ar.tool_time(prog) == 3.0  # 1 s, and the sub-agent's one pause of 2 s
    trace = {"programs": [prog, {**prog, "calls": prog["calls"][1:]}]}  # the second: no pauses at all
    assert ar.slowdowns([4.0, 3.0], trace, [1.0, 1.5]) == [1.0, 2.0]


def test_arrivals_follow_the_measured_speed_with_arrival_load():
    trace = ar.make_trace(_args())
    slow = ar.rescale_arrivals(trace, 2.0, 5.0)
    assert [p["start"] for p in slow["programs"]] == pytest.approx(
        [2.5 * p["start"] for p in trace["programs"]]
    )
    assert [p["calls"] for p in slow["programs"]] == [p["calls"] for p in trace["programs"]]
    assert slow["catalogue"] == trace["catalogue"] and trace == ar.make_trace(_args())  # not changed in place
    assert ar.parse_args(["--arrival-load", "2"]).arrival_load == 2.0
    for bad in (["--arrival-load", "0"], ["--arrival-load", "1", "--arrival-gap-s", "0"]):
        with pytest.raises(SystemExit):
            ar.parse_args(bad)
