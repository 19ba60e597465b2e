"""The `cpu` attention backend (C++ paged attention over the pool) against the torch_native oracle."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixlm_kernels import create_backend, resolve_backend_name
from radixlm_kernels.cpu_backend import FUSED_MAX_EXTEND, CpuPagedBackend
from radixlm_kernels.torch_native import TorchNativeBackend
from runtime.models.native_kernels import (
    PAGED_ATTENTION,
    PAGED_ATTENTION_AVX2_ENV,
    PAGED_ATTENTION_NO_AMX_ENV,
    PAGED_ATTENTION_PORTABLE_ENV,
    paged_attention_isa,
    paged_attention_uses_amx,
)
from runtime.platform import cpu_flags, cpu_has_amx_bf16
from tests.kernels.native import load_native_or_skip

pytestmark = pytest.mark.slow  # builds a C++ kernel on first use (the fast tier needs no compiler)


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    load_native_or_skip(PAGED_ATTENTION)


ROOT = Path(__file__).resolve().parents[2]
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,share",
    [
        ([0, 5, 130], None, 0),  # decode: 1, 6 and 131 keys
        ([700], None, 0),  # one long request: split across threads and merged
        ([40, 3, 0], [7, 1, 12], 0),  # short extends after cached prefixes, one without a prefix
        ([300, 300], [FUSED_MAX_EXTEND, 2], 0),  # the largest fused extend
        ([600, 530], None, 520),  # decode over a shared prefix: its first two splits are read once
        ([300, 280], [5, 9], 280),  # extends over a shared prefix (one whole split shared)
        ([30, 300, 7], [FUSED_MAX_EXTEND + 9, 1, 3], 0),  # a long extend; the short ones beside take the op
    ],
)
def test_matches_torch_native(dtype, prefix_lens, extend_lens, share, make_case, run_backend, reference):
    case = make_case(
        prefix_lens,
        extend_lens,
        num_kv_heads=3,
        group=3,
        dtype=dtype,
        seed=len(prefix_lens),
        share_prefix=share,
    )
    out = run_backend(CpuPagedBackend(case.pool_copy(), case.req_pool), case)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), reference(case), **TOL[dtype])


@pytest.mark.parametrize("head_dim", [24, 64, 128])  # 24: rows widened into float first; else read in place
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_head_dim_matches_torch_native(head_dim, dtype, make_case, run_backend, reference):
    case = make_case([0, 33, 300], None, num_kv_heads=2, group=2, head_dim=head_dim, dtype=dtype, seed=7)
    out = run_backend(CpuPagedBackend(case.pool_copy(), case.req_pool), case)
    torch.testing.assert_close(out.float(), reference(case), **TOL[dtype])


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 5), (1, 9), (4, 2)])
@pytest.mark.parametrize("extend_lens", [None, [3, 1]])
def test_every_query_group_size_matches_torch_native(
    num_kv_heads, group, extend_lens, make_case, run_backend, reference
):
    """Query heads per KV head other than SmolLM2's 3, and row counts that are not a multiple of 4 (rows are
    scored four at a time), over a float16 pool."""
    case = make_case([290, 40], extend_lens, num_kv_heads=num_kv_heads, group=group, seed=group)
    half = copy.copy(case)
    half.q = case.q.half()
    half.kv_pool = case.pool_copy(torch.float16)
    out = run_backend(CpuPagedBackend(half.kv_pool, case.req_pool), half)
    torch.testing.assert_close(out.float(), reference(half), **TOL[torch.float16])


def _scattered_batch(gen, seq, rows, table_rows, dtype):
    """K/V [S, 3, 64] of `dtype` and a req_to_token table whose row rows[b] holds request b's seq[b] slots,
    drawn at random from the pool (slot 0 unused), as a serving pool's are."""
    size = sum(seq) + 8
    k = torch.randn(size, 3, 64, generator=gen).to(dtype)
    v = torch.randn(size, 3, 64, generator=gen).to(dtype)
    free = (torch.randperm(size - 1, generator=gen) + 1).tolist()
    table = torch.zeros(table_rows, 720, dtype=torch.int64)
    for b, n in enumerate(seq):
        table[rows[b], :n] = torch.tensor([free.pop() for _ in range(n)])
    return k, v, table


