"""gpt-oss (runtime/models/gpt_oss.py) against transformers in float32 on a tiny random config
(tests/random_gpt_oss.py: sliding and full layers, sinks, 6 experts top-2, yarn rope): logits of extends over
cached prefixes and mixed-length decode steps on both CPU attention backends, the scheduler's greedy output
with the radix cache and chunked prefill; the MXFP4 dequantizer against transformers' and an MXFP4
checkpoint loaded; attention with sinks against a direct softmax; two tensor-parallel ranks against one
process; the start-up refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.models.gguf_linear import INTERLEAVED
from tests.random_gpt_oss import EXPERTS, WINDOW, gpt_oss_config, random_gpt_oss, save_random_gpt_oss
from tests.scheduler_utils import make_scheduler
from tests.unit.test_model_parity import Harness, check_against_transformers, hf_greedy
from tests.unit.test_scheduler import assert_all_free, prompts, run

TOL = dict(atol=3e-4, rtol=1e-4)
# MXFP4 blocks against their dequantization, |logits - want| / |want| per row: 0.0066 at most measured
MXFP4_LOGIT_TOL = 0.02
MXFP4_NEAR_TIE = 0.05  # a top-2 logit gap the int8 activations may flip (logits differ by <= 0.04 measured)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(folder, float32 transformers model) of the tiny random gpt-oss."""
    path = tmp_path_factory.mktemp("gpt_oss")
    return str(path), save_random_gpt_oss(path)


def runner_for(path: str, backend: str):
    from runtime.model_executor.model_runner import ModelRunner

    if backend == "cpu":
        from runtime.models.native_kernels import PAGED_ATTENTION
        from tests.kernels.native import load_native_or_skip

        load_native_or_skip(PAGED_ATTENTION)
    return ModelRunner(
        path,
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        attention_backend=backend,
    )


def test_config_maps_layers_sinks_and_yarn(gpt_oss):
    from runtime.models.model_config import ModelConfig

    _, hf = gpt_oss
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.sliding_windows == (WINDOW, 0, WINDOW) and cfg.attention_sinks and cfg.qkv_bias
    assert cfg.rope_attention_scaling > 1.0  # yarn's attention factor for factor 4
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (EXPERTS, 2)
    assert cfg.moe.sparse_layers == {0, 1, 2}
    torch.testing.assert_close(cfg.inv_freq, hf.model.rotary_emb.inv_freq)


def compare(runner, hf, lens, prefix) -> None:
    """Extend over cached prefixes (`prefix`), then 3 mixed-length decode steps: every logit row equals
    transformers'."""
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate(lens)}
    check_against_transformers(hf, Harness(runner), seqs, prefix, 3, **TOL)


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_logits_match_transformers(gpt_oss, backend):
    """Prefixes shorter and longer than the window (8), sequences up to 4 windows."""
    path, hf = gpt_oss
    runner = runner_for(path, backend)
    assert type(runner.model).__name__ == "GptOssForCausalLM"
    assert all(layer.self_attn.meta.sinks is not None for layer in runner.model.layers)
    compare(runner, hf, [9, 17, 1, 30], {0: 0, 1: 6, 2: 0, 3: 21})


def test_sinks_change_the_output(gpt_oss):
    """The same model with its sinks at -inf (no sink) gives other logits: the sinks are applied."""
    path, hf = gpt_oss
    runner = runner_for(path, "torch_native")
    seq = list(range(5, 25))
    with_sinks = Harness(runner).extend({0: seq}, all_logits=True)
    for layer in runner.model.layers:
        attn = layer.self_attn
        attn.meta = dataclasses.replace(attn.meta, sinks=torch.full_like(attn.meta.sinks, -1e30))
    without = Harness(runner).extend({0: seq}, all_logits=True)
    assert (with_sinks - without).abs().max() > 1e-2


