"""Sliding-window layers in their own KV pool (runtime.mem_cache.memory_pool's sliding pool): the slot
allocator's pairing of full slots and sliding rows and its leak check, the radix cache's per-node sliding
counts and `evict_sliding` (nodes kept), the match cut-back rule (`sliding_usable_len`), and through the
scheduler on the tiny random Gemma 3 and gpt-oss (window 8): a prompt longer than the window, cached and
extended, gives what a fresh run and transformers give; a match whose windows lost their sliding K/V is cut
back and still exact; a long generation holds a bounded number of sliding rows; every slot and row comes
back."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.managers.scheduler.cache_manager import DECODE_RUN, sliding_usable_len
from runtime.mem_cache.memory_pool import KVPool, SlidingSlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from tests.random_dense import GEMMA3_WINDOW, save_random_dense
from tests.random_gpt_oss import WINDOW as GPT_OSS_WINDOW
from tests.random_gpt_oss import save_random_gpt_oss
from tests.scheduler_utils import make_scheduler
from tests.unit.test_model_parity import hf_greedy
from tests.unit.test_scheduler import assert_all_free, run


def usable_by_scan(held: list[bool], window: int) -> int:
    """The rule read literally: the longest m whose previous window - 1 tokens all hold sliding K/V."""
    return max(m for m in range(len(held) + 1) if all(held[max(0, m - window + 1) : m]))


@pytest.mark.parametrize("seed", range(40))
def test_usable_len_is_the_longest_end_with_its_window_held(seed):
    rng = random.Random(seed)
    window = rng.choice([1, 2, 4, 8])
    n = rng.randrange(0, 40)
    held = [rng.random() < rng.choice([0.5, 0.9, 1.0]) for _ in range(n)]
    assert sliding_usable_len(torch.tensor(held, dtype=torch.bool), window) == usable_by_scan(held, window)


def test_usable_len_examples():
    t = lambda s: torch.tensor([c == "1" for c in s], dtype=torch.bool)  # noqa: E731
    assert sliding_usable_len(t("1111111111"), 4) == 10
    assert sliding_usable_len(t("0000000111"), 4) == 10  # the last 3 tokens: the window before the end
    assert sliding_usable_len(t("0000000011"), 4) == 0  # cut back to nothing (m = 0 needs no window)
    assert sliding_usable_len(t("1111101100"), 4) == 5  # past the gap no end has 3 held before it
    assert sliding_usable_len(t(""), 4) == 0


def make_allocator(size: int = 16, rows: int = 6) -> tuple[SlidingSlotAllocator, KVPool]:
    pool = KVPool(size, 3, 1, 2, torch.float32, sliding_layers=[0, 2], sliding_size=rows)
    return SlidingSlotAllocator(size, rows, pool.full_to_sliding), pool


def test_pool_shapes_and_translate():
    alloc, pool = make_allocator()
    assert [t.shape[0] for t in pool.k] == [7, 17, 7]  # rows + the dummy row 0
    slots = alloc.alloc(4)
    rows = pool.translate(0, slots)
    assert pool.translate(1, slots) is slots and rows.tolist() == pool.full_to_sliding[slots].tolist()
    assert sorted(rows.tolist()) == sorted(set(rows.tolist())) and 0 not in rows.tolist()
    k = torch.arange(8, dtype=torch.float32).view(4, 1, 2)
    pool.write(0, slots, k, -k)
    assert torch.equal(pool.k[0][rows], k) and torch.equal(pool.v[0][rows], -k)
    pool.write(1, slots, k, k)
    assert torch.equal(pool.k[1][slots], k)


def test_allocator_pairs_and_frees_rows():
    alloc, _ = make_allocator(size=16, rows=6)
    a = alloc.alloc(4)
    assert alloc.available() == 12 and alloc.sliding_available() == 2
    assert alloc.alloc(3) is None  # full slots are free, sliding rows are not
    assert alloc.free_sliding(a[:2]) == 2 and alloc.sliding_available() == 4
    assert alloc.free_sliding(a[:2]) == 0  # already gone: nothing twice
    assert alloc.sliding_held(a).tolist() == [False, False, True, True]
    b = alloc.alloc(4)
    alloc.check()
    alloc.free(a)  # frees the two rows it still held
    alloc.free(b)
    assert alloc.available() == 16 and alloc.sliding_available() == 6
    alloc.check()


def test_allocator_check_finds_a_lost_and_a_stale_row():
    alloc, _ = make_allocator()
    a = alloc.alloc(2)
    alloc.full_to_sliding[a[0]] = 0  # the row is neither mapped nor free: lost
    with pytest.raises(AssertionError, match="sliding KV accounting broken"):
        alloc.check()
    alloc, _ = make_allocator()
    a = alloc.alloc(2)
    free_slot = alloc.free_slots()[0]
    alloc.full_to_sliding[free_slot] = alloc.full_to_sliding[a[0]]  # the row moved to a free full slot
    alloc.full_to_sliding[a[0]] = 0
    with pytest.raises(AssertionError, match="free full slot"):
        alloc.check()


def test_radix_cache_counts_sliding_tokens_and_evicts_them_keeping_nodes():
    alloc, _ = make_allocator(size=32, rows=32)
    cache = RadixCache()
    cache.sliding_held = alloc.sliding_held
    a = alloc.alloc(8)
    alloc.free_sliding(a[:3])  # a finished request had freed its oldest rows
    assert cache.insert(list(range(8)), a) == 0
    assert cache.sliding_evictable_size() == 5
    b = alloc.alloc(3)
    cache.insert([0, 1, 2, 3, 9, 9, 9], torch.cat([a[:4], b]))  # splits at 4: 1 held above, 4 below
    cache.check_integrity()
    assert cache.sliding_evictable_size() == 8
    node = cache.match_prefix([0, 1, 2, 3, 9, 9, 9]).last_node
    cache.lock(node)
    assert (cache.sliding_evictable_size(), cache.sliding_protected_size()) == (4, 4)
    dropped = cache.evict_sliding(100)  # only the unlocked branch [4..8)
    assert alloc.free_sliding(dropped) == 4
    cache.check_integrity()
    assert cache.total_size() == 11 and cache.sliding_evictable_size() == 0  # nodes kept
    cache.unlock(node)
    assert cache.sliding_evictable_size() == 4
    alloc.free(cache.evict(100))
    cache.check_integrity()
    assert alloc.available() == 32 and alloc.sliding_available() == 32
    alloc.check()


# ---- through the scheduler --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def model(request, tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return str(path), save_random_dense(path, "gemma3", default_tokenizer), GEMMA3_WINDOW
    return str(path), save_random_gpt_oss(path), GPT_OSS_WINDOW


POOL = dict(max_total_tokens=2048, max_running_requests=4, chunked_prefill_size=16)


def sliding_scheduler(path: str, tokenizer, **kw):
    sched = make_scheduler(path, tokenizer, **{**POOL, **kw})
    cm = sched.cm
    assert cm.sliding is not None and cm.window > 0, "the sliding pool is on"
    assert cm.sliding.sliding.size < cm.allocator.size, "and smaller than the full pool"
    return sched


@pytest.mark.slow  # whole models through the scheduler (the full suite)
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_prefix_longer_than_window_reused_exactly(model, default_tokenizer, backend):
    """A prompt of several windows is served (its chunks free the rows behind their windows) and cached;
    the same prompt extended reuses all of it (the rows of its last window are held) and equals a fresh
    run with one pool and transformers' greedy continuation."""
    path, hf, window = model
    if backend == "cpu":
        from runtime.models.native_kernels import PAGED_ATTENTION
        from tests.kernels.native import load_native_or_skip

        load_native_or_skip(PAGED_ATTENTION)
    rng = random.Random(3)
    first = [rng.randrange(3, 512) for _ in range(5 * window + 3)]
    extended = first + [rng.randrange(3, 512) for _ in range(window + 5)]
    warm = sliding_scheduler(path, default_tokenizer, attention_backend=backend)
    run(warm, [first], max_new=4)
    held = warm.cm.sliding.sliding_held(warm.cm.cache.match_prefix(first).indices)
    assert not bool(held[: 2 * window].all()), "the prompt's old rows were freed"
    reused = run(warm, [extended], max_new=8)
    assert reused["stats"]["cached_tokens"] >= len(first)
    kw = dict(attention_backend=backend, disable_sliding_window_pool=True)
    one_pool = make_scheduler(path, default_tokenizer, **{**POOL, **kw})
    assert one_pool.cm.sliding is None
    fresh = run(one_pool, [extended], max_new=8)
    assert reused["outs"]["r0"] == fresh["outs"]["r0"] == hf_greedy(hf, extended, 8)
    assert_all_free(warm)


