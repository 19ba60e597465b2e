"""One Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Phi-3 / Phi-4) over
the paged KV pool. Gemma 2 and 3 reuse its pieces (`runtime.models.gemma`).

Projections are fused (q|k|v and gate|up) so each layer runs four matmuls; attention goes through the
`AttentionBackend`, which owns the KV pool reads and writes. Numerics follow transformers: RMSNorm in fp32
then cast, rotate-half rope with fp32 angles. A mixture-of-experts layer's MLP is
`runtime.models.moe.SparseMoeBlock`: on the CPU its experts run as one C++ call (`runtime.models.moe_fused`).

Under tensor parallelism (`runtime.models.parallel`) each rank holds its heads, its slice of the MLP and of
the vocabulary; norms and rope are replicated. Weights are loaded from the full checkpoint, each layer
taking its own shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_kernels.base import AttentionBackend, AttentionLayer
from runtime.models.model_config import ModelConfig
from runtime.models.model_loader import unfuse_weights
from runtime.models.moe import SparseMoeBlock, expert_weight_target, shared_expert_name
from runtime.models.parallel import (
    ColumnParallelLinear,
    HeadShard,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    split_range,
)

if TYPE_CHECKING:  # a type only: models sit below model_executor and never import it at run time
    from runtime.model_executor.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, bit-identical to the steps below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables are computed per forward from positions (cheap next to the matmuls)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        super().__init__()
        # A plain attribute, not a buffer: it must stay fp32 when the module is cast to bf16.
        self.inv_freq = inv_freq.float()
        self.scaling = scaling
        self._table: torch.Tensor | None = None  # cos | sin [P, 2D] float32, see `cos_sin_rows`

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def cos_sin_rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [T, D] as row views of a table built once (grown to the next power of two past
        `max_position`): one index_select per forward instead of building the angles (~10 small ops)."""
        table = self._table
        if table is None or table.shape[0] <= max_position or table.device != positions.device:
            n = 1 << max(max_position, 255).bit_length()
            cos, sin = self.cos_sin(torch.arange(n, device=positions.device), torch.float32)
            table = self._table = torch.cat((cos, sin), dim=-1)
        rows = table.index_select(0, positions)
        d = table.shape[1] // 2
        return rows[:, :d], rows[:, d:]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, D], or [T, R < D] for partial rotary (Phi-4-mini): the first R dims
        rotate, the rest pass through."""
        if cos.shape[-1] < x.shape[-1]:
            r = cos.shape[-1]
            return torch.cat((Rotary.apply(x[..., :r], cos, sin), x[..., r:]), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear_call(module: nn.Module) -> tuple:
    """(fn, args) with `fn(x, *args) == module(x)` for the fused path's contiguous 2-D float32 inputs: the
    module's own `decode_call` where it has one (W4A8Linear: its op, blocks bound), else its forward."""
    decode_call = getattr(module, "decode_call", None)
    return decode_call() if decode_call is not None else (module.forward, ())


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        s, d = HeadShard.of(cfg.num_heads, cfg.num_kv_heads, tp), cfg.head_dim
        window = cfg.sliding_window(layer_id)  # 0: global attention
        self.meta = AttentionLayer(layer_id, s.num_heads, s.num_kv_heads, d, d**-0.5, window)  # rank's heads
        self.q_size = s.num_heads * d
        self.kv_size = s.num_kv_heads * d
        q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d
        kv_rows = (kv_full, s.kv_start * d, s.kv_stop * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [(q_full, s.q_start * d, s.q_stop * d), kv_rows, kv_rows], bias=cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, tp, (s.q_start * d, s.q_stop * d))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, h, cos, sin, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        m = self.meta
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, m.num_heads, m.head_dim)  # [T, H, D]
        k = k.view(-1, m.num_kv_heads, m.head_dim)  # [T, Hkv, D]
        v = v.view(-1, m.num_kv_heads, m.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        out = backend.forward(q, k, v, m, batch)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, intermediate_size: int | None = None):
        super().__init__()
        full = intermediate_size or cfg.intermediate_size
        start, stop = split_range(full, tp.size, tp.rank)
        self.inter = stop - start
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(full, start, stop)] * 2)
        self.down_proj = RowParallelLinear(full, cfg.hidden_size, tp, (start, stop))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        moe = cfg.moe
        self.mlp: MLP | SparseMoeBlock
        if moe is not None and layer_id in moe.sparse_layers:
            self.mlp = SparseMoeBlock(
                cfg.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.routing,
                tp,
                score_bias=moe.score_bias,
            )
            if moe.shared_intermediate_size:  # Qwen2-MoE, GLM-4.5: a dense expert every token runs
                self.mlp.add_shared_expert(MLP(cfg, tp, moe.shared_intermediate_size), moe.shared_gated)
        else:
            self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, batch, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_attention_scaling)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.fused_cpu_ops = False
        self._fused_plan: list[tuple] | None = None  # see `_layer_plan`
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head's weight is the embedding's Parameter (one tensor, loaded once).
        Called again when loading: `to_empty` (meta -> device) gives every module a Parameter of its own."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_fused_cpu_ops(self, enable: bool = True) -> None:
        """Run rope, SiLU * up and residual add + RMSNorm as one C++ call each, and take rope's cos/sin from
        a cached table (runtime.models.native_kernels.FUSED_LAYERS, which the caller has loaded): float32 on
        the CPU, where eager dispatch of the small elementwise ops costs more than their arithmetic at
        decode batch sizes. Results are within float32 rounding (~1e-6) of the unfused path."""
        self.fused_cpu_ops = enable
        self._fused_plan = None  # rebuilt from the current modules on the next fused forward

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits [len(batch.logits_indices) or bs, vocab] for the selected tokens."""
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        if self.fused_cpu_ops:
            return self._forward_fused(h, batch, backend)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, backend)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return self._logits(self.norm(h))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)  # [T, this rank's padded vocabulary slice]
        return self.tp.gather_logits(logits, self.cfg.vocab_size).float()

    def _layer_plan(self) -> list[tuple]:
        """Per layer, what the fused loop reads, looked up once: (norm weight, eps) pairs, the qkv split, and
        each projection as (callable, extra args) (`linear_call`). A layer then runs as its ~12 C++ calls
        with no Python frames between them: the Attention / MLP / linear forwards and their attribute
        lookups cost ~14 us a layer at batch 1 (0.4 ms of a ~8 ms step, 1 thread, w4a8). Built on the first
        fused forward after `use_fused_cpu_ops`; like `runtime.models.frozen_modules`, it assumes the module
        tree is final by then."""
        plan = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            m = a.meta
            split = (
                m.num_heads + 2 * m.num_kv_heads,
                m.head_dim,
                (m.num_heads, m.num_kv_heads, m.num_kv_heads),
            )
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            if isinstance(mlp, SparseMoeBlock):  # (its forward, None): routing and the fused expert op
                mlp_calls = ((mlp.forward, ()), None)
            else:
                mlp_calls = (linear_call(mlp.gate_up_proj), linear_call(mlp.down_proj))
            plan.append(
                (
                    (norm1.weight, norm1.eps),
                    linear_call(a.qkv_proj),
                    split,
                    None if a.q_norm is None else (a.q_norm, a.k_norm),
                    m,
                    linear_call(a.o_proj),
                    (norm2.weight, norm2.eps),
                    *mlp_calls,
                )
            )
        return plan

    def _forward_fused(self, residual: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend):
        """The layers with the residual stream carried apart (float32 on the CPU, FUSED_LAYERS loaded): `h` is
        the previous layer's MLP output (None before the first layer, whose residual is the embedding), and
        each layer adds it to `residual` in place as it norms it. Splits qkv into strided views, no copies."""
        cos, sin = self.rotary.cos_sin_rows(batch.positions, max(batch.seq_lens_cpu) - 1)
        plan = self._fused_plan
        if plan is None:
            plan = self._fused_plan = self._layer_plan()
        ops = torch.ops.radixlm
        rms_norm, add_rms_norm_, rope_, silu_mul = (
            ops.rms_norm,
            ops.fused_add_rms_norm_,
            ops.rope_,
            ops.silu_mul,
        )
        attend = backend.forward
        h = None
        for norm1, qkv, (n_heads, d, heads), qk_norm, meta, o, norm2, gate_up, down in plan:
            if h is None:
                h = rms_norm(residual, *norm1)
            else:  # residual += h; h = norm(residual)
                add_rms_norm_(h, residual, *norm1)
            q, k, v = qkv[0](h, *qkv[1]).view(-1, n_heads, d).split_with_sizes(heads, dim=1)
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            if cos.shape[1] == d:
                rope_(q, k, cos, sin)  # in place, one call for q and k
            else:  # partial rotary: the first cos.shape[1] dims, in place through strided views
                rope_(q[..., : cos.shape[1]], k[..., : cos.shape[1]], cos, sin)
            out = attend(q, k, v, meta, batch).flatten(1)  # [T, H * D]
            h = o[0](out if out.is_contiguous() else out.contiguous(), *o[1])
            add_rms_norm_(h, residual, *norm2)
            if down is None:  # a mixture-of-experts block: gate_up is its whole forward
                h = gate_up[0](h)
            else:
                h = down[0](silu_mul(gate_up[0](h, *gate_up[1])), *down[1])
        if batch.logits_indices is not None:
            h, residual = h[batch.logits_indices], residual[batch.logits_indices]
        torch.ops.radixlm.fused_add_rms_norm_(h, residual, self.norm.weight, self.norm.eps)
        return self._logits(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors: fuse q/k/v and gate/up, and let each sharded layer take its slice;
        raise on missing or unknown names and on shape mismatches."""
        self.tie_weights()
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())  # a tied head's weight is listed once, as the embedding's
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        # GLM-4.5's multi-token-prediction layers follow the decoder's (layers.N.*, N >= num_hidden_layers):
        # a speculative head radixlm does not serve, skipped as transformers skips them
        extra = getattr(self.cfg.hf_config, "num_nextn_predict_layers", 0) or 0
        served = self.cfg.num_layers
        for name, tensor in unfuse_weights(weights, self.cfg):
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if extra and name.startswith("layers.") and served <= int(name.split(".")[1]) < served + extra:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding serves as the output projection
            parts = shared_expert_name(name.split("."))
            part = 0
            if (moe_target := expert_weight_target(parts)) is not None:
                parts, part = moe_target
            elif len(parts) >= 2 and parts[-2] in fused:
                target, part = fused[parts[-2]]
                parts = [*parts[:-2], target, parts[-1]]
            pname = ".".join(parts)
            param = params.get(pname)
            if param is None:
                raise ValueError(f"unexpected weight {name!r}")
            module = modules[".".join(parts[:-1])]
            if hasattr(module, "load_shard"):  # the layers of runtime.models.parallel slice full tensors
                try:
                    module.load_shard(parts[-1], tensor, part)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
            elif param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            else:
                param.data.copy_(tensor)
            loaded.add(f"{pname}#{part}")
        missing = []
        for pname in params:
            module = modules[pname.rpartition(".")[0]]
            if isinstance(module, SparseMoeBlock):
                n = module.load_parts(pname.rpartition(".")[2])
            else:
                n = len(module.parts) if isinstance(module, ColumnParallelLinear) else 1
            missing += [f"{pname}#{i}" for i in range(n) if f"{pname}#{i}" not in loaded]
        if missing:
            raise ValueError(
                f"weights missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
