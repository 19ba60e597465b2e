"""One Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over the paged KV pool.

Projections are fused (q|k|v and gate|up) so each layer runs four matmuls; attention goes through the
`AttentionBackend`, which owns the KV pool reads and writes. Numerics follow transformers: RMSNorm in fp32
then cast, rotate-half rope with fp32 angles.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.base import AttentionBackend, AttentionLayer
from runtime.models.model_config import ModelConfig

if TYPE_CHECKING:  # a type only: models sit below model_executor and never import it at run time
    from runtime.model_executor.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.meta = AttentionLayer(
            layer_id, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, batch, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_attention_scaling)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits [len(batch.logits_indices) or bs, vocab] for the selected tokens."""
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, backend)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        h = self.norm(h)
        head = self.lm_head
        if head is None or isinstance(head, nn.Linear):
            weight = self.embed_tokens.weight if head is None else head.weight
            return (h @ weight.T).float()
        return head(h).float()  # a QuantizedLinear (runtime/models/quantization.py)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up on the fly; raise on missing or unknown names."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join([*parts[:-2], target, parts[-1]])
                param = params.get(pname)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r}")
                sizes = self._shard_sizes(target)
                offset = sum(sizes[:shard])
                param.data[offset : offset + sizes[shard]].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r}")
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        missing = []
        for pname in params:
            target = pname.split(".")[-2] if "." in pname else ""
            if target in ("qkv_proj", "gate_up_proj"):
                n = 3 if target == "qkv_proj" else 2
                missing += [f"{pname}#{i}" for i in range(n) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(
                f"weights missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )

    def _shard_sizes(self, target: str) -> list[int]:
        c = self.cfg
        if target == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]
