"""Reference attention with torch's scaled_dot_product_attention over the paged KV pool (CPU, or any device).

It is the test oracle for the other backends, so clarity wins over speed where they conflict; decode is
still batched into one SDPA call per layer (KV gathered into a padded [bs, max_len] block) because decode
is where CPU serving spends its time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm_kernels.base import AttentionBackend, AttentionBatch, AttentionLayer


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, each query row's log-sum-exp): torch's CPU flash kernel on the CPU, where the
    prefix/new split below is what makes extends fast; elsewhere the same two values in float32 arithmetic
    (this backend is the GPU kernels' oracle there, not their rival)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )[:2]
        return out, lse
    return math_attention_with_lse(q, k, v, causal, scale)


def math_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, D], k/v [B, H, Lk, D] (same head count) -> (out in q's dtype, lse float32 [B, H, Lq]);
    `causal` is top-left aligned, as in the flash kernels."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = scores.shape[-2:]
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def attend_prefix_then_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """`attend_prefix_then_causal_lse`'s output alone."""
    return attend_prefix_then_causal_lse(q, k, v, prefix, scale)[0]


def attend_prefix_then_causal_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse float32 [1, H, ext]): causal attention of `ext` new queries placed after `prefix` cached
    keys, without a mask tensor.

    q [1, H, ext, D]; k, v [1, Hkv, prefix + ext, D] -> [1, H, ext, D]. Every new query sees the whole
    prefix, so that part needs no mask; the new tokens among themselves are plain (top-left) causal. Both
    parts run in the flash kernel, which returns each row's log-sum-exp, and are merged exactly:
    o = o_p * exp(lse_p - lse) + o_n * exp(lse_n - lse), lse = logaddexp(lse_p, lse_n).
    A masked SDPA call also reaches the flash kernel (torch 2.13) but first turns the [ext, prefix + ext]
    bool mask into an additive float mask per layer. Measured on SmolLM2-135M, 1 thread: a 280-token
    extend over a 1000-token prefix costs ~1.33x the no-prefix extend either way; the difference is the
    arithmetic of attending over the prefix (4 * ext * prefix * H * D flops per layer, ~19 GFLOP in all
    next to ~60 GFLOP of linear layers), not the mask.
    """
    _, h, ext, d = q.shape
    hkv = k.shape[1]
    groups = h // hkv
    # Prefix: heads sharing a KV head are folded into the query axis (no mask, so row order is free),
    # which avoids repeating the prefix K/V per query head.
    q_fold = q.reshape(1, hkv, groups * ext, d)
    o_p, lse_p = _flash_with_lse(q_fold, k[:, :, :prefix], v[:, :, :prefix], False, scale)
    o_p, lse_p = o_p.reshape(1, h, ext, d), lse_p.reshape(1, h, ext)
    k_new, v_new = k[:, :, prefix:], v[:, :, prefix:]
    if groups > 1:
        k_new, v_new = k_new.repeat_interleave(groups, dim=1), v_new.repeat_interleave(groups, dim=1)
    o_n, lse_n = _flash_with_lse(q, k_new, v_new, True, scale)
    lse = torch.logaddexp(lse_p, lse_n)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1).to(q.dtype)
    w_n = torch.exp(lse_n - lse).unsqueeze(-1).to(q.dtype)
    return o_p * w_p + o_n * w_n, lse


def attend_causal_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out, lse float32 [1, H, ext]) of plain causal attention: q [1, H, ext, D]; k, v [1, Hkv, ext, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out, lse = _flash_with_lse(q, k, v, True, scale)
    return out, lse.float()


def soft_cap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """scores <- cap * tanh(scores / cap) in place: Gemma 2's soft-capped attention logits
    (`AttentionLayer.logit_softcap`); cap 0 leaves them."""
    if cap:
        scores.div_(cap).tanh_().mul_(cap)
    return scores


def masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, nq, D], k/v [1, Hkv, nk, D], mask bool [nq, nk] (True = attend; every row attends somewhere)
    -> (out in q's dtype, lse float32 [1, H, nq]), in float32 arithmetic; scores soft-capped by `softcap`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = soft_cap_(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head from attention without: out [1, H, n, D] and its rows' lse
    [1, H, n] -> out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)."""
    scale = torch.sigmoid(lse.float() - sinks.to(lse.device)[None, :, None])
    return out * scale.unsqueeze(-1).to(out.dtype)


