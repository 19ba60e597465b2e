"""gpt-oss (`GptOssForCausalLM`, HF model_type gpt_oss) over the paged KV pool.

Where gpt-oss's layer differs from Llama's (transformers' modeling_gpt_oss.py is the reference):
- every attention head has a learned sink: one extra logit in its softmax's denominator with no value
  (`AttentionLayer.sinks`, float32 [heads]), so a head can attend to "nothing";
- layers alternate sliding-window (`sliding_window`, 128) and full attention per `layer_types`;
- q/k/v and o projections have biases; rope is yarn-scaled (`ModelConfig.inv_freq`, cos/sin scaled by
  yarn's attention factor);
- RMSNorm scales after the float32 normalisation and casts last (`(w * x).to(dtype)`);
- every MLP is a mixture of experts (`GptOssMoe`): the router has a bias, top-k is taken on its logits and
  softmaxed over the k chosen; an expert is down(swiglu(gate_up(x))) with biases on both projections and a
  clamped SwiGLU: gate clamped above at `limit`, up clamped to [-limit, limit], (up + 1) * gate *
  sigmoid(alpha * gate).

Checkpoints: transformers stores the experts stacked and transposed for `x @ W` (`gate_up_proj`
[E, H, 2I] with gate and up interleaved by column, `down_proj` [E, I, H]); OpenAI's released checkpoints
store them as MXFP4 (`*_blocks` + `*_scales`, [E, out, in] once dequantized, gate and up interleaved by
output row, `runtime.models.mxfp4`). Such experts are served one of two ways:
- `--quantization mxfp4` (what `auto` picks for an MXFP4 checkpoint on the CPU, as vLLM serves MXFP4 as it
  is): kept as MXFP4, the same bits repacked into ggml's blocks (`mxfp4.to_ggml_blocks`: gate [E, I, ·],
  up [E, I, ·], down [E, H, ·], 17 bytes per 32 weights, as in the checkpoint; on AVX512-VNNI moved once more
  into the kernels' 16-row interleaved layout, same size), and each layer's experts run
  as one call of the fused MoE op (`moe_fused.GGUFExperts` with the biases and the clamped SwiGLU) with
  int8 activations per block of 32, so gpt-oss-20b's experts take ~10 GB instead of ~38 GB in bfloat16;
- `--quantization none` (and every device but the CPU): dequantized at load and held as `w13` [E, 2I, H]
  (gate rows then up rows) and `w2` [E, H, I] in the model's dtype, run by the per-expert loop, as float
  checkpoints are.

Under tensor parallelism each rank holds its heads (q/k/v rows with their biases, o's columns, the heads'
sinks), its slice of every expert's intermediate features, and its vocabulary slice; o's bias and the
experts' down biases are added once (rank 0 / after the sum); the router and the norms are replicated.
Experts kept as MXFP4 are sliced by whole blocks: each rank's slice of the intermediate features must start
and end on a multiple of 32 (gpt-oss-20b's 2880 over 2 ranks: 1440 each), else the start is refused.

Limits, refused at start: any --quantization but mxfp4 (MXFP4 checkpoints only) and none, and attention
backends without sinks (`AttentionBackend.supports_sinks`: the model runner checks). The layers run eagerly
(no fused C++ layer path). Greedy-equal to transformers in float32 (tests/unit/test_gpt_oss.py); bfloat16
runs, but differs from transformers' bfloat16 beyond round-off where transformers keeps the norm weights
float32 and routes in bfloat16 (here the norm weights are the model's dtype and routing is float32). MXFP4
experts kept as blocks differ from their dequantization by the activations' int8 rounding (logits within a
few percent, greedy tokens alike in the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_kernels.base import AttentionLayer
from runtime.models.llama import LlamaForCausalLM, Rotary
from runtime.models.model_config import ModelConfig
from runtime.models.moe import _expert_groups
from runtime.models.mxfp4 import BLOCK, GGML_MXFP4, dequantize_mxfp4, to_ggml_blocks
from runtime.models.parallel import (
    ColumnParallelLinear,
    HeadShard,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    split_range,
)

if TYPE_CHECKING:
    from radixlm_kernels.base import AttentionBackend
    from runtime.model_executor.forward_batch import ForwardBatch


class GptOssRMSNorm(nn.Module):
    """x / rms(x) in float32, times the weight (in float32), then cast (GptOssRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GptOssAttention(nn.Module):
    """This rank's heads: q|k|v rows and their biases, o's input columns (its bias `o_bias` is added once,
    after the ranks' sum), and the heads' sinks."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        s, d = HeadShard.of(cfg.num_heads, cfg.num_kv_heads, tp), cfg.head_dim
        window = cfg.sliding_window(layer_id)
        self.meta = AttentionLayer(layer_id, s.num_heads, s.num_kv_heads, d, d**-0.5, window)
        self.q_size, self.kv_size = s.num_heads * d, s.num_kv_heads * d
        self.heads = (s.q_start, s.q_stop)  # of the checkpoint's query heads (the sinks' slice)
        q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d
        kv_rows = (kv_full, s.kv_start * d, s.kv_stop * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [(q_full, s.q_start * d, s.q_stop * d), kv_rows, kv_rows], bias=True
        )
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, tp, (s.q_start * d, s.q_stop * d))
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.sinks = nn.Parameter(torch.zeros(s.num_heads))

    def bind_sinks(self) -> None:
        """Hand the loaded sinks to the backend's layer metadata (float32), once the weights are final."""
        self.meta = dataclasses.replace(self.meta, sinks=self.sinks.detach().float().contiguous())

    def forward(self, h, cos, sin, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        m = self.meta
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = Rotary.apply(q.view(-1, m.num_heads, m.head_dim), cos, sin)  # [T, H, D]
        k = Rotary.apply(k.view(-1, m.num_kv_heads, m.head_dim), cos, sin)  # [T, Hkv, D]
        out = backend.forward(q, k, v.view(-1, m.num_kv_heads, m.head_dim), m, batch)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size)) + self.o_bias


