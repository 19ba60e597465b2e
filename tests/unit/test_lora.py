"""LoRA adapters in PEFT's format: the model's logits under each adapter equal transformers + peft's, alone
and in one batch with other adapters and the base model; bad adapters are refused with the problem named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.model_runner import ModelRunner
from runtime.models.lora import LoraError, read_adapter
from tests.lora_fixtures import ALL_TARGETS, peft_model, save_random_adapter
from tests.random_llama import save_random_llama

pytestmark = pytest.mark.model

LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_random_llama(root / "base", _NoTokenizer(), seed=0, std=0.08, **LLAMA)
    adapters = {
        "all": save_random_adapter(base, root / "all", seed=1, rank=8, targets=ALL_TARGETS),
        "attn": save_random_adapter(base, root / "attn", seed=2, rank=4, targets=["q_proj", "v_proj"]),
        "rs": save_random_adapter(
            base, root / "rs", seed=3, rank=16, targets=["o_proj", "down_proj", "up_proj"], use_rslora=True
        ),
    }
    runner = ModelRunner(
        base,
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        attention_backend="torch_native",
        max_loras=3,
        max_lora_rank=16,
    )
    slots = {}
    for slot, (name, path) in enumerate(adapters.items()):
        runner.lora.load(slot, read_adapter(name, path, runner.config, 16))
        slots[name] = slot
    refs = {name: peft_model(base, path) for name, path in adapters.items()}
    from transformers import AutoModelForCausalLM

    refs[None] = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return root, base, adapters, runner, slots, refs


def _ref_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _run(runner, prompts: list[list[int]], slots: list[int], steps: int) -> list[list[int]]:
    """Greedy decoding of every prompt in one extend batch then `steps` decode batches; each request's ids."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    seqs = [list(p) for p in prompts]
    locs = runner.allocator.alloc(sum(len(p) for p in prompts))
    off = 0
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.write(row, 0, locs[off : off + len(p)])
        off += len(p)
    batch = ForwardBatch.build_extend(prompts, [0] * len(prompts), rows, locs)
    batch.lora_slots = slots
    logits = runner.forward(batch)
    held = [locs]
    for step in range(steps + 1):
        for s, row in zip(seqs, logits.argmax(-1).tolist()):
            s.append(row)
        if step == steps:
            break
        locs = runner.allocator.alloc(len(seqs))
        held.append(locs)
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, len(seqs[i]) - 1, locs[i : i + 1])
        batch = ForwardBatch.build_decode([s[-1] for s in seqs], [len(s) for s in seqs], rows, locs)
        batch.lora_slots = slots
        logits = runner.forward(batch)
    for locs in held:
        runner.allocator.free(locs)
    for row in rows:
        runner.req_to_token_pool.free(row)
    return seqs


def _ref_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps + 1):
        ids.append(int(_ref_logits(model, ids)[-1].argmax()))
    return ids


def test_logits_equal_peft_for_each_adapter(setup):
    _, _, adapters, runner, slots, refs = setup
    prompt = list(range(5, 29))
    for name in adapters:
        rows = [runner.req_to_token_pool.alloc()]
        locs = runner.allocator.alloc(len(prompt))
        runner.req_to_token_pool.write(rows[0], 0, locs)
        batch = ForwardBatch.build_extend([prompt], [0], rows, locs, logits_indices=list(range(len(prompt))))
        batch.lora_slots = [slots[name]]
        got = runner.forward(batch)
        runner.allocator.free(locs)
        runner.req_to_token_pool.free(rows[0])
        want = _ref_logits(refs[name], prompt)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        # the adapter changes the model: its logits are far from the base model's
        assert (want - _ref_logits(refs[None], prompt)).abs().max() > 0.05


def test_mixed_batch_greedy_equals_peft(setup):
    """Adapters and the base model in one batch (rows of one adapter not contiguous): each request's greedy
    tokens are those transformers + peft give it alone."""
    _, _, _, runner, slots, refs = setup
    g = torch.Generator().manual_seed(7)
    names = ["all", None, "rs", "all", "attn", None]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 14, 5, 20, 11, 3)]
    got = _run(runner, prompts, [slots[n] if n else -1 for n in names], steps=6)
    for name, prompt, ids in zip(names, prompts, got):
        assert ids == _ref_greedy(refs[name], prompt, 6), name
    # and the adapters' outputs differ from the base model's for the same prompt
    base_ids = _run(runner, [prompts[0]], [-1], steps=6)[0]
    assert base_ids != got[0]