def decode_attention_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One-token attention as two batched matmuls in q's dtype with an fp32 softmax (bf16/fp16 decode).

    q [bs, H, D]; k, v [bs, L, Hkv, D]; mask [bs, 1, 1, L] bool (True = attend) or None -> [bs, H, D].
    Query heads sharing a KV head are grouped as rows of one matmul (head h reads KV head h // (H/Hkv),
    as SDPA's enable_gqa does), so K/V are never repeated. Why not SDPA: torch's CPU flash kernel is slow
    in bf16 for a single query row. Measured at 1 thread (load ~10, 9 heads / 3 KV heads of 64, L=130):
    bf16 SDPA 0.29 / 2.3 / 9.8 ms at bs 1 / 8 / 32, this 0.20 / 0.47 / 0.98 ms; in a bs-32 bf16 decode
    step SDPA was 59% of the time. Largest output difference to fp32 SDPA: ~1 bf16 ulp.
    `sinks` (float32 [H], `AttentionLayer.sinks`) join each head's softmax as a column with no value;
    `softcap` soft-caps the scores (`AttentionLayer.logit_softcap`).
    """
    bs, h, d = q.shape
    hkv = k.shape[2]
    scores = torch.matmul(q.view(bs, hkv, h // hkv, d), k.permute(0, 2, 3, 1)).float()  # [bs, Hkv, G, L]
    soft_cap_(scores.mul_(scale), softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.device).view(1, hkv, h // hkv, 1).expand(bs, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1].to(q.dtype)
        return torch.matmul(probs, v.transpose(1, 2)).view(bs, h, d)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(bs, h, d)  # [bs, Hkv, G, D] -> [bs, H, D]


WINDOW_QUERY_BLOCK = 256  # a sliding-window extend's queries per SDPA call: its mask is [block, block + W]


def window_mask(q_start: int, n_q: int, k_start: int, n_k: int, window: int, device) -> torch.Tensor:
    """bool [n_q, n_k], True where the query at position q_start + i sees the key at k_start + j: causal and
    within the window (0 <= q - k < window)."""
    d = (torch.arange(n_q, device=device) + q_start)[:, None] - (torch.arange(n_k, device=device) + k_start)
    return (d >= 0) & (d < window)


def window_decode_slots(
    table: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decoding request's last `window` slots (its window's keys), left-aligned and padded:
    (slots [bs, L] with 0 in padding, valid [bs, L]), L = the longest window in the batch."""
    start = (seq_lens - window).clamp(min=0)
    width = int((seq_lens - start).max())
    cols = start[:, None] + torch.arange(width, device=seq_lens.device)[None, :]
    valid = cols < seq_lens[:, None]
    slots = table[req_pool_indices[:, None], cols.clamp(max=table.shape[1] - 1)]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    supports_sliding_window = True
    supports_sinks = True
    supports_logit_softcap = True
    supports_sliding_pool = True

    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        self._window_meta: dict[int, tuple] = {}  # sliding window -> its decode slots, built on first use
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
        if layer.sinks is not None or layer.logit_softcap:
            return self._extend_with_lse(q, layer, batch)
        if layer.sliding_window:
            return self._extend_windowed(q, layer, batch)
        return self._extend_plain(q, layer, batch)

    def _extend_plain(
        self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch, skip: frozenset = frozenset()
    ) -> torch.Tensor:
        """Extend of a full-attention layer without sinks or soft-capping, request by request; the rows of
        the requests in `skip` (batch indices) are left unset, for another kernel to fill."""
        k_buf, v_buf = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        out = torch.empty_like(q)
        start = 0
        for i, (slots, prefix, ext) in enumerate(
            zip(self._extend_slots, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True)
        ):
            if i in skip:
                start += ext
                continue
            qi = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, H, ext, D]
            ki = k_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = v_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            if prefix == 0:
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=True
                )
            else:
                o = attend_prefix_then_causal(qi, ki, vi, prefix, layer.scaling)
            out[start : start + ext] = o.squeeze(0).transpose(0, 1)
            start += ext
        return out

    def _extend_windowed(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        """Sliding-window extend: per request and block of queries, only the keys some query of the block
        sees (from the first query's window start), under an explicit causal-and-window mask."""
        k_buf, v_buf = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        w = layer.sliding_window
        out = torch.empty_like(q)
        start = 0
        for slots, prefix, ext in zip(
            self._extend_slots, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
        ):
            for a in range(0, ext, WINDOW_QUERY_BLOCK):
                b = min(ext, a + WINDOW_QUERY_BLOCK)
                lo, hi = max(0, prefix + a - w + 1), prefix + b  # keys [lo, hi) of this block's windows
                qi = q[start + a : start + b].transpose(0, 1).unsqueeze(0)  # [1, H, nq, D]
                rows = self.kv_pool.translate(layer.layer_id, slots[lo:hi])
                ki = k_buf.index_select(0, rows).to(q.dtype).transpose(0, 1).unsqueeze(0)
                vi = v_buf.index_select(0, rows).to(q.dtype).transpose(0, 1).unsqueeze(0)
                mask = window_mask(prefix + a, b - a, lo, hi - lo, w, q.device)
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True
                )
                out[start + a : start + b] = o.squeeze(0).transpose(0, 1)
            start += ext
        return out

    def _extend_with_lse(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        """Extend for a layer with sinks or soft-capped scores: the attention's output and its rows'
        log-sum-exp, then `apply_sinks` where the layer has sinks. Global layers without soft-capping take the
        flash kernel's lse (prefix and new tokens merged as in `attend_prefix_then_causal`); sliding-window or
        soft-capped layers (SDPA has no soft-cap) a masked float32 pass per block of queries."""
        k_buf, v_buf = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        w, cap = layer.sliding_window, layer.logit_softcap
        masked = bool(w or cap)
        out = torch.empty_like(q)
        start = 0
        for slots, prefix, ext in zip(
            self._extend_slots, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
        ):
            blocks = range(0, ext, WINDOW_QUERY_BLOCK) if masked else (0,)
            for a in blocks:
                b = min(ext, a + WINDOW_QUERY_BLOCK) if masked else ext
                lo, hi = (max(0, prefix + a - w + 1) if w else 0), prefix + b
                qi = q[start + a : start + b].transpose(0, 1).unsqueeze(0)  # [1, H, nq, D]
                rows = self.kv_pool.translate(layer.layer_id, slots[lo:hi])
                ki = k_buf.index_select(0, rows).to(q.dtype).transpose(0, 1).unsqueeze(0)
                vi = v_buf.index_select(0, rows).to(q.dtype).transpose(0, 1).unsqueeze(0)
                if masked:  # a window of 0 is causal only (hi - lo keys: every key the block sees)
                    mask = window_mask(prefix + a, b - a, lo, hi - lo, w or hi - lo, q.device)
                    o, lse = masked_attention_with_lse(qi, ki, vi, mask, layer.scaling, cap)
                elif prefix == 0:
                    o, lse = attend_causal_lse(qi, ki, vi, layer.scaling)
                else:
                    o, lse = attend_prefix_then_causal_lse(qi, ki, vi, prefix, layer.scaling)
                if layer.sinks is not None:
                    o = apply_sinks(o, lse, layer.sinks)
                out[start + a : start + b] = o.squeeze(0).transpose(0, 1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        if layer.sliding_window:  # only each request's last `window` keys
            meta = self._window_meta.get(layer.sliding_window)
            if meta is None:
                slots, valid = window_decode_slots(
                    self.req_to_token_pool.req_to_token,
                    batch.req_pool_indices,
                    batch.seq_lens,
                    layer.sliding_window,
                )
                meta = self._window_meta[layer.sliding_window] = (
                    self.kv_pool.translate(layer.layer_id, slots.flatten()),  # the layer's rows
                    tuple(slots.shape),
                    None if bool(valid.all()) else valid[:, None, None, :],
                )
            slots, shape2, mask = meta
        else:
            slots, shape2 = self._decode_slots, self._decode_shape
            mask = None if self._all_same_len else self._decode_mask
        shape = (*shape2, layer.num_kv_heads, layer.head_dim)
        k = self.kv_pool.k[layer.layer_id].index_select(0, slots).view(shape).to(q.dtype)
        v = self.kv_pool.v[layer.layer_id].index_select(0, slots).view(shape).to(q.dtype)
        if q.dtype != torch.float32 or layer.sinks is not None or layer.logit_softcap:
            return decode_attention_matmul(q, k, v, mask, layer.scaling, layer.sinks, layer.logit_softcap)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [bs, H, 1, D]
            k.transpose(1, 2),  # [bs, Hkv, max_len, D]
            v.transpose(1, 2),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=True,
        )
        return o.squeeze(2)  # [bs, H, D]