class GptOssMoe(nn.Module):
    """Router (`router_weight` [E, H], `router_bias` [E]; replicated, so every rank routes alike) and this
    rank's slice [start, stop) of every expert's I intermediate features: `w13` [E, 2I_rank, H] gate rows
    then up rows, `b13` [E, 2I_rank], `w2` [E, H, I_rank]; `b2` [E, H] is added by rank 0 only, and the
    ranks' partial outputs are summed (one all_reduce).

    With `keep_mxfp4()` (before the weights load) w13 and w2 are not held: the checkpoint's MXFP4 experts
    are kept as ggml blocks (`put_mxfp4`) and served by `experts` (`moe_fused.GGUFExperts`, built by
    `finish_mxfp4` once every piece is loaded) in one fused call per layer."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        hf = cfg.hf_config
        e, hidden = hf.num_local_experts, cfg.hidden_size
        self.inter_full = cfg.intermediate_size
        self.start, self.stop = split_range(self.inter_full, tp.size, tp.rank)
        inter = self.inter = self.stop - self.start
        self.num_experts, self.top_k, self.tp, self.add_b2 = e, hf.num_experts_per_tok, tp, tp.rank == 0
        self.alpha, self.limit = float(hf.swiglu_alpha), float(hf.swiglu_limit)
        self.router_weight = nn.Parameter(torch.empty(e, hidden))
        self.router_bias = nn.Parameter(torch.empty(e))
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.b13 = nn.Parameter(torch.empty(e, 2 * inter))
        self.w2 = nn.Parameter(torch.empty(e, hidden, inter))
        self.b2 = nn.Parameter(torch.empty(e, hidden))
        self.mxfp4: dict[str, torch.Tensor] | None = None  # under keep_mxfp4: ggml blocks by part
        self.experts: nn.Module | None = None  # the fused op's experts, once the MXFP4 blocks are in

    def keep_mxfp4(self) -> None:
        """Serve the experts from their MXFP4 blocks: drop w13 / w2 (before they are allocated); ValueError
        when this rank's slice of the intermediate features does not fall on whole blocks of 32."""
        if self.start % BLOCK or self.stop % BLOCK:
            raise ValueError(
                f"gpt-oss's MXFP4 experts cannot be split over {self.tp.size} ranks: this rank's "
                f"intermediate features [{self.start}, {self.stop}) of {self.inter_full} do not fall on "
                f"whole blocks of {BLOCK}; use a --tp-size that divides {self.inter_full // BLOCK} blocks "
                "evenly, or --quantization none (the experts dequantized at load)"
            )
        self.w13 = self.w2 = None
        self.mxfp4 = {}

    def put_mxfp4(self, leaf: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """This rank's slice of a checkpoint's `gate_up_proj` (blocks [E, 2I, H / 32, 16], gate rows even,
        up rows odd) or `down_proj` ([E, H, I / 32, 16]) MXFP4 blocks, kept as ggml's blocks."""
        assert self.mxfp4 is not None
        e, hidden = self.num_experts, self.router_weight.shape[1]
        want = {
            "gate_up_proj": (e, 2 * self.inter_full, hidden // BLOCK, BLOCK // 2),
            "down_proj": (e, hidden, self.inter_full // BLOCK, BLOCK // 2),
        }[leaf]
        if tuple(blocks.shape) != want:
            raise ValueError(f"MXFP4 {leaf}_blocks has shape {tuple(blocks.shape)}, expected {want}")
        if leaf == "gate_up_proj":
            rows = slice(self.start, self.stop)
            self.mxfp4["gate"] = to_ggml_blocks(blocks[:, 0::2][:, rows], scales[:, 0::2][:, rows])
            self.mxfp4["up"] = to_ggml_blocks(blocks[:, 1::2][:, rows], scales[:, 1::2][:, rows])
        else:
            cols = slice(self.start // BLOCK, self.stop // BLOCK)
            self.mxfp4["down"] = to_ggml_blocks(blocks[:, :, cols], scales[:, :, cols])

    def finish_mxfp4(self) -> None:
        """Build the fused experts from the kept blocks and the loaded biases."""
        from runtime.models.moe_fused import ExpertActivation, GGUFExperts

        assert self.mxfp4 is not None
        self.experts = GGUFExperts(
            [(GGML_MXFP4, self.mxfp4[part]) for part in ("gate", "up", "down")],
            b13=self.b13.detach(),
            b2=self.b2.detach() if self.add_b2 else None,
            activation=ExpertActivation("clamped_swiglu", self.alpha, self.limit),
        )
        self.mxfp4 = {}  # the blocks are the experts' buffers now

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): top-k of the router's logits (float32), softmaxed
        over the k chosen (equal to transformers' in float32; in bfloat16 transformers routes in bfloat16)."""
        logits = F.linear(x.float(), self.router_weight.float(), self.router_bias.float())  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] gate | up -> [n, I]: the clamped SwiGLU."""
        gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: the fused op over the MXFP4 blocks, or one gate|up and one down matmul per
        expert hit; summed in float32."""
        weights, ids = self.route(x)
        if self.experts is not None:  # one fused call over the MXFP4 blocks
            out = self.experts(x.float().contiguous(), weights, ids)
            return self.tp.all_reduce(out).to(x.dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, rows, w in _expert_groups(weights, ids, self.num_experts):
            h = self.swiglu(F.linear(x.index_select(0, rows), self.w13[e], self.b13[e]))
            y = F.linear(h, self.w2[e], self.b2[e] if self.add_b2 else None)
            out.index_add_(0, rows, y.float() * w)
        return self.tp.all_reduce(out).to(x.dtype)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_id, tp)
        self.mlp = GptOssMoe(cfg, tp)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, batch, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssForCausalLM(LlamaForCausalLM):
    quantizable = False  # the model runner refuses --quantization other than none
    supports_lora = False  # and LoRA adapters

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        nn.Module.__init__(self)
        tp = tp or TensorParallel()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_attention_scaling)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.fused_cpu_ops = False
        self._fused_plan = None
        self.tie_weights()

    def keep_mxfp4_experts(self) -> None:
        """Keep the checkpoint's MXFP4 experts as blocks (`--quantization mxfp4`), called on the model as
        built, before its weights are allocated and loaded; ValueError where the tensor-parallel slices cut
        blocks."""
        for layer in self.layers:
            layer.mlp.keep_mxfp4()

    def use_fused_cpu_ops(self, enable: bool = True) -> None:
        """No fused C++ layer path: the layers always run eagerly."""
        self.fused_cpu_ops = False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, backend)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return self._logits(self.norm(h))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers-named tensors (float experts, or MXFP4 `*_blocks` + `*_scales` pairs, which may
        arrive in any order), each layer taking this rank's slice; raise on unknown names, wrong shapes and
        missing weights."""
        self.tie_weights()
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 name -> the half of blocks/scales seen

        def put(pname: str, tensor: torch.Tensor, index: tuple = (), tag: str = "") -> None:
            param = params.get(pname)
            if param is None:
                raise ValueError(f"unexpected weight {pname!r}")
            dst = param.data[index]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {pname!r}{tag and f' ({tag})'} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(f"{pname}#{tag}")

        def shard(pname: str, tensor: torch.Tensor, part: int = 0) -> None:
            """A parallel layer (runtime.models.parallel) takes its slice of the full tensor."""
            stem, _, attr = pname.rpartition(".")
            if pname not in params:
                raise ValueError(f"unexpected weight {pname!r}")
            try:
                modules[stem].load_shard(attr, tensor, part)
            except ValueError as e:
                raise ValueError(f"{pname}: {e}") from None
            loaded.add(f"{pname}#{part}")

        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name in ("embed_tokens.weight", "lm_head.weight"):
                shard(name, tensor)
                continue
            parts = name.split(".")
            if len(parts) < 4 or parts[0] != "layers":
                put(name, tensor)
                continue
            layer, block, module = ".".join(parts[:2]), parts[2], parts[3]
            if block == "self_attn" and module in _QKV and len(parts) == 5:
                shard(f"{layer}.self_attn.qkv_proj.{parts[4]}", tensor, _QKV[module])
            elif block == "self_attn" and name.endswith("o_proj.weight"):
                shard(f"{layer}.self_attn.o_proj.weight", tensor)
            elif block == "self_attn" and name.endswith("o_proj.bias"):
                put(f"{layer}.self_attn.o_bias", tensor)
            elif block == "self_attn" and module == "sinks":
                if tensor.shape != (self.cfg.num_heads,):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, expected ({self.cfg.num_heads},)"
                    )
                a, b = self.get_submodule(f"{layer}.self_attn").heads
                put(f"{layer}.self_attn.sinks", tensor[a:b])
            elif block == "mlp" and module == "router" and len(parts) == 5:
                put(f"{layer}.mlp.router_{parts[4]}", tensor)
            elif block == "mlp" and module == "experts" and len(parts) == 5:
                leaf = parts[4]
                stem, _, kind = leaf.rpartition("_")
                if kind in ("blocks", "scales"):
                    halves = pending.setdefault(f"{layer}.{stem}", {})
                    halves[kind] = tensor
                    if len(halves) == 2:
                        del pending[f"{layer}.{stem}"]
                        self._put_expert(put, layer, stem, halves["blocks"], halves["scales"])
                else:
                    self._put_expert(put, layer, leaf, tensor)
            else:
                put(name, tensor)
        if pending:
            raise ValueError(f"MXFP4 weights without their blocks or scales: {sorted(pending)[:5]}")
        for i, layer in enumerate(self.layers):
            if layer.mlp.mxfp4 is not None:
                absent = {"gate", "up", "down"} - set(layer.mlp.mxfp4)
                if absent:
                    raise ValueError(f"MXFP4 experts missing from checkpoint: layer {i}'s {sorted(absent)}")
        missing = []
        for pname in params:
            if ".qkv_proj." in pname:
                tags: tuple[str | int, ...] = (0, 1, 2)
            elif pname.endswith((".mlp.w13", ".mlp.b13")):
                tags = ("gate", "up")
            elif pname in ("embed_tokens.weight", "lm_head.weight") or pname.endswith(".o_proj.weight"):
                tags = (0,)
            else:
                tags = ("",)
            missing += [f"{pname}#{t}" for t in tags if f"{pname}#{t}" not in loaded]
        if missing:
            raise ValueError(
                f"weights missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        for layer in self.layers:
            layer.self_attn.bind_sinks()
            if layer.mlp.mxfp4 is not None:
                layer.mlp.finish_mxfp4()

    def _put_expert(
        self, put, layer: str, leaf: str, tensor: torch.Tensor, scales: torch.Tensor | None = None
    ) -> None:
        """One expert tensor: `gate_up_proj` / `down_proj` (float [E, in, out]; or MXFP4 blocks with their
        `scales`, [E, out, in] once dequantized) or their biases, this rank's intermediate slice of it. gate
        and up are interleaved (even outputs gate, odd up); they load as w13's (and b13's) gate rows, then
        up rows."""
        mlp = self.get_submodule(f"{layer}.mlp")
        if mlp.mxfp4 is not None and leaf in ("gate_up_proj", "down_proj"):
            if scales is None:
                raise ValueError(
                    f"{layer}.mlp.experts.{leaf} is a float tensor: --quantization mxfp4 serves checkpoints "
                    "whose experts are MXFP4; use --quantization none"
                )
            mlp.put_mxfp4(leaf, tensor, scales)
            return
        if scales is not None:
            tensor = dequantize_mxfp4(tensor, scales, mlp.w13.dtype)  # [E, out, in]
        elif leaf in ("gate_up_proj", "down_proj"):
            tensor = tensor.transpose(1, 2)  # [E, in, out] -> [E, out, in]
        rows, i = slice(mlp.start, mlp.stop), mlp.inter
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):
            if tensor.shape[1] != 2 * mlp.inter_full:
                raise ValueError(f"{layer}.mlp.experts.{leaf} has shape {tuple(tensor.shape)}")
            target = f"{layer}.mlp.{'w13' if leaf == 'gate_up_proj' else 'b13'}"
            put(target, tensor[:, 0::2][:, rows], (slice(None), slice(0, i)), "gate")
            put(target, tensor[:, 1::2][:, rows], (slice(None), slice(i, 2 * i)), "up")
        elif leaf == "down_proj":
            if tensor.shape[2] != mlp.inter_full:
                raise ValueError(f"{layer}.mlp.experts.{leaf} has shape {tuple(tensor.shape)}")
            put(f"{layer}.mlp.w2", tensor[:, :, rows])
        elif leaf == "down_proj_bias":
            put(f"{layer}.mlp.b2", tensor)
        else:
            raise ValueError(f"unexpected weight {layer}.mlp.experts.{leaf}")


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # checkpoint projection -> part of the fused qkv_proj