def test_scheduler_greedy_equals_transformers(gpt_oss, default_tokenizer):
    """5 requests sharing prefixes longer than the window, 3 running at a time, the radix cache on and
    prefill chunks of 16 (which cut across windows): every output is transformers' greedy continuation, and
    every slot comes back."""
    path, hf = gpt_oss
    reqs = prompts(5)
    sched = make_scheduler(path, default_tokenizer, chunked_prefill_size=16, max_running_requests=3)
    res = run(sched, reqs, max_new=5, arrive_every=2)
    for i, p in enumerate(reqs):
        assert res["outs"][f"r{i}"] == hf_greedy(hf, p, 5), f"request {i}"
    assert res["stats"]["cached_tokens"] > 0
    assert_all_free(sched)


# ---- attention with sinks ------------------------------------------------------------------------------
def softmax_with_sinks(q, k, v, sinks, scale, window: int = 0):
    """Direct reference: q [n, H, D] at positions p0.., k/v [L, Hkv, D] positions 0..L-1 (n <= L, the queries
    are the last n), the sink as an extra softmax column; transformers' eager formula."""
    n, h, _ = q.shape
    length, hkv = k.shape[0], k.shape[1]
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    qpos = torch.arange(length - n, length)[:, None]
    kpos = torch.arange(length)[None, :]
    visible = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    full = torch.cat([scores, sinks[:, None, None].expand(h, n, 1)], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("prefix", [0, 7])
def test_torch_native_sinks_equal_direct_softmax(window, prefix):
    """torch_native's extend (flash lse for global layers, masked for windows) and decode with sinks equal
    the direct formula."""
    from radixlm_kernels.base import AttentionLayer
    from radixlm_kernels.torch_native import TorchNativeBackend
    from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
    from runtime.model_executor.forward_batch import ForwardBatch

    g = torch.Generator().manual_seed(window + prefix)
    h, hkv, d, n = 4, 2, 8, 12
    pool, table = KVPool(64, 1, hkv, d, torch.float32, "cpu"), ReqToTokenPool(2, 64, "cpu")
    backend = TorchNativeBackend(pool, table)
    sinks = torch.randn(h, generator=g)
    layer = AttentionLayer(0, h, hkv, d, d**-0.5, window, sinks=sinks)
    q, k, v = (torch.randn(n + 1, x, d, generator=g) for x in (h, hkv, hkv))
    row = table.alloc()
    slots = torch.arange(10, 10 + n + 1)
    table.write(row, 0, slots)
    if prefix:
        pre = ForwardBatch.build_extend([list(range(prefix))], [0], [row], slots[:prefix])
        backend.init_forward_metadata(pre)
        backend.forward(q[:prefix], k[:prefix], v[:prefix], layer, pre)
    batch = ForwardBatch.build_extend([list(range(n - prefix))], [prefix], [row], slots[prefix:n])
    backend.init_forward_metadata(batch)
    got = backend.forward(q[prefix:n], k[prefix:n], v[prefix:n], layer, batch)
    want = softmax_with_sinks(q[prefix:n], k[:n], v[:n], sinks, d**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    dec = ForwardBatch.build_decode([0], [n + 1], [row], slots[n:])
    backend.init_forward_metadata(dec)
    got = backend.forward(q[n:], k[n:], v[n:], layer, dec)
    want = softmax_with_sinks(q[n:], k, v, sinks, d**-0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- MXFP4 ---------------------------------------------------------------------------------------------
def random_mxfp4(
    shape: tuple[int, ...], seed: int, exponents: tuple[int, int] = (120, 130)
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks uint8 [*shape, 16] (every FP4 code), scales uint8 [*shape] drawn from [exponents) (by default
    around 127)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*exponents, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_e2m1_values_are_the_formats():
    from runtime.models.mxfp4 import e2m1_values

    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert e2m1_values().tolist() == want + [-x for x in want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [1024, 7])
def test_mxfp4_dequantization_equals_transformers(dtype, rows_per_chunk, monkeypatch):
    """Random blocks (every code, scales 2^-7 .. 2^2, and the extremes 2^-127 / 2^127 in a row): exactly
    transformers' `convert_moe_packed_tensors`, which returns [E, in, out] (ours stays [E, out, in]); rows
    dequantized in one chunk or in chunks that cut across experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from runtime.models import mxfp4
    from runtime.models.mxfp4 import dequantize_mxfp4

    monkeypatch.setattr(mxfp4, "ROWS_PER_CHUNK", rows_per_chunk)
    blocks, scales = random_mxfp4((3, 10, 4), seed=0)
    scales[0, 0, :2] = torch.tensor([0, 254], dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 10, 128) and got.dtype == dtype
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(got, want)


def test_mxfp4_refuses_bad_inputs():
    from runtime.models.mxfp4 import dequantize_mxfp4

    blocks, scales = random_mxfp4((2, 4), seed=1)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :3], torch.float32)
    scales[1, 2] = 255
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, scales, torch.float32)


def save_mxfp4_gpt_oss(tmp_path, config=None, std: float = 0.3, exponents: tuple[int, int] = (120, 130)):
    """A checkpoint whose experts are MXFP4 blocks + scales (as OpenAI's, with a quantization_config), and
    transformers' model holding their dequantization."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = config or gpt_oss_config()
    hf = random_gpt_oss(config, seed=3, std=std)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    hidden, inter = config.hidden_size, config.intermediate_size
    for layer_id, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for proj, (n_out, n_in) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            blocks, scales = random_mxfp4(
                (EXPERTS, n_out, n_in // 32), seed=10 * layer_id + len(proj), exponents=exponents
            )
            with torch.no_grad():  # transformers' layout: [E, in, out]
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            name = f"model.layers.{layer_id}.mlp.experts.{proj}"
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    return hf


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """(folder, transformers model) of the tiny random gpt-oss with MXFP4 experts of gpt-oss's weight sizes
    (exponents 116..123: |w| <= 6 * 2**-4). With weights up to 24 (exponents up to 129) the random model's
    routing sits near ties that int8 activations flip, and the logits of kept blocks and of their
    dequantization part far apart on some rows (up to 80%) though each MoE layer differs by ~2%."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return str(path), save_mxfp4_gpt_oss(path, exponents=(116, 124))


def test_mxfp4_checkpoint_loads_as_its_dequantization(mxfp4_gpt_oss):
    """Under --quantization none an MXFP4 checkpoint's experts are dequantized at load: its logits equal
    transformers' model holding the dequantized experts."""
    path, hf = mxfp4_gpt_oss
    runner = runner_for(path, "torch_native")
    assert all(layer.mlp.experts is None and layer.mlp.w13 is not None for layer in runner.model.layers)
    compare(runner, hf, [20], {0: 9})


def mxfp4_runner(path: str, quantization: str = "mxfp4"):
    from runtime.model_executor.model_runner import ModelRunner

    return ModelRunner(
        path, dtype="float32", device="cpu", max_total_tokens=2048, max_running_requests=8,
        attention_backend="torch_native", quantization=quantization,
    )  # fmt: skip


def test_mxfp4_experts_kept_as_blocks(mxfp4_gpt_oss):
    """Under --quantization mxfp4 the experts stay MXFP4: each layer holds them as ggml's uint8 blocks (17
    bytes per 32 weights: the checkpoint's bytes) and no float copy, and the logits of extends and decode
    steps are close to the dequantized model's (int8 activations per block of 32 apart) with the same
    top-1 token at >= 95% of positions (all of them, measured)."""
    from runtime.models.moe_fused import GGUFExperts
    from tests.unit.test_model_parity import Harness

    path, hf = mxfp4_gpt_oss
    hidden, inter = hf.config.hidden_size, hf.config.intermediate_size
    blocks = mxfp4_runner(path)
    for layer in blocks.model.layers:
        mlp = layer.mlp
        assert mlp.w13 is None and mlp.w2 is None and isinstance(mlp.experts, GGUFExperts)
        ex = mlp.experts
        assert [t & ~INTERLEAVED for t in ex.types] == [39, 39, 39]  # interleaved on AVX512-VNNI
        assert [tuple(w.shape) for w in (ex.w0, ex.w1, ex.w2)] == [
            (EXPERTS, inter, hidden // 32 * 17),
            (EXPERTS, inter, hidden // 32 * 17),
            (EXPERTS, hidden, inter // 32 * 17),
        ]
        assert all(w.dtype == torch.uint8 for w in (ex.w0, ex.w1, ex.w2))
        # the checkpoint's blocks + scales: 2I x H and H x I weights per expert, 17 bytes per 32
        want_bytes = EXPERTS * (2 * inter * hidden + hidden * inter) // 32 * 17
        assert sum(w.numel() for w in (ex.w0, ex.w1, ex.w2)) == want_bytes
        assert all(p.numel() < EXPERTS * hidden * 2 for p in mlp.parameters())  # router and biases only
    dense = mxfp4_runner(path, "none")
    g = torch.Generator().manual_seed(4)
    seqs = {i: torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate([20, 9, 33])}
    hb, hd = Harness(blocks), Harness(dense)
    got, want = hb.extend(seqs, all_logits=True), hd.extend(seqs, all_logits=True)
    for _ in range(3):
        got = torch.cat([got, hb.decode({i: 7 + i for i in seqs})])
        want = torch.cat([want, hd.decode({i: 7 + i for i in seqs})])
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel < MXFP4_LOGIT_TOL, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_mxfp4_scheduler_greedy_agrees_with_dequantized(mxfp4_gpt_oss, default_tokenizer):
    """Through the scheduler (radix cache, prefill chunks of 16), 5 requests x 12 greedy tokens: the MXFP4
    experts' tokens equal the dequantized model's on >= 80% of positions (compared up to each request's first
    difference, past which the texts differ), and a difference only where the dequantized model's top two
    logits are a near tie (within MXFP4_NEAR_TIE, about the logits' measured difference) and the MXFP4 model
    took the runner-up."""
    from tests.unit.test_model_parity import Harness

    path, _ = mxfp4_gpt_oss
    reqs = prompts(5)
    outs = {}
    for quantization in ("mxfp4", "none"):
        sched = make_scheduler(
            path,
            default_tokenizer,
            chunked_prefill_size=16,
            max_running_requests=3,
            quantization=quantization,
        )
        assert (sched.runner.model.layers[0].mlp.experts is not None) == (quantization == "mxfp4")
        outs[quantization] = run(sched, reqs, max_new=12, arrive_every=2)["outs"]
        assert_all_free(sched)
    dense = mxfp4_runner(path, "none")
    agree = total = 0
    for i, p in enumerate(reqs):
        got, want = outs["mxfp4"][f"r{i}"], outs["none"][f"r{i}"]
        same = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        agree, total = agree + same, total + len(want)
        if same < len(want):
            logits = Harness(dense).extend({0: p + want[:same]})[-1]
            top = logits.topk(2)
            assert top.indices.tolist() == [want[same], got[same]], f"request {i}, token {same}"
            assert top.values[0] - top.values[1] < MXFP4_NEAR_TIE, f"request {i}, token {same}: {top.values}"
    assert agree >= 0.8 * total, (agree, total)


def test_mxfp4_experts_split_over_two_ranks(tmp_path):
    """Two tensor-parallel ranks of an MXFP4 checkpoint whose intermediate size (64) splits on whole blocks:
    each rank keeps its 32 features' blocks (gate and up rows, down's block column) and its biases (down's on
    rank 0 only), and the ranks' partial outputs sum to one rank's (the all_reduce stood in by the sum)."""
    from runtime.models.gpt_oss import GptOssForCausalLM
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import iter_weights, load_hf_config
    from runtime.models.parallel import TensorParallel

    class Partial(TensorParallel):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # each rank's partial sum, added below
            return x

    config = gpt_oss_config()
    config.intermediate_size = 64
    save_mxfp4_gpt_oss(tmp_path, config, exponents=(116, 124))
    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    mlps = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        model = GptOssForCausalLM(cfg, Partial(rank, size, group=None if size == 1 else object()))
        model.keep_mxfp4_experts()
        model.load_weights(iter_weights(str(tmp_path)))
        mlps.append([layer.mlp for layer in model.layers])
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(6))
    for whole, r0, r1 in zip(*mlps, strict=True):
        assert r0.experts.w2.shape == (EXPERTS, 64, 17) and r1.experts.b2 is None
        assert torch.equal(r0.experts.w0, whole.experts.w0[:, :32]) and torch.equal(
            r1.experts.w1, whole.experts.w1[:, 32:]
        )
        torch.testing.assert_close(r0(x) + r1(x), whole(x), rtol=1e-5, atol=1e-5)


def test_mxfp4_auto_and_refusals(gpt_oss, mxfp4_gpt_oss):
    """auto keeps an MXFP4 checkpoint's experts as blocks on the CPU only; mxfp4 refuses float experts,
    other devices, and tensor-parallel slices that cut blocks."""
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.gpt_oss import GptOssForCausalLM
    from runtime.models.model_config import ModelConfig
    from runtime.models.parallel import TensorParallel
    from runtime.models.quantization import check_supported, is_mxfp4_checkpoint, resolve_auto

    path, hf = mxfp4_gpt_oss
    assert is_mxfp4_checkpoint(path) and not is_mxfp4_checkpoint(gpt_oss[0])
    for flags, dtype in ((frozenset(), "float32"), (frozenset({"avx512_bf16"}), "bfloat16")):
        assert resolve_auto("auto", "cpu", None, flags, True, hf_folder=path)[:2] == (dtype, "mxfp4")
    assert resolve_auto("auto", "cuda", None, frozenset(), True, hf_folder=path)[1] == "none"
    assert resolve_auto("auto", "cpu", None, frozenset(), True, hf_folder=gpt_oss[0])[1] == "none"
    check_supported("mxfp4", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="not supported"):
        check_supported("mxfp4", "cuda", "bfloat16")
    with pytest.raises(ValueError, match="is a float tensor"):
        mxfp4_runner(gpt_oss[0])
    with pytest.raises(ValueError, match="serves gpt-oss's MXFP4 experts on the CPU"):
        ModelRunner(path, dtype="float32", device="meta", quantization="mxfp4")
    cfg = ModelConfig.from_hf(hf.config)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg, TensorParallel(0, 2, group=object()))
    with pytest.raises(ValueError, match=r"features \[0, 16\) of 32 do not fall on whole blocks"):
        model.keep_mxfp4_experts()


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.slow  # two spawned rank processes (~20 s on 2 loaded cores)
def test_two_tensor_parallel_ranks_equal_one_process(gpt_oss):
    """--tp-size 2 on gloo: each rank holds 2 of the 4 query heads (their sinks and biases), 1 of the 2 KV
    heads, half of every expert and half the vocabulary; the logits of a prefix extend, an extend and
    decode steps past the window equal one process's."""
    from tests.unit.test_tensor_parallel import assert_tp2_equals_one_process

    path, _ = gpt_oss
    assert assert_tp2_equals_one_process(path) == 1


def test_refuses_quantization_and_lora(gpt_oss):
    from runtime.model_executor.model_runner import ModelRunner

    path, _ = gpt_oss
    with pytest.raises(ValueError, match="cannot serve LoRA adapters"):
        ModelRunner(path, dtype="float32", max_loras=1, attention_backend="torch_native")
    with pytest.raises(ValueError, match="--quantization int8"):
        ModelRunner(path, dtype="float32", quantization="int8", attention_backend="torch_native")


def test_backends_without_sinks_are_refused(gpt_oss, monkeypatch):
    """A backend without `supports_sinks` (triton, flashinfer) is refused at start, naming it."""
    from radixlm_kernels.torch_native import TorchNativeBackend
    from runtime.model_executor.model_runner import ModelRunner

    monkeypatch.setattr(TorchNativeBackend, "supports_sinks", False)
    with pytest.raises(ValueError, match="attention sinks, which the torch_native attention backend"):
        ModelRunner(gpt_oss[0], dtype="float32", device="cpu", attention_backend="torch_native")
    from radixlm_kernels.base import AttentionBackend

    assert AttentionBackend.supports_sinks is False  # triton and flashinfer inherit it
