"""bench/sized.py's pieces that run without the peers: the random folder it writes (a model transformers
loads, in shards), the weight bytes one token reads, and how its figures become README rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report, sized

TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_the_random_folder_is_a_model_transformers_loads(tmp_path, monkeypatch, tied):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(sized.SHAPES, "tiny", {**TINY, "tie_word_embeddings": tied})
    monkeypatch.setattr(sized, "SHARD_BYTES", 200_000)  # several shards, as the 8B folder has
    out = tmp_path / "hf"
    sized.write_hf_folder("tiny", out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings is tied and model.config.architectures == ["LlamaForCausalLM"]
    assert model.dtype == torch.bfloat16 and (out / "tokenizer.json").is_file()
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert all(bool((p == 1).all()) for p in norms)
    weights = model.model.layers[0].self_attn.q_proj.weight.detach().float()
    assert 0.015 < float(weights.std()) < 0.025
    # bytes a token reads from the folder: every matrix; the embedding only when it is the LM head too
    embed = model.model.embed_tokens.weight.numel() * 2
    total = sum(p.numel() * 2 for p in model.state_dict().values()) - (embed if tied else 0)
    assert sized.folder_read_bytes(out) == (total if tied else total - embed)


def _side(k: float) -> dict:
    return {
        "decode_1": {"decode_tok_s": 30 * k}, "decode_32": {"decode_tok_s": 150 * k},
        "decode_bandwidth_gb_s": 20 * k, "ttft": {"ttft_s": 5 / k}, "agent_loop": {"steps_per_s": k},
    }  # fmt: skip


def test_figures_become_rows_with_radixlm_ahead_above_one(tmp_path: Path):
    config = {"command": "python -m bench.sized --size 1b", "size": "1b", "streams": [1, 32]}
    sides = {"radixlm": _side(2.0), "llama-server": _side(1.0), "vllm": {"skipped": "memory"}}
    doc = {
        "name": "sized_1b",
        "config": {**config, "agents": 8, "agent_steps": 4},
        "environment": {"cpu_cores": 2, "cpu_model": "X", "cpu_flags": ["avx2"]},
        "results": {"sides": sides, "memory_bandwidth": {"copy_gb_s": 50.0}},
    }
    (tmp_path / "sized_1b.json").write_text(json.dumps(doc))
    rows = {r[0]: r[1:] for r in report._sized_rows(doc)}
    assert rows["1B: decode tok/s, 1 stream"] == ["60.0", "–", "30.0", "–", "2.00×", "–"]
    assert rows["1B: TTFT of 2,000 tokens, s"] == ["2.50", "–", "5.00", "–", "2.00×", "–"]  # theirs ÷ ours
    bandwidth = rows["1B: weights read at 1 stream, GB/s (share of a 50.0 GB/s copy)"]
    assert bandwidth[:3] == ["40.0 (80%)", "–", "20.0 (40%)"]
    assert "1B: agent loop, 8 agents × 4 steps: steps/s" in rows
    head = {r[0]: r[1:] for r in report._sized_headline_rows(doc)}
    assert head["1B Q4_K_M file: decode tok/s, 32 streams"] == ["300.0", "–", "150.0", "2.00×"]
    assert head["1B Q4_K_M file: TTFT of 2,000 tokens, s (ratio: best peer ÷ radixlm)"][-1] == "2.00×"
    assert "bench/results/sized_1b.json" in report.sized(tmp_path)


# ------------------------------------------------------------------------------------------ the MoE file
MOE_TINY = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "tie_word_embeddings": False, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "model-Q4_K_M.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sized.SHAPES, "tiny-moe", MOE_TINY)
        sized.write_moe_gguf("tiny-moe", path)
    return path


def test_the_moe_file_has_the_converters_tensors_in_q4_k_ms_types(moe_file: Path):
    """qwen3moe's keys and tensor names (stacked experts [n_expert, out, in], the router, q/k norms) with
    llama-quantize's Q4_K_M types: attn_v and ffn_down_exps Q6_K on its layers, the LM head Q6_K, the rest
    Q4_K, norms and the router F32."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from runtime.models.gguf_arch import open_reader

    reader = open_reader(str(moe_file))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "qwen3moe" and meta["general.file_type"] == 15
    assert meta["qwen3moe.expert_count"] == 8 and meta["qwen3moe.expert_used_count"] == 2
    assert meta["qwen3moe.expert_feed_forward_length"] == 256 and meta["qwen3moe.block_count"] == 8
    tensors = {t.name: t for t in reader.tensors}
    gate = tensors["blk.3.ffn_gate_exps.weight"]
    assert [int(d) for d in gate.shape] == [256, 256, 8]  # ggml's order: in, out, n_expert
    assert [int(d) for d in tensors["blk.3.ffn_down_exps.weight"].shape] == [256, 256, 8]
    assert [int(d) for d in tensors["blk.0.attn_k.weight"].shape] == [256, 128]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type == Q.F32
    assert tensors["output.weight"].tensor_type == Q.Q6_K
    wide = [i for i in range(8) if tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type == Q.Q6_K]
    assert wide == [i for i in range(8) if sized.more_bits(i, 8)] == [0, 3, 6, 7]
    assert tensors["blk.3.attn_v.weight"].tensor_type == Q.Q6_K
    assert tensors["blk.1.attn_v.weight"].tensor_type == tensors["blk.1.ffn_gate_exps.weight"].tensor_type
    assert tensors["blk.1.attn_v.weight"].tensor_type == Q.Q4_K
    # random blocks whose weights spread as N(0, 0.02) would: finite, centred, that deviation
    for name in ("blk.1.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"):
        t = tensors[name]
        w = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(w).all() and abs(float(w.mean())) < 2e-3, name
        assert 0.017 < float(w.std()) < 0.023, name
    # a token reads the routed experts' share of the stacked tensors, everything else whole
    exps = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." in n)
    rest = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." not in n and n != "token_embd.weight")
    assert sized.gguf_read_bytes(moe_file) == int(rest + exps * 2 / 8)


