"""The llamacpp benchmark side: it names the missing package and how to install it, runs only GGUF files,
and is wired into decode_throughput, serving and run_all's headlines. The decode test runs only where the
`bench` extra (llama-cpp-python) is installed; everything else needs no llama.cpp."""

from __future__ import annotations

import argparse
import sys

import pytest

from bench import decode_throughput, serving
from bench.harness import llamacpp
from bench.run_all import HEADLINES, headline_row


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError


def test_missing_llama_cpp_is_a_clear_error(no_llama_cpp):
    with pytest.raises(RuntimeError, match=r"llama-cpp-python.*not installed.*\.\[bench\]"):
        llamacpp.import_llama_cpp()
    with pytest.raises(RuntimeError, match="llama-cpp-python"):
        llamacpp.server_command("/x.gguf", 1, 1, 512)
    # decode_throughput fails before it loads anything for the other sides
    with pytest.raises(RuntimeError, match="make bench"):
        decode_throughput.main(["--sides", "radixlm,llamacpp", "--results-dir", "/nonexistent"])


def test_gguf_file_is_the_default_models_file_or_a_gguf(tmp_path):
    from runtime.models.model_loader import default_gguf_path

    assert llamacpp.gguf_file("default") == default_gguf_path()
    assert llamacpp.gguf_file("default").endswith(".gguf")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(8))
    assert llamacpp.gguf_file(str(fake)) == str(fake)
    other = tmp_path / "config.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="not one"):
        llamacpp.gguf_file(str(other))
    with pytest.raises(ValueError, match="not a file"):
        llamacpp.gguf_file(str(tmp_path))


def test_unknown_sides_are_rejected():
    with pytest.raises(SystemExit):
        decode_throughput.main(["--sides", "radixlm,vllm-gpu"])
    with pytest.raises(SystemExit):
        serving.main(["--sides", "radixlm,llamacpp"])  # needs --launch-server


def test_serving_runs_each_server_alone_in_order(monkeypatch):
    monkeypatch.setattr(serving, "gguf_file", lambda model: "/m.gguf")
    monkeypatch.setattr(
        serving, "server_command", lambda gguf, port, threads, n_ctx: ["llama", gguf, threads]
    )
    args = argparse.Namespace(
        launch_server=True, server_args=["", "--disable-radix-cache"], port=5, backend="native",
        llamacpp_n_ctx=4096, url=None, dp_size=1, router_policy="cache_aware",
    )  # fmt: skip

    class Tok:
        all_special_ids = [0, 2]

    runs = serving._servers(args, ["radixlm", "llamacpp"], 3, Tok())
    assert [r[0] for r in runs] == ["radixlm", "--disable-radix-cache", "llamacpp"]
    assert runs[0][1][-2:] == ["--num-threads", "3"] and runs[1][1][-1] == "--disable-radix-cache"
    label, cmd, health, backend, body = runs[2][:5]
    assert cmd == ["llama", "/m.gguf", 3] and health == "/v1/models" and backend == "openai"
    assert body == {"logit_bias": {"0": -100.0, "2": -100.0}}  # no ignore_eos in llama.cpp: EOS banned
    args.launch_server = False
    external = serving.ServerRun("external", None, None, "native", None)
    assert serving._servers(args, ["radixlm"], 3, Tok()) == [external]


def test_headlines_compare_decode_with_llamacpp():
    doc = {
        "results": {
            "by_dtype": {
                "float32": {
                    "batch_sizes": {
                        "1": {"radixlm": {"decode_tok_s": 14.0}, "llamacpp": {"decode_tok_s": 70.0}},
                        "32": {"radixlm": {"decode_tok_s": 200.0}, "llamacpp": {"decode_tok_s": 100.0}},
                    }
                }
            }
        }
    }
    single = next(h for h in HEADLINES if h.reference == "llamacpp" and h.batch == "1")
    row = headline_row(single, doc)
    assert row["ratio"] == pytest.approx(0.2) and row["met"] is False  # target 0.7x of llama.cpp
    big = next(h for h in HEADLINES if h.reference == "llamacpp" and h.batch == "32")
    assert headline_row(big, doc)["ratio"] == pytest.approx(2.0)


def test_batch_decoder_runs_the_default_gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) is not installed")
    import torch

    dec = llamacpp.BatchDecoder(llamacpp.gguf_file("default"), max_seqs=3, max_tokens_per_seq=32, threads=1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = dec.decode(3, 8, 4, gen, return_tokens=True)
        assert len(a["tokens"]) == 3 and all(len(t) == 4 for t in a["tokens"])
        assert a["decode_tok_s"] > 0 and a["step_ms"] > 0
        # The KV cache was cleared: the same prompts decode to the same tokens again, alone or batched.
        gen = torch.Generator().manual_seed(0)
        assert dec.decode(3, 8, 4, gen, return_tokens=True)["tokens"] == a["tokens"]
        with pytest.raises(ValueError, match="exceeds the context"):
            dec.decode(4, 8, 4, gen)
    finally:
        dec.close()