@pytest.mark.slow  # whole models through the scheduler (the full suite)
def test_match_cut_back_where_the_window_is_gone(model, default_tokenizer):
    """The cache drops every node's sliding K/V (the nodes stay): the same prefix then matches its full
    length in the tree but is usable only to 0, and the extended prompt, recomputed, is still exact. A
    match cut back inside the prefix is recomputed from there, exact too."""
    path, hf, window = model
    rng = random.Random(4)
    first = [rng.randrange(3, 512) for _ in range(4 * window)]
    extended = first + [rng.randrange(3, 512) for _ in range(5)]
    sched = sliding_scheduler(path, default_tokenizer)
    run(sched, [first], max_new=3)
    cm = sched.cm
    cached = cm.cache.total_size()
    cm.sliding.free_sliding(cm.cache.evict_sliding(cached))
    sched.check_accounting()
    assert cm.cache.total_size() == cached and cm.cache.sliding_evictable_size() == 0
    assert cm.cache.prefix_len(extended) >= len(first)
    res = run(sched, [extended], max_new=6)
    assert res["stats"]["cached_tokens"] == 0
    assert res["outs"]["r0"] == hf_greedy(hf, extended, 6)
    # now the tree holds `extended` with the rows of its last window; a prompt branching off before that
    # window has no usable window at its branch point and is cut back further than its tree match
    branch = extended[: 2 * window] + [rng.randrange(3, 512) for _ in range(window)]
    req = GenerateReq(rid="probe", input_ids=branch, params=SamplingParams(max_new_tokens=1))
    tree_len = cm.cache.prefix_len(branch)
    assert tree_len >= 2 * window
    sched.handle(req)
    probe = next(r for r in sched.waiting if r.rid == "probe")
    used = cm.match(probe)
    held = cm.sliding.sliding_held(cm.cache.match_prefix(branch).indices)
    assert used == sliding_usable_len(held, window) < tree_len
    sched.abort("probe")
    out = run(sched, [branch], max_new=4)
    assert out["outs"]["r0"] == hf_greedy(hf, branch, 4)
    assert_all_free(sched)


