"""Split-KV flash decoding over the paged KV pool.

Stage 1 (`_decode_split_kernel`, grid [bs, num_kv_heads, grid_splits]): one program takes one KV chunk of
one request and all query heads of one KV-head group (GQA: the group's KV is read once for all its query
heads), and writes a partial output plus its log-sum-exp. Stage 2 (`_decode_merge_kernel`, grid
[bs, num_heads]) merges the partials of each request with the log-sum-exp trick.

The split layout of a request depends only on its own sequence length: at most
`max_splits` chunks of at least `min_split_len` tokens, chunk starts aligned to BLOCK_N. So a request's
output does not depend on the other requests in the batch, and the launch grid can be either tight
(eager: just enough splits for the longest request) or fixed at `max_splits` (CUDA graphs) with the very
same numbers. Programs whose chunk is empty write lse = -inf and are never read by the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm_kernels.triton_ops.common import block_d, cdiv, dot_precision, log2_scale


@triton.jit
def _decode_split_kernel(
    Q,  # [bs, H, D]
    K,  # [pool_size + 1, Hkv, D]
    V,
    ReqToToken,  # [rows, max_context_len] int64 slots
    ReqPoolIdx,  # [bs] int64
    SeqLens,  # [bs] int64
    PartO,  # [bs, H, grid_splits, D] fp32
    PartLse,  # [bs, H, grid_splits] fp32, log2 domain
    sm_scale_log2,
    window,  # 0: every key; W > 0: the last W keys (a sliding-window layer)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    # split layout (same formula in the merge kernel and `decode_grid_splits`): at most MAX_SPLITS chunks of
    # at least MIN_SPLIT_LEN tokens, each a multiple of BLOCK_N long
    # (plain integer division rather than tl.cdiv: nested jit calls are slow under the interpreter), over
    # the keys [win_start, seq_len) the query sees
    win_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    kv_len = seq_len - win_start
    num_splits = tl.maximum(tl.minimum((kv_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN, MAX_SPLITS), 1)
    per_split = (kv_len + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = win_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)  # end <= start: empty chunk (split >= num_splits or tail)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # query heads of this KV head (q head i uses KV head i // GROUP)

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        slots = tl.load(ReqToToken + row * stride_rt + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        # scores in log2 units, [BLOCK_H, BLOCK_N]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds at least one valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(
            V + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(
        PartO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )
    tl.store(PartLse + b * stride_plb + heads * stride_plh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    PartO,
    PartLse,
    Out,  # [bs, H, D]
    SeqLens,
    window,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    kv_len = seq_len - tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    num_splits = tl.maximum(
        tl.minimum((kv_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN, MAX_SPLITS), 1
    )  # as stage 1

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(PartLse + b * stride_plb + head * stride_plh + s)
        o = tl.load(
            PartO + b * stride_pob + head * stride_poh + s * stride_pos + offs_d, mask=d_mask, other=0.0
        )
        m_new = tl.maximum(m_i, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all chunks so far empty: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * alpha + w * o
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def decode_grid_splits(max_seq_len: int, max_splits: int, min_split_len: int) -> int:
    """Tight grid size for a batch whose longest request has `max_seq_len` tokens (host-side mirror of
    the kernels): no request of the batch has more splits than this."""
    return max(1, min(max_splits, cdiv(max_seq_len, min_split_len)))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    grid_splits: int,
    max_splits: int,
    min_split_len: int,
    block_n: int = 64,
    num_warps: int = 4,
    window: int = 0,
) -> torch.Tensor:
    """One query token per request over its whole KV (`req_to_token[row, :seq_len]`).

    q: [bs, H, D]; k_buf, v_buf: [pool_size + 1, Hkv, D] (any float dtype; cast to q's dtype in-kernel);
    seq_lens: [bs] on the device (never read on the host, so this is CUDA-graph safe when `grid_splits`
    is fixed). `grid_splits` must be >= the split count of every request (`decode_grid_splits`, or
    `max_splits`). `window` > 0 attends to each request's last `window` keys only. Returns [bs, H, D] in
    q's dtype.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not 1 <= grid_splits <= max_splits:
        raise ValueError(f"grid_splits {grid_splits} must be in 1..{max_splits}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("KV buffers must be contiguous in head_dim")
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((bs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if bs == 0:
        return out
    bd = block_d(head_dim)
    part_o = torch.empty((bs, num_heads, grid_splits, bd), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((bs, num_heads, grid_splits), dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16; padded heads are masked
    _decode_split_kernel[(bs, num_kv_heads, grid_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        part_o,
        part_lse,
        log2_scale(scaling),
        window,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        MAX_SPLITS=max_splits,
        MIN_SPLIT_LEN=min_split_len,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
    _decode_merge_kernel[(bs, num_heads)](
        part_o,
        part_lse,
        out,
        seq_lens,
        window,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_N=block_n,
        MAX_SPLITS=max_splits,
        MIN_SPLIT_LEN=min_split_len,
        num_warps=1 if bd <= 64 else 2,
    )
    return out
