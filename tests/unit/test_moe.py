"""Mixture of experts (runtime/models/moe.py): the grouped expert op against a per-token, per-choice loop;
sigmoid routing against GLM-4.5's router in transformers; Qwen3-MoE, Qwen2-MoE (a sigmoid-gated shared
expert), Mixtral and GLM-4.5 (sigmoid routing with a choice bias and expert groups, an ungated shared
expert) logits against transformers through the model runner (fused and eager CPU paths), and greedy-equal
to transformers through the scheduler with the radix cache and chunked prefill; quantized experts; tensor
parallelism; bfloat16."""

from __future__ import annotations

import pytest
import torch

from runtime.models.moe import Routing, grouped_moe, grouped_moe_layers, reference_moe, route
from tests.random_moe import save_random_moe
from tests.scheduler_utils import make_scheduler
from tests.unit.test_model_parity import Harness, check_against_transformers, hf_greedy, hf_logits
from tests.unit.test_scheduler import assert_all_free, prompts, run

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
E, H, INTER, K = 8, 48, 24, 2
POOL_SMALL = dict(
    device="cpu", max_total_tokens=512, max_running_requests=2, attention_backend="torch_native"
)


def experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def routing(t: int, case: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, K] float32, ids [t, K]), K distinct experts per row. `every`: the first rows cover all
    E experts; `unhit`: experts 3 and 6 are nobody's choice; `random`: any."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if case != "unhit" or e not in (3, 6)])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(t)])
    if case == "every":
        assert t * K >= E
        ids[: E // K] = torch.randperm(E, generator=g).view(E // K, K)
    return torch.rand(t, K, generator=g), ids


@pytest.mark.parametrize("t", [1, 4, 64])
@pytest.mark.parametrize("case", ["every", "unhit", "random"])
def test_grouped_op_equals_per_expert_loop(t, case):
    if case == "every" and t * K < E:
        pytest.skip("a batch this small cannot route to every expert")
    w13, w2 = experts(t)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(100 + t))
    weights, ids = routing(t, case, seed=t)
    hit = set(ids.flatten().tolist())
    assert (hit == set(range(E))) if case == "every" else (not hit & {3, 6} if case == "unhit" else True)
    # an expert no row chose is never read: poison its weights
    for e in set(range(E)) - hit:
        w13[e], w2[e] = float("nan"), float("nan")
    got = grouped_moe(x, w13, w2, weights, ids)
    assert got.shape == (t, H) and got.dtype == x.dtype
    ref = reference_moe(x, w13, w2, weights, ids)
    # float32 sums in another order: a few ulps of the output's scale (~800 here, an ulp 6e-5; measured up
    # to 3.4e-7 of it), which a fixed 1e-4 missed on an element that cancels to 0.29
    torch.testing.assert_close(got, ref, atol=1e-6 * float(ref.abs().max()), rtol=1e-5)