def _softmax_oracle(q, k, v, table, rows, seq, ext, scale, sinks=None, softcap=0.0):
    """The attention in float64 from the gathered K/V, each query causal at its position; `sinks` [H] join
    each head's softmax as a column with no value; `softcap` > 0 soft-caps the scaled scores."""
    want = torch.empty(q.shape, dtype=torch.float64)
    heads, group, start = q.shape[1], q.shape[1] // k.shape[1], 0
    for b in range(len(seq)):
        slots = table[rows[b], : seq[b]]
        kb, vb = k[slots].double(), v[slots].double()
        for j in range(ext[b]):
            pos = seq[b] - ext[b] + j
            for h in range(heads):
                scores = kb[: pos + 1, h // group] @ q[start + j, h].double() * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                want[start + j, h] = torch.softmax(scores, 0)[: pos + 1] @ vb[: pos + 1, h // group]
        start += ext[b]
    return want


def _attend_alone(args, b, q_start):
    """paged_attention for request b of the batch `args` by itself."""
    q, k, v, table, rows, seq, ext, scale = args
    lo, hi = q_start[b], q_start[b + 1]
    return torch.ops.radixlm.paged_attention(
        q[lo:hi], k, v, table, rows[b : b + 1], seq[b : b + 1], ext[b : b + 1], scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ext", [[1, 1, 1, 1], [1, 6, 2, 1]])
def test_a_shared_prefix_changes_no_bits(dtype, ext):
    """Requests whose slots coincide over whole splits (a radix-cache prefix) are scored in one pass over
    those K/V rows; each request's output is still bit for bit what it gets alone, and right."""
    gen = torch.Generator().manual_seed(11)
    seq = [700, 650, 612, 200]  # 0-2 share 512 slots (two splits); 3 shares its first 200 but no whole split
    rows = torch.tensor([4, 1, 5, 2])
    k, v, table = _scattered_batch(gen, seq, rows, 6, dtype)
    for b, n in ((1, 512), (2, 512), (3, 200)):
        table[rows[b], :n] = table[rows[0], :n]
    q = torch.randn(sum(ext), 9, 64, generator=gen).to(dtype)
    args = (q, k, v, table, rows, torch.tensor(seq), torch.tensor(ext), 0.125)
    out = torch.ops.radixlm.paged_attention(*args)
    q_start = [0]
    for e in ext:
        q_start.append(q_start[-1] + e)
    for b in range(len(seq)):
        assert torch.equal(out[q_start[b] : q_start[b + 1]], _attend_alone(args, b, q_start)), b
    want = _softmax_oracle(q, k, v, table, rows, seq, ext, 0.125)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_an_extend_changes_no_bits(dtype, head_dim, softcap):
    """A task of more than 4 rows (an extend, as speculative decoding's verify step, or requests sharing a
    prefix) scores its keys another way than a decode's 3 rows (AVX-512: 16 rows as the lanes of a vector);
    each query's output is still bit for bit what decoding it alone at its position gives, soft-capped
    scores (Gemma 2's) included."""
    gen = torch.Generator().manual_seed(13)
    seq, ext = [37, 300, 531, 21, 290, 70], [5, 9, 4, 9, 5, 2]  # 6..27 rows per task
    size = sum(seq) + 8
    k = torch.randn(size, 3, head_dim, generator=gen).to(dtype)
    v = torch.randn(size, 3, head_dim, generator=gen).to(dtype)
    free = (torch.randperm(size - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq), 540, dtype=torch.int64)
    for b, n in enumerate(seq):
        table[b, :n] = torch.tensor([free.pop() for _ in range(n)])
    table[4, :256] = table[1, :256]  # one whole split shared: 27 + 15 rows in one task
    q = torch.randn(sum(ext), 9, head_dim, generator=gen).to(dtype)
    rows = torch.arange(len(seq))
    out = torch.ops.radixlm.paged_attention(
        q, k, v, table, rows, torch.tensor(seq), torch.tensor(ext), 0.125, None, softcap
    )
    one = torch.ones(1, dtype=torch.int64)
    i = 0
    for b in range(len(seq)):
        for j in range(ext[b]):
            pos = seq[b] - ext[b] + j
            alone = torch.ops.radixlm.paged_attention(
                q[i : i + 1], k, v, table, rows[b : b + 1], torch.tensor([pos + 1]), one, 0.125, None, softcap
            )
            assert torch.equal(out[i : i + 1], alone), (b, j)
            slots = table[b, : pos + 1]
            kb, vb = k[slots].double(), v[slots].double()
            for h in range(9):
                s = kb[:, h // 3] @ q[i, h].double() * 0.125
                w = torch.softmax(torch.tanh(s / softcap) * softcap if softcap else s, 0)
                torch.testing.assert_close(out[i, h].double(), w @ vb[:, h // 3], **TOL[dtype])
            i += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_big_batch_changes_no_bits(dtype):
    """A batch of many requests takes every KV head of a slot in one task and stages the K/V rows it reads
    (a copy that keeps many cache misses in flight); a lone short request does neither. Neither may change a
    bit of any request's output, and both must be right."""
    gen = torch.Generator().manual_seed(5)
    bs, n = 40, 60  # bs requests of n keys: 40 units, ~3.7 MB of K/V (float16) -- alone: 92 KB, one unit
    size = bs * n + 8
    k = torch.randn(size, 3, 64, generator=gen).to(dtype)
    v = torch.randn(size, 3, 64, generator=gen).to(dtype)
    table = torch.zeros(bs, n, dtype=torch.int64)
    for b in range(bs):  # slots interleaved across requests, as decode steps allocate them
        table[b] = torch.arange(n) * bs + b + 1
    q = torch.randn(bs, 9, 64, generator=gen).to(dtype)
    rows = torch.arange(bs)
    args = (q, k, v, table, rows, torch.full((bs,), n), torch.ones(bs, dtype=torch.int64), 0.125)
    out = torch.ops.radixlm.paged_attention(*args)
    for b in range(bs):
        assert torch.equal(out[b : b + 1], _attend_alone(args, b, list(range(bs + 1)))), b
    kb, vb = (x[table].double().repeat_interleave(3, 2) for x in (k, v))  # [bs, n, 9, 64]
    scores = torch.einsum("bhd,bnhd->bhn", q.double(), kb)
    want = torch.einsum("bhn,bnhd->bhd", torch.softmax(scores * 0.125, -1), vb)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


def test_shared_prefix_slots_and_kv_write(make_case, run_backend, reference):
    """Two requests read the same cached slots (radix-cache sharing); `forward` stores the new K/V first."""
    case = make_case([64, 80], None, num_kv_heads=2, group=2, share_prefix=50, seed=3)
    loc = case.batch.out_cache_loc
    case.kv_pool.k[0][loc] = 0.0  # only the write in `forward` makes the result right
    case.kv_pool.v[0][loc] = 0.0
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    out = run_backend(backend, case, write_kv=True)
    assert torch.equal(backend.kv_pool.k[0][loc], case.k_new)
    expected = run_backend(CpuPagedBackend(case.pool_copy(), case.req_pool), case, write_kv=True)
    torch.testing.assert_close(out, expected)
    case.kv_pool.k[0][loc], case.kv_pool.v[0][loc] = case.k_new, case.v_new
    torch.testing.assert_close(out, reference(case), atol=2e-5, rtol=1e-4)


def test_long_extend_takes_the_sdpa_path(make_case, run_backend, reference):
    case = make_case([10], [FUSED_MAX_EXTEND + 1], num_kv_heads=1, group=3, seed=5)
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    out = run_backend(backend, case)
    assert not backend._fused
    torch.testing.assert_close(out, reference(case), atol=2e-5, rtol=1e-4)


def test_bad_metadata_is_an_error_not_a_wild_read():
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(10, 2, 64)
    table = torch.zeros(2, 8, dtype=torch.int64)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="sum\\(ext_lens\\) must equal"):
        torch.ops.radixlm.paged_attention(q, k, k, table, one, torch.tensor([3]), torch.tensor([1]), 0.1)
    with pytest.raises(RuntimeError, match="ext_len <= seq_len <= req_to_token's width"):
        torch.ops.radixlm.paged_attention(q, k, k, table, one, torch.tensor([9]), torch.tensor([2]), 0.1)
    with pytest.raises(RuntimeError, match="valid row"):
        torch.ops.radixlm.paged_attention(
            q, k, k, table, torch.tensor([5]), torch.tensor([3]), torch.tensor([2]), 0.1
        )


_VARIANT_RUN = """
import sys, torch
from runtime.models.native_kernels import paged_attention_isa, paged_attention_uses_amx
isa, amx = paged_attention_isa(), paged_attention_uses_amx()
outs = []
for args in torch.load(sys.argv[1]):
    if args[3].dim() == 2:  # a slot table: the attention op (args[3] of the kv op is out_cache_loc)
        outs.append(torch.ops.radixlm.paged_attention(*args))
    else:  # the kv op: its output and the pool it wrote
        outs.append((torch.ops.radixlm.paged_attention_kv(*args), args[4], args[5]))
torch.save((isa, amx, outs), sys.argv[2])
"""


def expected_isa(env: dict[str, str]) -> str:
    """The path a -march=native build of the kernel takes on this CPU under the build variables `env`."""
    flags = cpu_flags()
    if env.get(PAGED_ATTENTION_PORTABLE_ENV) == "1" or not {"avx2", "fma"} <= flags:
        return "scalar"
    return "avx512" if "avx512f" in flags and env.get(PAGED_ATTENTION_AVX2_ENV) != "1" else "avx2"


def _variant_cases() -> list[tuple]:
    """Decode and extends, alone and over a shared prefix (two whole splits), on float32, bfloat16 and float16
    pools, each also with soft-capped scores; and the kv op writing a float16 pool from strided float32
    k, v."""
    gen = torch.Generator().manual_seed(9)
    table = (torch.randperm(1299, generator=gen) + 1)[:1200].view(3, 400)
    shared = torch.cat([table[:, :100], table[:, 100:].roll(1, 0)], dim=1).repeat(1, 2)[:, :560].contiguous()
    shared[1:, :512] = shared[0, :512]  # distinct slots after 512 (a table row may repeat slots: reads only)
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = torch.randn(1300, 3, 64, generator=gen).to(dtype)
        v = torch.randn(1300, 3, 64, generator=gen).to(dtype)
        for tab, seq, ext in (
            (table, [120, 77], [4, 1]),
            (shared, [560, 530, 520], [1, 1, 1]),
            (shared, [560, 530, 520], [3, 1, 8]),
        ):
            rows = torch.tensor([2, 0, 1][: len(seq)])
            q = torch.randn(sum(ext), 9, 64, generator=gen)
            cases.append((q, k, v, tab, rows, torch.tensor(seq), torch.tensor(ext), 0.125))
            cases.append((*cases[-1], None, 2.0))
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=gen)
    q, k, v = qkv.view(5, 15, 64).split([9, 3, 3], dim=1)
    pools = (k.new_zeros(1300, 3, 64).half(), v.new_zeros(1300, 3, 64).half())
    index = (table, torch.tensor([2]), torch.tensor([120]), torch.tensor([5]), 0.125)
    cases.append((q, k, v, table[2, 115:120].clone(), *pools, *index))
    return cases


@pytest.mark.parametrize(
    "build",
    [{PAGED_ATTENTION_AVX2_ENV: "1"}, {PAGED_ATTENTION_PORTABLE_ENV: "1"}, {PAGED_ATTENTION_NO_AMX_ENV: "1"}],
    ids=["avx2", "scalar", "no-amx"],
)
def test_every_build_gives_the_same_results(build, tmp_path):
    """The AVX2 build (forced past AVX-512), the scalar loops and the AVX-512 loops without AMX tiles
    (another process: one library per op) give this process's native build's answers up to float32
    summation order (AMX: bfloat16 caches' products carry ~16 bits, see paged_attention.cpp), and write the
    same pool bits."""
    assert paged_attention_isa() == expected_isa(
        dict(os.environ)
    )  # this process: the suite may force a build
    cases = _variant_cases()
    torch.save(cases, tmp_path / "args.pt")
    env = {
        **os.environ,
        PAGED_ATTENTION_PORTABLE_ENV: "0",
        PAGED_ATTENTION_AVX2_ENV: "0",
        PAGED_ATTENTION_NO_AMX_ENV: "0",
        **build,
    }
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run(
        [sys.executable, "-c", _VARIANT_RUN, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        timeout=300,
    )
    isa, amx, outs = torch.load(tmp_path / "out.pt")
    assert isa == expected_isa(build) and not amx  # every variant here is one without tiles
    for args, got in zip(cases, outs, strict=True):
        if args[3].dim() == 2:
            torch.testing.assert_close(torch.ops.radixlm.paged_attention(*args), got, atol=1e-5, rtol=1e-5)
        else:
            out, k_pool, v_pool = got
            torch.testing.assert_close(torch.ops.radixlm.paged_attention_kv(*args), out, atol=1e-5, rtol=1e-5)
            assert torch.equal(args[4], k_pool) and torch.equal(args[5], v_pool)


def test_bfloat16_caches_take_the_amx_tiles_where_the_cpu_has_them():
    """Where the CPU has AMX-BF16 (and no build variable turns it off) a bfloat16 cache is attended with
    tiles: the server's default KV dtype there (`auto_kv_cache_dtype`), so the tests above run that path."""
    if not cpu_has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16")
    forced_off = any(
        os.environ.get(env) == "1"
        for env in (PAGED_ATTENTION_NO_AMX_ENV, PAGED_ATTENTION_AVX2_ENV, PAGED_ATTENTION_PORTABLE_ENV)
    )
    assert paged_attention_uses_amx() == (not forced_off)


def test_auto_is_cpu_on_the_cpu_and_cpu_is_refused_elsewhere(make_case):
    assert resolve_backend_name("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_backend_name("cpu", "cuda")
    case = make_case([4], None)
    assert isinstance(create_backend("cpu", case.kv_pool, case.req_pool), CpuPagedBackend)


def _qkv_views(case, dtype):
    """q, k, v as Attention.forward hands them over: strided views of one [T, (H + 2 Hkv) * D] projection."""
    t, h, d = case.q.shape
    hkv = case.k_new.shape[1]
    parts = [case.q.float(), case.k_new.float(), case.v_new.float()]
    qkv = torch.cat([p.reshape(t, -1) for p in parts], dim=1).to(dtype)
    return qkv.view(t, h + 2 * hkv, d).split([h, hkv, hkv], dim=1)


@pytest.mark.parametrize(
    "pool_dtype,qkv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),  # --kv-cache-dtype float16 under a float32 model: cast on write
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 5, 130], None),  # decode
        ([40, 3, 0], [7, 1, 12]),  # short extends: new tokens attend to each other (written first)
        ([10], [FUSED_MAX_EXTEND + 1]),  # a long extend: pool write, then the SDPA path
        ([10, 200, 50], [FUSED_MAX_EXTEND + 1, 1, 4]),  # ... with short requests beside it (the op's)
    ],
)
def test_forward_writes_the_new_kv_then_attends(
    pool_dtype, qkv_dtype, prefix_lens, extend_lens, make_case, run_backend
):
    """`forward` with q, k, v as strided views: the pool afterwards equals KVPool.write's (the same casts,
    bit for bit), and the output equals attention over that pool."""
    case = make_case(prefix_lens, extend_lens, num_kv_heads=3, group=3, seed=7)
    q, k, v = _qkv_views(case, qkv_dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    loc = case.batch.out_cache_loc
    pool = case.pool_copy(pool_dtype)
    pool.k[0][loc] = 0  # only the op's own write makes the result right
    pool.v[0][loc] = 0
    backend = CpuPagedBackend(pool, case.req_pool)
    backend.init_forward_metadata(case.batch)
    out = backend.forward(q, k, v, case.layer, case.batch)

    want_pool = case.pool_copy(pool_dtype)
    want_pool.write(0, loc, k, v)
    assert torch.equal(pool.k[0], want_pool.k[0]) and torch.equal(pool.v[0], want_pool.v[0])
    assert out.dtype == qkv_dtype and out.shape == q.shape and out.is_contiguous()
    ref_case = copy.copy(case)
    ref_case.q = q.contiguous()
    expected = run_backend(CpuPagedBackend(want_pool, case.req_pool), ref_case)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same kernel over the same pool
    oracle = TorchNativeBackend(case.pool_copy(torch.float32), case.req_pool)
    for buf, src in ((oracle.kv_pool.k[0], want_pool.k[0]), (oracle.kv_pool.v[0], want_pool.v[0])):
        buf.copy_(src.float())
    ref_case.q = q.float()
    torch.testing.assert_close(out.float(), run_backend(oracle, ref_case), **TOL[qkv_dtype])


def _kv_args(**over):
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    args = dict(
        q=q,
        k=k,
        v=v,
        loc=torch.tensor([3, 4]),
        k_cache=torch.zeros(10, 2, 64),
        v_cache=torch.zeros(10, 2, 64),
        table=torch.arange(16).view(2, 8),
        rows=torch.tensor([0]),
        seq_lens=torch.tensor([5]),
        ext_lens=torch.tensor([2]),
    )
    args.update(over)
    return list(args.values()) + [0.125]


@pytest.mark.parametrize(
    "over,message",
    [
        (dict(k=torch.randn(2, 1, 64)), "k and v must be \\[T, Hkv, D\\].*got sizes \\[2, 1, 64\\]"),
        (
            dict(v=torch.randn(2, 64, 2).transpose(1, 2)),
            "contiguous last dim; got sizes.*strides \\[128, 1, 2\\]",
        ),
        (dict(q=torch.randn(2, 64, 4).transpose(1, 2)), "q must be \\[T, H, D\\] with a contiguous last dim"),
        (
            dict(loc=torch.tensor([3, 4], dtype=torch.int32)),
            "out_cache_loc must be a contiguous int64 \\[T\\]",
        ),
        (dict(loc=torch.tensor([3])), "out_cache_loc must be a contiguous int64 \\[T\\]"),
        (dict(loc=torch.tensor([3, 10])), "out_cache_loc\\[1\\] = 10 is outside the KV pool's 10 slots"),
        (dict(loc=torch.tensor([-1, 4])), "out_cache_loc\\[0\\] = -1 is outside"),
        (dict(ext_lens=torch.tensor([3])), "sum\\(ext_lens\\) must equal q.size\\(0\\)"),
        (dict(k=torch.randn(2, 2, 64).double()), "k and v must be float32, bfloat16 or float16"),
    ],
)
def test_bad_kv_write_inputs_are_errors_and_write_nothing(over, message):
    args = _kv_args(**over)
    k_cache, v_cache = args[4], args[5]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.radixlm.paged_attention_kv(*args)
    assert not k_cache.any() and not v_cache.any()  # every check comes before the first write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_op", [False, True], ids=["attend", "write_then_attend"])
def test_sinks_join_the_softmax_denominator(dtype, kv_op):
    """gpt-oss's sinks (a logit per query head with no value): every output row equals the float64 softmax
    over the row's keys plus the sink column, for requests of one split (decode and a short extend) and of
    several (merged by log-sum-exp), sinks far below, near and far above the scores; unlike the output
    without them."""
    gen = torch.Generator().manual_seed(17)
    seq, ext = [9, 300, 700, 40], [1, 3, 1, 4]
    rows = torch.tensor([3, 0, 4, 1])
    k, v, table = _scattered_batch(gen, seq, rows, 5, dtype)
    q = torch.randn(sum(ext), 9, 64, generator=gen).to(dtype)
    sinks = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 3.0, 8.0, 40.0, -0.3])
    args = (q, k, v, table, rows, torch.tensor(seq), torch.tensor(ext), 0.125)
    if kv_op:  # the new tokens' K/V written first (the rows already there), then the same attention
        loc = torch.cat([table[rows[b], seq[b] - ext[b] : seq[b]] for b in range(len(seq))])
        new_k, new_v = k[loc].clone(), v[loc].clone()
        out = torch.ops.radixlm.paged_attention_kv(q, new_k, new_v, loc, k, v, *args[3:], sinks)
    else:
        out = torch.ops.radixlm.paged_attention(*args, sinks)
    plain = torch.ops.radixlm.paged_attention(*args)
    want = _softmax_oracle(q, k, v, table, rows, seq, ext, 0.125, sinks)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    assert not torch.allclose(out, plain)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
        torch.ops.radixlm.paged_attention(*args, sinks[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_op", [False, True], ids=["attend", "write_then_attend"])
def test_softcap_bends_every_score_before_the_softmax(dtype, kv_op):
    """Gemma 2's attention soft-capping: every output row equals the float64 softmax of cap * tanh(s / cap)
    over the row's scaled scores, for requests of one split and of several (merged by log-sum-exp), with
    sinks beside it too; unlike the output without it. A negative cap is an error naming it."""
    gen = torch.Generator().manual_seed(19)
    seq, ext = [9, 300, 700, 40], [1, 3, 1, 4]
    rows = torch.tensor([3, 0, 4, 1])
    k, v, table = _scattered_batch(gen, seq, rows, 5, dtype)
    q = (torch.randn(sum(ext), 9, 64, generator=gen) * 3).to(dtype)  # scores ~ N(0, 9): tanh bends them
    args = (q, k, v, table, rows, torch.tensor(seq), torch.tensor(ext), 0.125)
    sinks = torch.linspace(-2.0, 4.0, 9)
    for cap, sink in ((2.5, None), (50.0, None), (2.5, sinks)):
        if kv_op:
            loc = torch.cat([table[rows[b], seq[b] - ext[b] : seq[b]] for b in range(len(seq))])
            new_k, new_v = k[loc].clone(), v[loc].clone()
            out = torch.ops.radixlm.paged_attention_kv(q, new_k, new_v, loc, k, v, *args[3:], sink, cap)
        else:
            out = torch.ops.radixlm.paged_attention(*args, sink, cap)
        want = _softmax_oracle(q, k, v, table, rows, seq, ext, 0.125, sink, cap)
        torch.testing.assert_close(out.double(), want, **TOL[dtype])
        if cap < 10:
            assert not torch.allclose(out, torch.ops.radixlm.paged_attention(*args, sink))
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        torch.ops.radixlm.paged_attention(*args, None, -1.0)


def test_short_requests_beside_a_long_extend_take_the_op(make_case, run_backend, reference, monkeypatch):
    """A batch with one long extend (torch_native's path) and requests of a few tokens beside it, as decoding
    requests riding along with a prefill are: torch_native computes the long request alone and the op the
    others, and together they match the reference."""
    case = make_case([30, 300, 7], [FUSED_MAX_EXTEND + 5, 1, 3], num_kv_heads=3, group=3, seed=11)
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    computed = []
    plain = backend._extend_plain

    def spy(q, layer, batch, skip=frozenset()):
        computed.append(sorted(set(range(3)) - skip))
        return plain(q, layer, batch, skip)

    monkeypatch.setattr(backend, "_extend_plain", spy)
    out = run_backend(backend, case)
    assert computed and all(c == [0] for c in computed)  # torch_native: the long request only
    torch.testing.assert_close(out.float(), reference(case), **TOL[torch.float32])
