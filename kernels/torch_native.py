"""Reference attention on the CPU with torch's scaled_dot_product_attention over the paged KV pool.

It is the test oracle for the other backends, so clarity wins over speed where they conflict; decode is
still batched into one SDPA call per layer (KV gathered into a padded [bs, max_len] block) because decode
is where CPU serving spends its time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.base import AttentionBackend, AttentionBatch, AttentionLayer


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        table = self.req_to_token_pool.req_to_token
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            rows = table[batch.req_pool_indices, :max_len]  # [bs, max_len]
            valid = torch.arange(max_len, device=rows.device)[None, :] < batch.seq_lens[:, None]
            # Flat slot list: index_select is ~100x faster than 2-D advanced indexing on CPU (measured).
            self._decode_slots = torch.where(valid, rows, torch.zeros_like(rows)).flatten()  # slot 0 = dummy
            self._decode_shape = (len(batch.seq_lens_cpu), max_len)
            self._decode_mask = valid[:, None, None, :]  # [bs, 1, 1, max_len]
            self._all_same_len = min(batch.seq_lens_cpu) == max_len
        else:
            self._extend_slots = [
                table[row, :seq]
                for row, seq in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, strict=True)
            ]

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        out = torch.empty_like(q)
        start = 0
        for slots, prefix, ext in zip(
            self._extend_slots, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
        ):
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
            ki = k_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = v_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            if prefix == 0:
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=True
                )
            else:
                # query j (absolute position prefix + j) sees keys 0..prefix + j
                q_pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
                mask = torch.arange(prefix + ext, device=q.device)[None, :] <= q_pos
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True
                )
            out[start : start + ext] = o.squeeze(0).transpose(0, 1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        shape = (*self._decode_shape, layer.num_kv_heads, layer.head_dim)
        k = self.kv_pool.k[layer.layer_id].index_select(0, self._decode_slots).view(shape).to(q.dtype)
        v = self.kv_pool.v[layer.layer_id].index_select(0, self._decode_slots).view(shape).to(q.dtype)
        mask = None if self._all_same_len else self._decode_mask
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [bs, H, 1, D]
            k.transpose(1, 2),  # [bs, Hkv, max_len, D]
            v.transpose(1, 2),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=True,
        )
        return o.squeeze(2)  # [bs, H, D]