def test_grouped_op_in_bfloat16_sums_in_float32():
    w13, w2 = (w.bfloat16() for w in experts(0))
    x = torch.randn(16, H).bfloat16()
    weights, ids = routing(16, "every", seed=1)
    got = grouped_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    ref = reference_moe(x, w13, w2, weights, ids).float()  # float32 arithmetic on the bf16 inputs
    # bf16 intermediates: within a few bf16 roundings of the output's scale
    torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_softmax_top_k(renormalize):
    x, w = torch.randn(10, H), torch.randn(E, H)
    weights, ids = route(x.bfloat16(), w.bfloat16(), Routing(K, renormalize))
    assert weights.dtype == torch.float32 and ids.shape == (10, K)
    probs = torch.softmax(x.bfloat16().float() @ w.bfloat16().float().T, dim=-1)
    ref_w, ref_ids = probs.topk(K, dim=-1)
    assert torch.equal(ids, ref_ids)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    torch.testing.assert_close(weights, ref_w)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (2, 1), (4, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_sigmoid_equals_glm4_moe_router(n_group, topk_group, renormalize):
    """Sigmoid scores, a choice bias that moves the choice but not the weights, group-limited choice and the
    routed scaling factor: the same experts and weights as transformers' GLM-4.5 router."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    ref = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(E, H, generator=g))
        ref.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    x = torch.randn(32, H, generator=g)
    rule = Routing(K, renormalize, "sigmoid", n_group, topk_group, 2.5)
    weights, ids = route(x, ref.weight, rule, ref.e_score_correction_bias)
    _, ref_w, ref_ids = ref(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    # the bias decided some choices here: without it the experts differ, and the weights are never biased
    _, unbiased_ids = route(x, ref.weight, rule)
    assert not torch.equal(unbiased_ids.sort(-1).values, ids.sort(-1).values)
    scores = torch.sigmoid(x @ ref.weight.T).gather(1, ids)
    want = scores / (scores.sum(-1, keepdim=True) + 1e-20) if renormalize else scores
    torch.testing.assert_close(weights, want * 2.5)
    if n_group > 1:  # every token's experts lie in its topk_group groups
        groups = ids // (E // n_group)
        assert all(len(set(row)) <= topk_group for row in groups.tolist())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scoring="tanh"), "scoring"),
        (dict(scoring="sigmoid", n_group=2, topk_group=3), "topk_group"),
        (dict(n_group=2), "sigmoid"),
    ],
)
def test_routing_rejects_rules_it_cannot_apply(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Routing(K, True, **kwargs)


# ---- whole models --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory, default_tokenizer):
    """(arch, folder, transformers model) of a tiny random Qwen3-MoE or Mixtral with the default tokenizer."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_moe(path, request.param, default_tokenizer)
    return request.param, str(path), hf


def test_config_maps_sparse_layers(moe_model):
    from runtime.models.model_config import ModelConfig

    arch, _, hf = moe_model
    moe = ModelConfig.from_hf(hf.config).moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (8, 2)
    if arch in ("qwen3_moe", "qwen2_moe"):  # mlp_only_layers=[1]; norm_topk_prob=False
        assert moe.sparse_layers == {0, 2} and not moe.routing.renormalize and moe.intermediate_size == 32
        assert moe.shared_intermediate_size == (64 if arch == "qwen2_moe" else 0)
    elif arch == "glm4_moe":  # first_k_dense_replace=1; sigmoid routing in groups; an ungated shared expert
        assert moe.sparse_layers == {1, 2} and moe.routing == Routing(2, True, "sigmoid", 2, 1, 2.5)
        assert moe.score_bias and moe.shared_intermediate_size == 32 and not moe.shared_gated
    else:
        assert moe.sparse_layers == {0, 1, 2} and moe.routing.renormalize


@pytest.mark.parametrize("fused", [True, False])
def test_logits_match_transformers(moe_model, fused):
    """Extend over cached prefixes, then mixed-length decode steps: every logit row equals transformers'.
    fused=True is the float32 CPU path (C++ layer ops around the eager MoE block) when its library loads."""
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.moe import SparseMoeBlock

    arch, path, hf = moe_model
    runner = ModelRunner(
        path,
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        attention_backend="torch_native",
    )
    if fused and not runner.model.fused_cpu_ops:
        pytest.skip("the fused CPU layer library did not load")
    runner.model.use_fused_cpu_ops(fused)
    kinds = [type(layer.mlp).__name__ for layer in runner.model.layers]
    dense = {"qwen3_moe": 1, "qwen2_moe": 1, "glm4_moe": 0}.get(
        arch
    )  # mlp_only_layers, first_k_dense_replace
    assert kinds == ["MLP" if i == dense else "SparseMoeBlock" for i in range(3)]
    assert all(
        layer.mlp.gate_weight.dtype == torch.float32
        for layer in runner.model.layers
        if isinstance(layer.mlp, SparseMoeBlock)
    )
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate([9, 17, 1, 30])}
    prefix = {0: 0, 1: 6, 2: 0, 3: 21}
    check_against_transformers(hf, Harness(runner), seqs, prefix, 3, atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [0, 16])
def test_scheduler_greedy_equals_transformers(moe_model, default_tokenizer, chunk):
    """12 requests sharing prefixes, 4 running at a time, the radix cache on (and chunked prefill): every
    output equals transformers' greedy continuation, cached prefixes were used, and every slot comes back."""
    _, path, hf = moe_model
    reqs = prompts(12)
    sched = make_scheduler(path, default_tokenizer, chunked_prefill_size=chunk, max_running_requests=4)
    res = run(sched, reqs, max_new=8, arrive_every=2)
    for i, p in enumerate(reqs):
        assert res["outs"][f"r{i}"] == hf_greedy(hf, p, 8), f"request {i}"
    assert res["stats"]["cached_tokens"] > 0
    assert_all_free(sched)