@pytest.mark.slow  # builds the C++ kernels on first use
def test_fused_cpu_path_runs_the_adapters(setup):
    """The float32 CPU runner's fused layer loop calls each projection through `decode_call`: LoRA too."""
    from runtime.models.native_kernels import FUSED_LAYERS
    from tests.kernels.native import load_native_or_skip

    load_native_or_skip(FUSED_LAYERS)
    _, _, _, runner, slots, refs = setup
    runner.model.use_fused_cpu_ops(True)
    try:
        prompt = list(range(30, 47))
        got = _run(runner, [prompt, prompt], [slots["all"], -1], steps=4)
    finally:
        runner.model.use_fused_cpu_ops(False)
    assert got[0] == _ref_greedy(refs["all"], prompt, 4)
    assert got[1] == _ref_greedy(refs[None], prompt, 4)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_adapters_name_the_problem(setup, tmp_path):
    root, base, adapters, runner, _, _ = setup
    cfg = runner.config
    with pytest.raises(LoraError, match="not a directory"):
        read_adapter("x", str(tmp_path / "nowhere"), cfg, 16)
    no_weights = _copy(adapters["attn"], tmp_path / "no_weights")
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="adapter_model.safetensors is missing"):
        read_adapter("x", no_weights, cfg, 16)
    with pytest.raises(LoraError, match="rank 16 is above --max-lora-rank \\(8\\)"):
        read_adapter("x", adapters["rs"], cfg, 8)
    # a target this model lacks
    other = save_random_adapter(base, tmp_path / "lm_head", seed=4, rank=4, targets=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="'lm_head'"):
        read_adapter("x", other, cfg, 16)
    # wrong shapes: an adapter of another model
    wide = save_random_llama(
        tmp_path / "wide", _NoTokenizer(), seed=0, std=0.08, **{**LLAMA, "hidden_size": 96}
    )
    wrong = save_random_adapter(wide, tmp_path / "wrong", seed=5, rank=4, targets=["q_proj"])
    with pytest.raises(LoraError, match="layer 0 q_proj has lora_A \\(4, 96\\)"):
        read_adapter("x", wrong, cfg, 16)
    # a config that is not a LoRA
    dora = _copy(adapters["attn"], tmp_path / "dora")
    conf = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(LoraError, match="DoRA"):
        read_adapter("x", dora, cfg, 16)
    (tmp_path / "dora" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="not valid JSON"):
        read_adapter("x", dora, cfg, 16)
    broken = _copy(adapters["attn"], tmp_path / "broken")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(LoraError, match="cannot be read"):
        read_adapter("x", broken, cfg, 16)


def test_identity_follows_the_content(setup, tmp_path):
    """The digest (the adapter's part of the cache key) is the same for the same files, else differs."""
    _, _, adapters, runner, _, _ = setup
    a = read_adapter("a", adapters["all"], runner.config, 16)
    b = read_adapter("b", _copy(adapters["all"], tmp_path / "same"), runner.config, 16)
    c = read_adapter("c", adapters["attn"], runner.config, 16)
    assert a.digest == b.digest != c.digest


@pytest.mark.slow  # w4a8 builds its C++ kernel on first use
@pytest.mark.parametrize("quantization", ["int8", "w4a8"])
def test_base_weights_stay_quantized(setup, quantization):
    """Under a quantized base each projection stays the quantized layer; the adapter's rows get exactly its
    low-rank update on top of the quantized output, and base rows get the quantized output alone."""
    from runtime.models.lora import LoraLinear
    from runtime.models.parallel import ColumnParallelLinear

    _, base, adapters, _, _, _ = setup
    runner = ModelRunner(
        base,
        dtype="float32",
        device="cpu",
        max_total_tokens=512,
        max_running_requests=4,
        attention_backend="torch_native",
        quantization=quantization,
        max_loras=1,
        max_lora_rank=16,
    )
    runner.lora.load(0, read_adapter("all", adapters["all"], runner.config, 16))
    for layer in runner.model.layers:
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert isinstance(proj, LoraLinear) and not isinstance(proj.base, ColumnParallelLinear)
    proj = runner.model.layers[1].mlp.gate_up_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    runner.lora.begin([-1, 0, -1], [1, 3, 1])  # the adapter's rows are 1..3
    got = proj(x)
    runner.lora.begin(None, [5])
    plain = proj(x)
    torch.testing.assert_close(plain, proj.base(x), rtol=0, atol=0)
    a, b = proj.lora_a[0], proj.lora_b[0]  # gate | up: A's rank blocks feed their own halves of the output
    xa, half = x[1:4] @ a.t(), b.shape[0] // 2
    update = torch.cat([xa[:, :16] @ b[:half].t(), xa[:, 16:32] @ b[half:].t()], dim=1)
    torch.testing.assert_close(got[1:4], plain[1:4] + update)
    torch.testing.assert_close(got[[0, 4]], plain[[0, 4]], rtol=0, atol=0)
    assert (got[1:4] - plain[1:4]).abs().max() > 0.01
    # the fused CPU loop (the base's own quantized call, then the updates) gives the eager path's tokens
    assert runner.model.fused_cpu_ops
    prompt = list(range(40, 61))
    fused = _run(runner, [prompt, prompt], [0, -1], steps=4)
    runner.model.use_fused_cpu_ops(False)
    assert _run(runner, [prompt, prompt], [0, -1], steps=4) == fused
    assert fused[0] != fused[1]
