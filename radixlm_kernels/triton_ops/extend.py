"""Extend (prefill over a cached prefix) attention over the paged KV pool.

Grid [bs, num_heads, cdiv(max_new_tokens, BLOCK_M)]: one program owns BLOCK_M new tokens of one request
and one query head, and runs one online softmax over the request's KV positions 0 .. (its last new token):
the cached prefix, which every new token sees, then the new tokens under a causal mask. (One loop with a
mask by absolute position rather than two loops: the mask is free next to the loads, and the Triton
interpreter used in tests pays per nested call.) K/V are read from the pool through `req_to_token`, so the
new tokens' K/V must already be written there (the backend's `forward` does that first) and
`req_to_token[row, :seq_len]` must cover prefix + new tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm_kernels.triton_ops.common import block_d, cdiv, dot_precision, log2_scale


@triton.jit
def _extend_kernel(
    Q,  # [num_tokens, H, D]
    Out,  # [num_tokens, H, D]
    K,  # [pool_size + 1, Hkv, D]
    V,
    ReqToToken,  # [rows, max_context_len] int64
    ReqPoolIdx,  # [bs] int64
    PrefixLens,  # [bs] int64
    ExtendLens,  # [bs] int64
    QoStart,  # [bs] int64: first row of request b in q / out
    sm_scale_log2,
    window,  # 0: causal; W > 0: also key position > query position - W (a sliding-window layer)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    prefix_len = tl.load(PrefixLens + b).to(tl.int32)
    qo_start = tl.load(QoStart + b).to(tl.int64)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    kv_head = head // GROUP

    m_start = m_block * BLOCK_M
    live = m_start < ext_len  # blocks past this request's new tokens do no work
    offs_m = m_start + tl.arange(0, BLOCK_M)  # index among the request's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext_len
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        Q + (qo_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys are the request's KV positions 0 .. prefix_len + (last new token of this block). New token i sits
    # at position prefix_len + i and sees positions <= prefix_len + i: all of the prefix, causal over the new.
    kv_end = tl.where(live, prefix_len + tl.minimum(ext_len, m_start + BLOCK_M), 0)
    # under a window, keys before the block's first query's window are seen by none of its queries
    kv_start = tl.where((window > 0) & live, tl.maximum(prefix_len + m_start - window + 1, 0), 0)
    q_pos = prefix_len + offs_m
    for n0 in range(kv_start, kv_end, BLOCK_N):
        key = n0 + offs_n
        key_mask = key < kv_end
        slots = tl.load(ReqToToken + row * stride_rt + key, mask=key_mask, other=0).to(tl.int64)
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        # scores in log2 units, [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
        visible = key_mask[None, :] & (key[None, :] <= q_pos[:, None])
        visible = visible & ((window == 0) | (key[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        # A row may see no key of a block (a window starting later than the block): keep its max at -inf and
        # take exp2 against 0 (m_new finite otherwise: each row sees its own position eventually).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        v = tl.load(
            V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + (qo_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix plus the new tokens (with
    `window` > 0, over the last `window` positions up to each token's own).

    q: [num_tokens, H, D] (requests' new tokens concatenated; request b's rows start at qo_start[b]);
    k_buf, v_buf: [pool_size + 1, Hkv, D]; prefix_lens, extend_lens, qo_start: [bs] int64 on q's device;
    `max_extend_len` (host int) sizes the grid. Returns [num_tokens, H, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("KV buffers must be contiguous in head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    bs = req_pool_indices.shape[0]
    if num_tokens == 0 or bs == 0:
        return out
    bd = block_d(head_dim)
    if num_warps is None:
        num_warps = 4 if bd <= 64 else 8
    grid = (bs, num_heads, cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        out,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        qo_start,
        log2_scale(scaling),
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
    return out
