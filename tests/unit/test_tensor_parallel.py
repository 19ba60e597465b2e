"""Tensor parallelism on the CPU: 2 spawned gloo ranks give the logits of one process, within fp32 round-off.

Rank 0 drives the real `ModelRunner.forward` (which broadcasts each batch) through an extend over a cached
prefix and decode steps; rank 1 runs the real worker loop (`serve_forwards`). Neither rank may unpickle
anything once loaded (the rendezvous is unauthenticated: control data are typed tensors, `batch_wire`). The
same batches run through a TP=1 runner in the test process as the reference. Two models: the shared tiny one
(4 heads / 2 KV heads, everything divides) and an uneven one (3 KV heads on 2 ranks, odd vocabulary, odd
MLP width, tied embeddings), which is how SmolLM2-135M (9 heads / 3 KV heads) splits. Also: int8, w8a8
and w4a8 shards.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.model_runner import ModelRunner
from runtime.models.parallel import HeadShard, TensorParallel, check_tp_shardable, split_range, vocab_shard
from runtime.server_args import ServerArgs
from tests.random_llama import save_random_llama

POOL = dict(max_total_tokens=256, max_running_requests=4, attention_backend="torch_native")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [12, 8, 300, 301, 2]]
PREFIX = [3, 0]  # request 0 extends over 3 cached tokens, request 1 over none
DECODE_STEPS = 3
TOL = dict(atol=1e-4, rtol=1e-4)


def _drive(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefix extend, full extend, then greedy decode steps; the logits of every forward."""
    pool, rows = runner.req_to_token_pool, [runner.req_to_token_pool.alloc() for _ in PROMPTS]
    lens = [0, 0]
    out = []

    def extend(chunks: list[list[int]]) -> torch.Tensor:
        idx = [i for i, c in enumerate(chunks) if c]
        slots = runner.allocator.alloc(sum(len(chunks[i]) for i in idx))
        off = 0
        for i in idx:
            pool.write(rows[i], lens[i], slots[off : off + len(chunks[i])])
            off += len(chunks[i])
        batch = ForwardBatch.build_extend(
            [chunks[i] for i in idx], [lens[i] for i in idx], [rows[i] for i in idx], slots
        )
        for i in idx:
            lens[i] += len(chunks[i])
        return runner.forward(batch)

    out.append(extend([p[:n] for p, n in zip(PROMPTS, PREFIX)]))
    out.append(extend([p[n:] for p, n in zip(PROMPTS, PREFIX)]))
    nxt = out[-1].argmax(-1).tolist()
    for _ in range(DECODE_STEPS):
        slots = runner.allocator.alloc(len(rows))
        for i, row in enumerate(rows):
            pool.write(row, lens[i], slots[i : i + 1])
            lens[i] += 1
        out.append(runner.forward(ForwardBatch.build_decode(nxt, list(lens), rows, slots)))
        nxt = out[-1].argmax(-1).tolist()
    return out


def _forbid_pickle() -> None:
    """Make every unpickling entry point (and torch's object collectives) raise in this rank process."""
    import pickle

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used on the tensor-parallel path")

    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (c10d, "_unpickler")]:
        setattr(mod, name, refuse)
    for name in ("broadcast_object_list", "_tensor_to_object", "_object_to_tensor"):
        setattr(c10d, name, refuse)
        if hasattr(dist, name):
            setattr(dist, name, refuse)