@pytest.mark.parametrize("method", ["w8a8", "w4a8", "int8"])
def test_quantization_of_the_experts(moe_model, method):
    """Every expert becomes two quantized layers (gate|up, down) of the method's kind, the router stays
    float32, the model runs (fused path), and each MoE block equals the grouped op over its layers'
    dequantized weights within the activations' quantization noise (w4a8: exactly those weights, int8
    activations per block of 32); w8a8's logits stay close to float32's."""
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.moe import SparseMoeBlock
    from runtime.models.quantized_linear import DynamicInt8Linear, QuantizedLinear
    from runtime.models.w4a8 import W4A8Linear

    arch, path, hf = moe_model
    runner = ModelRunner(path, dtype="float32", quantization=method, **POOL_SMALL)
    kind = {"w8a8": DynamicInt8Linear, "w4a8": W4A8Linear, "int8": QuantizedLinear}[method]
    for layer in runner.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, kind)
        if isinstance(layer.mlp, SparseMoeBlock):
            block = layer.mlp
            assert block.gate_weight.dtype == torch.float32 and not hasattr(block, "w13")
            assert len(block.experts) == 8 and all(
                isinstance(m, kind) for pair in block.experts for m in pair
            )
        else:
            assert isinstance(layer.mlp.gate_up_proj, kind)
    if method == "w4a8":
        block = next(layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        w13 = torch.stack([gate_up.dequantized_weight() for gate_up, _ in block.experts])
        w2 = torch.stack([down.dequantized_weight() for _, down in block.experts])
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
        weights, ids = route(x, block.gate_weight, block.routing, block.score_bias)
        ref = grouped_moe(x, w13, w2, weights, ids)
        if block.shared_expert is not None:  # Qwen2-MoE, GLM-4.5: its quantized shared expert
            assert isinstance(block.shared_expert.gate_up_proj, kind)
            gated = block.shared_gate_weight is not None  # Qwen2-MoE's sigmoid gate
            gate = torch.sigmoid(x @ block.shared_gate_weight.T) if gated else 1.0
            ref = ref + gate * block.shared_expert(x)
        torch.testing.assert_close(block(x), ref, atol=0.03 * ref.abs().max().item(), rtol=0)
    seq = list(range(5, 25))
    logits = Harness(runner).extend({0: seq}, all_logits=True)
    assert torch.isfinite(logits).all()
    if method == "w8a8":  # 4-bit blocks of these N(0, 0.3) random matrices are too coarse for a bound
        cosine = torch.nn.functional.cosine_similarity(logits, hf_logits(hf, seq), dim=-1)
        # int8 can flip a near-tie routing choice on a random model: close on average, none far off (a flip of
        # GLM-4.5's group choice swaps both of a token's experts at once)
        assert cosine.mean() > 0.95 and cosine.min() > (0.75 if arch == "glm4_moe" else 0.8), cosine


def test_grouped_op_over_layers_equals_stacked_weights():
    """`grouped_moe_layers` (what quantized experts run) with plain linear layers of the same weights."""
    w13, w2 = experts(5)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(6))
    weights, ids = routing(12, "unhit", seed=7)
    layers = [
        (
            lambda v, e=e: torch.nn.functional.linear(v, w13[e]),
            lambda v, e=e: torch.nn.functional.linear(v, w2[e]),
        )
        for e in range(E)
    ]
    torch.testing.assert_close(
        grouped_moe_layers(x, layers, weights, ids),
        grouped_moe(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_glm4_moe_skips_its_next_token_prediction_layer(tmp_path, default_tokenizer):
    """A GLM-4.5 checkpoint carries num_nextn_predict_layers multi-token-prediction layers after the
    decoder's (layers.3.* here): loading skips them, as transformers does; a layer past them is still an
    unexpected weight."""
    from runtime.model_executor.model_runner import ModelRunner

    hf = save_random_moe(tmp_path, "glm4_moe", default_tokenizer)
    assert hf.config.num_nextn_predict_layers == 1
    runner = ModelRunner(str(tmp_path), dtype="float32", **POOL_SMALL)
    from safetensors.torch import load_file

    weights = list(load_file(str(tmp_path / "model.safetensors")).items())  # the checkpoint's own names
    mtp = [
        ("model.layers.3.eh_proj.weight", torch.zeros(64, 128)),
        ("model.layers.3.enorm.weight", torch.ones(64)),
    ]
    runner.model.load_weights(weights + mtp)
    with pytest.raises(ValueError, match="unexpected weight 'layers.4.enorm.weight'"):
        runner.model.load_weights(weights + [("model.layers.4.enorm.weight", torch.ones(64))])


def test_two_tensor_parallel_ranks_equal_one_process(moe_model):
    """--tp-size 2 on gloo: each rank holds half of every expert's intermediate features (the router whole);
    the logits of a prefix extend, an extend and decode steps equal one process's."""
    from tests.unit.test_tensor_parallel import assert_tp2_equals_one_process

    _, path, _ = moe_model
    assert_tp2_equals_one_process(path)


def test_bfloat16_keeps_the_router_in_float32(moe_model):
    """Under --dtype bfloat16 the experts are bf16 and the router's weight stays float32 (routing decided on
    float32 logits); the logits stay close to transformers' float32 ones."""
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.moe import SparseMoeBlock

    _, path, hf = moe_model
    runner = ModelRunner(path, dtype="bfloat16", kv_cache_dtype="float32", **POOL_SMALL)
    blocks = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(
        b.gate_weight.dtype == torch.float32 and b.w13.dtype == torch.bfloat16 for b in blocks
    )
    seq = list(range(40, 60))
    logits = Harness(runner).extend({0: seq}, all_logits=True)
    cosine = torch.nn.functional.cosine_similarity(logits, hf_logits(hf, seq), dim=-1)
    assert cosine.mean() > 0.95 and cosine.min() > 0.8, cosine