@pytest.mark.slow  # whole models through the scheduler (the full suite)
def test_long_generation_holds_a_bounded_number_of_rows(model, default_tokenizer):
    """Three requests generate 150 tokens each: the full pool's used slots grow with every token, the
    sliding rows in use stay within each request's window and decode run (plus the cached prompts), and
    every step passes the accounting checks of both pools."""
    path, hf, window = model
    sched = sliding_scheduler(path, default_tokenizer)
    rng = random.Random(5)
    reqs = [[rng.randrange(3, 512) for _ in range(6)] for _ in range(3)]
    for i, p in enumerate(reqs):
        sched.handle(
            GenerateReq(
                rid=f"r{i}",
                input_ids=p,
                params=SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True),
            )
        )
    cm = sched.cm
    rows, full = cm.sliding.sliding, cm.allocator
    most_rows = most_full = 0
    outs: dict[str, list[int]] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
        sched.check_accounting()
        most_rows = max(most_rows, rows.size - rows.available())
        most_full = max(most_full, full.size - full.available())
    bound = 3 * (window + DECODE_RUN + 1) + sum(map(len, reqs))
    assert most_rows <= bound < most_full // 2, (most_rows, bound, most_full)
    assert outs["r1"] == hf_greedy(hf, reqs[1], 150)
    assert_all_free(sched)


@pytest.mark.slow  # whole models through the scheduler (the full suite)
def test_speculative_verify_rolls_back_within_the_window(model, default_tokenizer):
    """Prompt-lookup drafts over a prompt that repeats itself (several windows long): verify steps append
    drafts and roll rejected ones back, the rows behind the window freed meanwhile; the outputs equal
    transformers' greedy ones and every slot and row comes back."""
    path, hf, window = model
    rng = random.Random(6)
    motif = [rng.randrange(3, 512) for _ in range(window + 3)]
    reqs = [motif * 3 + motif[:4], [rng.randrange(3, 512) for _ in range(2 * window)] + motif * 2]
    sched = sliding_scheduler(path, default_tokenizer, speculative_algorithm="ngram")
    res = run(sched, reqs, max_new=40)
    assert res["stats"]["spec_verify_steps"] > 0
    for i, p in enumerate(reqs):
        assert res["outs"][f"r{i}"] == hf_greedy(hf, p, 40), f"request {i}"
    assert_all_free(sched)