def _rank_main(rank: int, args: ServerArgs, model_dir: str, results, quantization: str = "none") -> None:
    try:
        from runtime.model_executor import distributed
        from runtime.model_executor.batch_wire import HEADER_LEN, MalformedMessage
        from runtime.model_executor.tp_worker import serve_forwards

        torch.set_num_threads(1)
        tp = distributed.init_tensor_parallel(args, rank)
        runner = ModelRunner(model_dir, tp=tp, quantization=quantization, **POOL)
        _forbid_pickle()  # from here on (every forward and control message) nothing may unpickle
        if rank == 0:
            # numpy, not tensors: a queued tensor is shared memory that dies with this process
            results.put(("logits", [t.numpy() for t in _drive(runner)]))
            distributed.HEARTBEAT_S = 0.0
            runner.channel.keepalive()  # a heartbeat is received and ignored
            runner.channel.send_stop()
            # then a header that is not one of ours (a stranger on the rendezvous): refused, not run
            torch.distributed.broadcast(torch.arange(HEADER_LEN), src=0, group=tp.control_group)
        else:
            channel = distributed.BatchChannel(tp)
            serve_forwards(runner, channel)  # the worker process's real loop, until STOP
            results.put(("kv_heads", runner.kv_pool.num_kv_heads))
            try:
                serve_forwards(runner, channel)
                results.put(("error", "rank 1 accepted a malformed header"))
            except MalformedMessage as e:
                results.put(("malformed", str(e)))
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def _run_tp2(model_dir: str, quantization: str = "none") -> tuple[list[torch.Tensor], int]:
    args = ServerArgs(model=model_dir, tp_size=2, device="cpu", log_level="error").resolve()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, model_dir, results, quantization)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        while len(got) < 3 and "error" not in got:  # logits, kv_heads, malformed (or the first error)
            key, value = results.get(timeout=300)
            got[key] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert "error" not in got, got["error"]
    assert got["malformed"] == "bad magic 0x0 (not a radixlm tensor-parallel message)"
    return [torch.from_numpy(a) for a in got["logits"]], got["kv_heads"]


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory, default_tokenizer) -> str:
    return save_random_llama(
        tmp_path_factory.mktemp("uneven_llama"),
        default_tokenizer,
        seed=1,
        std=0.3,
        vocab_size=509,
        hidden_size=96,
        intermediate_size=97,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def assert_tp2_equals_one_process(model_dir: str) -> int:
    """Two gloo ranks' logits over `_drive`'s forwards equal one process's (within TOL, the same greedy token
    in every row); returns rank 1's KV heads. The other architectures' tests call it on their models."""
    ref = _drive(ModelRunner(model_dir, **POOL))
    got, rank1_kv_heads = _run_tp2(model_dir)
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape, (step, a.shape, b.shape)
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, s=step: f"forward {s}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"forward {step}: greedy tokens differ"
    return rank1_kv_heads


@pytest.mark.parametrize("which", ["tiny", "uneven"])
def test_two_gloo_ranks_equal_one_process(which, tiny_model_dir, uneven_model_dir):
    model_dir = tiny_model_dir if which == "tiny" else uneven_model_dir
    torch.manual_seed(0)
    rank1_kv_heads = assert_tp2_equals_one_process(model_dir)
    assert rank1_kv_heads == 1  # its own KV heads only: 2 // 2 (tiny), the third of 3 (uneven)


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "w4a8"])
def test_quantization_of_each_rank_shard(tiny_model_dir, quantization):
    """int8 per output channel over each rank's shard: the row-parallel layers' scales cover half of the
    input features, so logits differ from TP=1 int8 by quantization noise (measured: <= 0.2 on logits
    of magnitude ~8, while int8 itself moves them up to 0.39 from fp32), never by a missing all_reduce.
    w8a8 scales each rank's activation shard on its own, and its row-parallel layers all_reduce like the
    others. w4a8's blocks of 32 run along the input dim and the shards split it at block boundaries,
    so each rank holds exactly the TP=1 blocks (and quantizes its activations into the same blocks)."""
    ref = _drive(ModelRunner(tiny_model_dir, quantization=quantization, **POOL))
    got, _ = _run_tp2(tiny_model_dir, quantization)
    # w8a8's per-call activation ranges differ between a shard and the whole row: noise up to 0.53 measured
    tol = 0.1 if quantization == "w8a8" else 0.05
    for step, (a, b) in enumerate(zip(got, ref)):
        assert (a - b).abs().max() < tol * b.abs().max(), f"forward {step}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"forward {step}: greedy tokens differ"


def test_shard_ranges():
    assert [split_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [split_range(1536, 2, r) for r in range(2)] == [(0, 768), (768, 1536)]
    assert [split_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # SmolLM2-135M: 9 query heads in 3 GQA groups; rank 0 takes 2 groups, rank 1 one
    s0, s1 = (HeadShard.of(9, 3, _FakeTP(r, 2)) for r in range(2))
    assert (s0.q_start, s0.q_stop, s0.kv_start, s0.kv_stop) == (0, 6, 0, 2)
    assert (s1.q_start, s1.q_stop, s1.kv_start, s1.kv_stop) == (6, 9, 2, 3)
    assert [vocab_shard(509, _FakeTP(r, 2)) for r in range(2)] == [(0, 255, 255), (255, 509, 255)]
    assert vocab_shard(5, _FakeTP(3, 4)) == (5, 5, 2)  # a rank past the end holds padding only


class _FakeTP(TensorParallel):
    def __init__(self, rank: int, size: int):
        super().__init__(rank, size, group=object())


def test_bad_tp_sizes_are_clear_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="--tp-size 4 cannot shard this model: its 3 KV heads"):
        check_tp_shardable(9, 3, 4)
    with pytest.raises(ValueError, match="--tp-size must be >= 1, got 0"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="--tp-size 3 must be a multiple of --nnodes 2"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="tcp://10.0.0.1:29500")
    with pytest.raises(ValueError, match="--nnodes > 1 needs --dist-init-addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank must be in 0..1"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="tcp://10.0.0.1:29500")
    for bad in ("10.0.0.1:29500", "tcp://10.0.0.1", "tcp://:29500", "tcp://h:99999"):
        with pytest.raises(ValueError, match="--dist-init-addr"):
            ServerArgs(tp_size=2, dist_init_addr=bad)
    # the tiny model has 2 KV heads: a third rank would have none (refused before any rank starts)
    with pytest.raises(ValueError, match="--tp-size 3 cannot shard this model: its 2 KV heads"):
        ModelRunner(tiny_model_dir, tp=_FakeTP(0, 3), **POOL)
    with pytest.raises(ValueError, match="--quantization gguf cannot be sharded over --tp-size 2"):
        from runtime.models.quantized_linear import quantize_model

        class _M:  # quantize_model refuses before touching any layer
            tp = _FakeTP(0, 2)
            embed_tokens = torch.nn.Embedding(2, 2)

        quantize_model(_M(), "gguf", tiny_model_dir)


def test_resolve_spreads_threads_and_picks_a_rendezvous():
    a = ServerArgs(tp_size=2, device="cpu").resolve()
    assert a.dist_init_addr.startswith("tcp://127.0.0.1:")
    assert a.resolve().dist_init_addr == a.dist_init_addr  # resolved once
    assert a.num_threads == max(1, ServerArgs(device="cpu").resolve().num_threads // 2)
    b = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="tcp://10.0.0.1:29500")
    assert list(b.tp_ranks_here) == [2, 3]