def test_the_moe_file_serves_in_radixlm_with_the_bundled_tokenizer(moe_file: Path, tmp_path: Path):
    """radixlm loads the file (gguf_native: the experts' blocks in place) and its logits are finite and not
    flat; the tokenizer it builds from the file's vocabulary encodes as the bundled model's does."""
    import torch

    from runtime.models import model_loader as ml
    from tests.unit.test_gguf_architectures import runner_for, served_logits

    folder = ml.resolve_model_path(str(moe_file), str(tmp_path / "cache"))
    text = "Hello, world! <|im_start|>user\nCall the tool.<|im_end|>"
    bundled = ml.load_tokenizer(ml.resolve_model_path("default"))
    assert ml.load_tokenizer(folder).encode(text) == bundled.encode(text)
    runner = runner_for(folder, quantization="gguf_native")
    logits = served_logits(runner, [list(range(100, 130))])[0]
    assert bool(torch.isfinite(logits).all())
    assert float(logits.std(-1).min()) > 0.1  # hidden 256: logits spread ~0.02 x 16


def test_the_30b_plan_is_a_q4_k_m_sized_file():
    """Qwen3-30B-A3B's shape in the Q4_K_M mix: ~18 GB on disk, ~1.7 GB read a token (8 of 128 experts)."""

    plan = sized.moe_tensors(sized.SHAPES["30b-a3b"], 49152)
    size = plan_bytes(plan)
    assert 17e9 < sum(size.values()) < 19e9
    active = sum(v * (8 / 128 if "_exps." in n else 1) for n, v in size.items() if n != "token_embd.weight")
    assert 1.5e9 < active < 2.0e9
    assert sum(1 for n, q, _ in plan if n.endswith("ffn_down_exps.weight") and q == "Q6_K") == 24


