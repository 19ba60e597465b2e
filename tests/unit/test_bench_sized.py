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
