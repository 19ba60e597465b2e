"""--dp-size: options, the replica and router command lines, the missing-extra error, and the fields
sglang-router adds to the requests it forwards (accepted when off, refused by name when on)."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from runtime.entrypoints import data_parallel as dp
from runtime.entrypoints.generate_input import parse_generate_body
from runtime.launch_server import parse_args
from runtime.server_args import ServerArgs

# What sglang-router 0.3.2 sent, captured from its forwarded bodies.
ROUTER_GENERATE_EXTRAS = {
    "model": None,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
ROUTER_OPENAI_EXTRAS = {
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}


def test_replica_ports_default_after_public_port():
    args = ServerArgs(port=30000, dp_size=3)
    assert list(args.dp_replica_ports) == [30001, 30002, 30003]
    assert list(ServerArgs(port=30000, dp_size=2, dp_base_port=40000).dp_replica_ports) == [40000, 40001]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp_size": 0}, "--dp-size must be >= 1"),
        ({"dp_size": 2, "port": 30000, "dp_base_port": 29999}, "include the public --port 30000"),
        ({"dp_size": 4, "port": 30000, "dp_base_port": 65534}, "outside 1..65535"),
        ({"dp_size": 2, "router_policy": "fastest"}, "--router-policy must be one of"),
    ],
)
def test_bad_dp_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_replica_command_round_trips_every_user_option(monkeypatch):
    """A replica gets every option the user set (parsed back to the same values), on its own port, with
    the front-only options reset; the keys come through its environment, not its command line."""
    front = parse_args(
        [
            "--port", "31000", "--host", "0.0.0.0", "--dp-size", "2", "--router-policy", "round_robin",
            "--max-total-tokens", "5000", "--disable-radix-cache", "--schedule-policy", "fcfs",
            "--new-token-ratio", "0.25", "--api-key", "k", "--num-threads", "3",
            "--lora-modules", "a=/adapters/a", "b=/adapters/b",
        ]
    )  # fmt: skip
    argv = dp.replica_cli_args(front, 31002)
    assert "k" not in argv
    monkeypatch.setattr(os, "environ", dp.child_env(front))
    replica = parse_args(argv)
    expected = dataclasses.replace(
        front, host="127.0.0.1", port=31002, dp_size=1, router_policy="cache_aware", dp_rank=1
    )
    assert replica == expected  # the second replica (base port 31001): rank 1, for its KV events
    # every replica learns all the replicas (a LoRA load passes from one to the others); the router not
    assert dp.child_env(front)[dp.REPLICAS_ENV] == "http://127.0.0.1:31001,http://127.0.0.1:31002"
    assert dp.REPLICAS_ENV not in dp.child_env(front, router=True)


def test_replica_threads_split_the_cpus(monkeypatch):
    monkeypatch.setattr(dp, "auto_num_threads", lambda: 8)
    assert dp.replica_threads(ServerArgs(dp_size=2)) == 4
    assert dp.replica_threads(ServerArgs(dp_size=16)) == 1
    assert dp.replica_threads(ServerArgs(dp_size=2, num_threads=3)) == 3  # explicit: per replica


def test_router_command_parses_with_the_routers_own_parser():
    pytest.importorskip("sglang_router")
    from sglang_router.launch_router import parse_router_args

    args = ServerArgs(host="127.0.0.1", port=31000, dp_size=2, router_policy="round_robin", api_key="k")
    urls = ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    parsed = parse_router_args(dp.router_cli_args(args, urls, 31999))
    assert parsed.worker_urls == urls
    assert (parsed.host, parsed.port, parsed.policy) == ("127.0.0.1", 31000, "round_robin")
    assert (parsed.prometheus_host, parsed.prometheus_port) == ("127.0.0.1", 31999)  # never 0.0.0.0
    assert parsed.api_key is None  # not on its command line: `router_main` adds it from the environment
    assert dp.child_env(args, router=True)["RADIXLM_API_KEY"] == "k"
    assert parsed.max_payload_size == args.max_request_bytes


def test_missing_router_extra_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(dp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dp.RouterNotInstalled, match=r"pip install 'radixlm\[router\]'"):
        dp.check_router_installed()
    assert dp.run_data_parallel(ServerArgs(dp_size=2)) == 2
    assert "--dp-size needs the router extra: pip install 'radixlm[router]'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_busy_port_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        other = busy + 10 if busy < 65000 else busy - 10
        with pytest.raises(RuntimeError, match=f"port {busy} of --port is not free"):
            dp.check_ports_free(ServerArgs(port=busy, dp_size=2, dp_base_port=other))
        free = _free_port()
        while free in (busy, busy + 1):
            free = _free_port()
        with pytest.raises(RuntimeError, match=f"port {busy} of replica 0"):
            dp.check_ports_free(ServerArgs(port=free, dp_size=2, dp_base_port=busy))


def test_local_url():
    assert dp.local_url("0.0.0.0", 8) == "http://127.0.0.1:8"
    assert dp.local_url("::", 8) == "http://[::1]:8"
    assert dp.local_url("10.0.0.2", 8) == "http://10.0.0.2:8"


def test_generate_accepts_router_fields_when_off():
    reqs, _ = parse_generate_body({"text": "hi", **ROUTER_GENERATE_EXTRAS})
    assert reqs[0].text == "hi"


@pytest.mark.parametrize("field", ["return_hidden_states", "background", "return_bytes", "return_entropy"])
def test_generate_refuses_router_features_we_lack(field):
    with pytest.raises(ValueError, match=f"'{field}' is not supported"):
        parse_generate_body({"text": "hi", field: True})
    with pytest.raises(ValueError, match=f"'{field}' must be a boolean"):
        parse_generate_body({"text": "hi", field: "no"})


def test_openai_bodies_accept_router_fields():
    from pydantic import ValidationError

    from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(model="m", prompt="hi", **ROUTER_OPENAI_EXTRAS)
    assert body.no_stop_trim is False
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], continue_final_message=False,
        max_completion_tokens=4, **ROUTER_OPENAI_EXTRAS,
    )  # fmt: skip
    assert chat.max_completion_tokens == 4
    with pytest.raises(ValidationError, match="return_hidden_states is not supported"):
        CompletionRequest(model="m", prompt="hi", return_hidden_states=True)


def test_engine_refuses_dp():
    from runtime.engine import Engine

    with pytest.raises(ValueError, match="--dp-size is for the HTTP server"):
        Engine(dp_size=2)