def plan_bytes(plan: list) -> dict[str, int]:
    """Bytes of each tensor of a `write_moe_gguf` plan."""
    import numpy as np

    out = {}
    for name, qtype, dims in plan:
        block, size = (1, 4) if qtype == "F32" else sized.BLOCKS[qtype]
        out[name] = int(np.prod(dims)) // block * size
    return out


def test_the_gpt_oss_plan_is_an_mxfp4_moe_sized_file():
    """gpt-oss-20b's shape in llama-quantize's MXFP4_MOE mix on SmolLM2's vocabulary: ~11 GB on disk (the
    released 12.1 GB file less the 201,088-token vocabulary's rows), ~2.1 GB read a token (4 of 32
    experts), every expert MXFP4 and every other matrix but the router Q8_0."""
    shape = sized.SHAPES["gpt-oss-20b"]
    plan = sized.gpt_oss_tensors(shape, 49152)
    size = plan_bytes(plan)
    assert 10.5e9 < sum(size.values()) < 11.5e9
    active = sum(v * (4 / 32 if "_exps." in n else 1) for n, v in size.items() if n != "token_embd.weight")
    assert 1.9e9 < active < 2.3e9
    types = {(n.rsplit(".", 2)[-2], q) for n, q, _ in plan if n.endswith(".weight") and q != "F32"}
    assert {t for part, t in types if part.endswith("_exps")} == {"MXFP4"}
    assert {t for part, t in types if not part.endswith("_exps")} == {"Q8_0"}
    assert sized.file_quant("gpt-oss-20b", None) == "MXFP4_MOE" and sized.file_quant("8b", None) == "Q4_K_M"
    with pytest.raises(SystemExit, match="written as MXFP4_MOE only"):
        sized.file_quant("gpt-oss-20b", "Q4_K_M")


GPT_OSS_TINY = {
    "arch": "gpt-oss", "quant": "MXFP4_MOE", "hidden_size": 256, "intermediate_size": 256,
    "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16,
    "tie_word_embeddings": False, "rope_theta": 150000.0, "rope_yarn": (32.0, 4096), "rms_norm_eps": 1e-5,
}  # fmt: skip