@pytest.mark.slow  # whole models through the scheduler (the full suite)
def test_short_sliding_pool_evicts_cached_rows_and_stays_exact(model, default_tokenizer):
    """A sliding pool of 120 rows under a 2048-slot full pool: the cache's rows of finished requests must
    be dropped (`evict_sliding`, nodes kept) for later requests to run, admission never overdraws the rows,
    and every output is still transformers' greedy one."""
    from runtime.managers.scheduler.scheduler import Scheduler
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.server_args import ServerArgs

    path, hf, window = model
    runner = ModelRunner(
        path,
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=2,
        attention_backend="torch_native",
        sliding_pool_tokens=120,
    )
    args = ServerArgs(
        model=path,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        device="cpu",
        log_interval=0,
        attention_backend="torch_native",
        max_total_tokens=2048,
        max_running_requests=2,
        chunked_prefill_size=16,
        speculative_algorithm="none",
    )
    sched = Scheduler(args, path, runner=runner, tokenizer=default_tokenizer)
    cm = sched.cm
    assert cm.sliding.sliding.size == 120
    dropped = []
    evict_sliding = cm.cache.evict_sliding

    def spy(n):
        out = evict_sliding(n)
        dropped.append(out.numel())
        return out

    cm.cache.evict_sliding = spy
    rng = random.Random(8)
    system = [rng.randrange(3, 512) for _ in range(3 * window)]
    reqs = [system + [rng.randrange(3, 512) for _ in range(rng.randrange(8, 20))] for _ in range(12)]
    res = run(sched, reqs, max_new=10, arrive_every=3)
    assert sum(dropped) > 0, "the cache's sliding rows were dropped to make room"
    for i, p in enumerate(reqs):
        assert res["outs"][f"r{i}"] == hf_greedy(hf, p, 10), f"request {i}"
    assert_all_free(sched)


@pytest.mark.parametrize(
    ("full_bytes", "row_bytes", "fixed"),
    [(1024, 0, 0), (2048, 10240, 5000), (2048, 10240, 10**7), (0, 4096, 300), (512, 512, 0)],
)
def test_auto_total_tokens_spends_the_budget_on_both_pools(full_bytes, row_bytes, fixed):
    """Without --max-total-tokens the pool takes the most tokens whose full layers and sized sliding pool
    fit the budget: a few more would not fit."""
    from runtime.model_executor.model_runner import auto_total_tokens, sliding_pool_size

    budget = 64 << 20

    def cost(t: int) -> int:
        rows = min(t, fixed + int(0.25 * t)) if row_bytes else 0
        return t * full_bytes + rows * row_bytes

    t = auto_total_tokens(budget, full_bytes, row_bytes, fixed)
    assert cost(t) <= budget < cost(t + 4)  # (the cache share rounds: rows grow every 4 tokens)
    if row_bytes and fixed < t:  # the sizing is `sliding_pool_size`'s: max_running x (window + slack) + chunk
        assert sliding_pool_size(t, 0, 0, fixed) == min(t, fixed + int(0.25 * t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_tensors_are_zero_aligned_and_writable(dtype):
    """KVPool's tensors (lazy_zeros: anonymous pages, mapped on first write) read as zeros, start on a 64-byte
    boundary like torch's own allocations, and take writes as any tensor does; both pools' rows alike."""
    pool = KVPool(300, 3, 2, 16, dtype, sliding_layers=[1], sliding_size=40)
    assert [t.shape[0] for t in pool.k] == [301, 41, 301]
    for t in pool.k + pool.v:
        assert t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        assert not t.any()
    k = torch.randn(2, 2, 16).to(dtype)
    pool.write(0, torch.tensor([5, 7]), k, k * 2)
    assert torch.equal(pool.k[0][torch.tensor([5, 7])], k) and torch.equal(pool.v[0][7], k[1] * 2)
    assert not pool.k[0][:5].any() and not pool.k[2].any()