def test_the_gpt_oss_file_serves_in_radixlm(tmp_path: Path):
    """A tiny gpt-oss file as the bench writes it: llama.cpp's gpt-oss keys and tensors, MXFP4 blocks whose
    weights spread as N(0, 0.02); radixlm serves it in place (experts as MXFP4 GGUFExperts) with finite,
    spread logits."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from runtime.models import model_loader as ml
    from runtime.models.gguf_arch import open_reader
    from runtime.models.moe_fused import GGUFExperts
    from tests.unit.test_gguf_architectures import runner_for, served_logits

    path = tmp_path / "model-MXFP4_MOE.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sized.SHAPES, "tiny-oss", GPT_OSS_TINY)
        sized.write_moe_gguf("tiny-oss", path)
    reader = open_reader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "gpt-oss" and meta["general.file_type"] == 38
    assert meta["gpt-oss.attention.sliding_window"] == 16 and meta["gpt-oss.rope.scaling.type"] == "yarn"
    tensors = {t.name: t for t in reader.tensors}
    up = tensors["blk.2.ffn_up_exps.weight"]
    assert up.tensor_type == Q.MXFP4 and tensors["blk.2.attn_q.weight"].tensor_type == Q.Q8_0
    for t in (up, tensors["blk.2.attn_q.weight"]):
        w = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(w).all() and abs(float(w.mean())) < 2e-3 and 0.016 < float(w.std()) < 0.026
    folder = ml.resolve_model_path(str(path), str(tmp_path / "cache"))
    runner = runner_for(folder, quantization="gguf_native")
    assert all(isinstance(layer.mlp.experts, GGUFExperts) for layer in runner.model.layers)
    logits = served_logits(runner, [list(range(100, 140))])[0]
    assert bool(torch.isfinite(logits).all()) and float(logits.std(-1).min()) > 0.1


def test_the_moe_result_is_one_headline_row_and_its_sized_rows():
    """A mixture of experts' result: one README row with both decode figures in each cell (vLLM skipped:
    no folder), and the docs rows with the weights a token reads and each side's peak memory."""
    sides = {
        "radixlm": {**_side(2.0), "decode_8": {"decode_tok_s": 40.0}, "weights_read_per_token_gb": 1.7,
                    "peak_rss_gb": {"start_up": 18.0, "run": 19.5}},
        "llama-server": {**_side(1.0), "decode_8": {"decode_tok_s": 50.0}, "weights_read_per_token_gb": 1.7,
                         "peak_rss_gb": {"start_up": 18.5, "run": 19.0}},
        "vllm": {"skipped": "no bfloat16 folder"},
    }  # fmt: skip
    doc = {
        "name": "sized_30b_a3b",
        "config": {"command": "python -m bench.sized --size 30b-a3b", "size": "30b-a3b", "streams": [1, 8],
                   "shape": sized.SHAPES["30b-a3b"], "agents": 0},
        "environment": {"cpu_cores": 2, "cpu_model": "X", "cpu_flags": ["avx2"]},
        "results": {"sides": sides, "memory_bandwidth": {"copy_gb_s": 50.0}},
    }  # fmt: skip
    (head,) = report._sized_headline_rows(doc)
    assert head == ["30B-A3B MoE Q4_K_M file: decode tok/s, 1 / 8 streams", "60.0 / 40.0", "–", "30.0 / 50.0",
                    "2.00× / 0.80×"]  # fmt: skip
    rows = {r[0]: r[1:] for r in report._sized_rows(doc)}
    assert rows["30B-A3B: decode tok/s, 8 streams"][:3] == ["40.0", "–", "50.0"]
    assert rows["30B-A3B: weights read a token, GB"][:4] == ["1.70", "–", "1.70", "–"]
    assert rows["30B-A3B: peak resident memory, GB (mapped file pages included)"][:3] == ["19.5", "–", "19.0"]


def test_a_run_on_mapped_weights_stays_out_of_the_headline_and_says_so(tmp_path: Path):
    """The README headline takes a sized result only at the servers' default weight layout; the docs note of
    a run with the layout switches names them, and the load where the machine was busy."""
    import shutil

    for name in ("peers_decode", "peers_serving", "peers_agent_loop"):
        shutil.copy(report.RESULTS / f"{name}.json", tmp_path)
    side = {**_side(1.0), "decode_8": {"decode_tok_s": 5.0}, "load_before": {"load_1m": 9.5}}
    doc = {
        "name": "sized_30b_a3b",
        "config": {"command": "python -m bench.sized --size 30b-a3b", "size": "30b-a3b", "streams": [1, 8],
                   "shape": sized.SHAPES["30b-a3b"], "agents": 0,
                   "weight_layout_env": {"RADIXLM_GGUF_INTERLEAVE": "0", "LLAMA_ARG_REPACK": "0"}},
        "environment": {"cpu_cores": 2, "cpu_model": "X", "cpu_flags": ["avx2"]},
        "results": {"sides": {"radixlm": side, "llama-server": side}, "memory_bandwidth": {"copy_gb_s": 9.0}},
    }  # fmt: skip
    (tmp_path / "sized_30b_a3b.json").write_text(json.dumps(doc))
    assert "30B-A3B" not in report.headline(tmp_path)
    note = report.sized(tmp_path).strip().splitlines()[-1]
    assert "`RADIXLM_GGUF_INTERLEAVE=0 LLAMA_ARG_REPACK=0`" in note and "load average up to 9.5" in note
    doc["config"]["weight_layout_env"] = {}
    (tmp_path / "sized_30b_a3b.json").write_text(json.dumps(doc))
    assert "30B-A3B MoE Q4_K_M file: decode tok/s, 1 / 8 streams" in report.headline(tmp_path)
