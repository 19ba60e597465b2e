"""`--enable-torch-compile`: the decode forward compiled by inductor, one graph per batch-size bucket.

Inductor fuses the elementwise work (RMSNorm, rope, SiLU, residuals) into C++ loops and drops per-op
dispatch. It pays where the matmuls are cheap: with `--quantization w8a8` half of an eager bs-1 step was
elementwise ops and dispatch, and compiled bs-1 decode goes from ~45-50 to ~70-90 tok/s (2 threads, 2-core
EPYC, SmolLM2-135M; `python -m bench.decode_throughput --sides radixlm,llamacpp --batch-sizes 1
--quantization w8a8 --enable-torch-compile`). In fp32 (~84% of a step is aten::mm) it gains nothing (bs 1
14.4 tok/s compiled vs 14.3 eager, 1 thread). Compile time ~55 s per bucket, so it stays opt-in (SGLang's
flag). Live batches are padded to the next bucket with the CUDA-graph runner's padding
(`fill_padded_decode_batch`: dummy rows read `req_to_token[pad_row, 0]` and write the dummy KV slot 0), so
each bucket compiles once. Inside a bucket the batch size is static and the KV length is a dynamic
dimension (`mark_dynamic`), so a growing context does not recompile (check with TORCH_LOGS=recompiles).

Attention inside the graph gathers each row's KV from the paged pool with one index_select over a flat
slot list, exactly as the torch_native backend's decode does, and masks the padding with a [bs, 1, 1, L]
boolean mask; the KV write is an index_copy_ into the pool, which inductor keeps in place.

Inductor's cache (compiled .so files it loads back) goes to $RADIXLM_CACHE_DIR/inductor, a 0700 directory,
instead of its default /tmp/torchinductor_<user>, unless the user set TORCHINDUCTOR_CACHE_DIR.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from radixlm_kernels.base import AttentionBackend, AttentionLayer
from runtime.cache_dir import use_private_inductor_cache
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
from runtime.model_executor.cuda_graph_runner import fill_padded_decode_batch, padded_batch_size
from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from runtime.platform import find_cxx_compiler

logger = logging.getLogger("radixlm.compiled_decode")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _PagedDecodeAttention(AttentionBackend):
    """Decode attention whose per-batch metadata are tensors only (no Python ints baked into the graph)."""

    name = "torch_native_compiled"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.is_decode:
            raise ValueError("the compiled decode runner only runs decode batches")
        max_len = max(batch.seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices, :max_len]  # [bs, L]
        valid = torch.arange(max_len, device=rows.device)[None, :] < batch.seq_lens[:, None]
        self.slots = torch.where(valid, rows, torch.zeros_like(rows))  # slot 0 = dummy
        self.mask = valid[:, None, None, :]  # [bs, 1, 1, L]
        torch._dynamo.mark_dynamic(self.slots, 1)
        torch._dynamo.mark_dynamic(self.mask, 3)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        raise ValueError("the compiled decode runner only runs decode batches")

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        bs = q.shape[0]
        shape = (bs, -1, layer.num_kv_heads, layer.head_dim)
        flat = self.slots.flatten()
        k = self.kv_pool.k[layer.layer_id].index_select(0, flat).view(shape).to(q.dtype)
        v = self.kv_pool.v[layer.layer_id].index_select(0, flat).view(shape).to(q.dtype)
        if bs == 1:
            return _one_row_attention(q, k, v, layer.scaling)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [bs, H, 1, D]
            k.transpose(1, 2),  # [bs, Hkv, L, D]
            v.transpose(1, 2),
            # One row has no padding to mask; unmasked SDPA is ~8x cheaper there (0.06 vs 0.5 ms per layer).
            attn_mask=None if bs == 1 else self.mask,
            scale=layer.scaling,
            enable_gqa=True,
        )
        return o.squeeze(2)  # [bs, H, D]


_copies = itertools.count()


def _own_code_copy(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own (and so an empty dynamo cache)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _one_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's decode attention as two bmm calls with an fp32 softmax that inductor fuses in between.

    q [1, H, D]; k, v [1, L, Hkv, D] -> [1, H, D]. Query heads sharing a KV head are rows of one bmm, so K/V
    are not repeated. SDPA's flash kernel costs ~50 us per layer here for a single query row (set-up, not
    arithmetic: L ~100); this is a fraction of it. Plain 3-D bmm, not matmul: inductor's matmul
    decomposition failed on the broadcast with the dynamic KV length (torch 2.13). It is the one-row case
    of `radixlm_kernels.torch_native.decode_attention_matmul`, kept apart because that eager kernel's 4-D
    matmul is 3x faster than a bmm form at batch 32 (bit-identical outputs; measured 1.15 vs 3.8 ms bf16,
    1 thread).
    """
    _, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(hkv, h // hkv, d)  # [Hkv, G, D]
    kt = k[0].permute(1, 2, 0)  # [Hkv, D, L]
    scores = torch.bmm(qg, kt).float() * scale
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, v[0].transpose(0, 1)).reshape(1, h, d)  # [Hkv, G, D] -> [1, H, D]


class CompiledDecodeRunner:
    """Runs decode batches of up to max(batch_sizes) rows through an inductor-compiled model forward.

    `model(batch, backend)` is the eager model (LlamaForCausalLM); the KV pool and req_to_token are
    shared with the eager path, which keeps serving extend batches and decode batches above the largest
    bucket. Compilation of every bucket happens in the constructor, timed and logged.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        batch_sizes: Sequence[int] = DEFAULT_BUCKETS,
        *,
        pad_req_pool_index: int = 0,
        pad_slot: int = 0,
    ):
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive, got {list(batch_sizes)}")
        if find_cxx_compiler() is None:
            raise RuntimeError("torch.compile on CPU needs a C++ compiler (g++ or clang++; none on PATH)")
        use_private_inductor_cache()  # inductor loads the .so files it caches: not from a shared /tmp
        self.model = model
        self.batch_sizes = sizes
        self.max_bs = sizes[-1]
        self.pad_req_pool_index = pad_req_pool_index
        self.pad_slot = pad_slot
        self.attn = _PagedDecodeAttention(kv_pool, req_to_token_pool)
        device = kv_pool.k[0].device
        i64 = dict(dtype=torch.int64, device=device)
        self._static: dict[int, ForwardBatch] = {}
        buffers = [torch.zeros(self.max_bs, **i64) for _ in range(5)]  # shared by every bucket
        for bs in sizes:
            ids, pos, rows, seq, loc = (b[:bs] for b in buffers)
            self._static[bs] = ForwardBatch(ForwardMode.DECODE, ids, pos, rows, seq, loc, [1] * bs)
        # dynamic=False: shapes are static except the dims marked dynamic (the KV length).
        # Guards on the model's modules are skipped: checking them cost ~0.6 ms per bs-1 step (~5%), and
        # the model is frozen once loaded and quantized. That is only sound while this runner's graphs can
        # never serve another model: dynamo keeps one cache per code object, so each runner compiles its
        # own copy of `_forward` (without it, a second model in the process reused the first one's graph).
        forward = types.MethodType(_own_code_copy(CompiledDecodeRunner._forward), self)
        self._compiled = torch.compile(
            forward,
            dynamic=False,
            options={
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                # The graph's kernels are called from generated C++ rather than Python: bs-1 w8a8 step
                # 11.5 -> 11.0 ms best, 15.0 -> 13.5 ms median (two A/B runs in one process, 2 threads).
                "cpp_wrapper": True,
            },
        )
        self.compile_seconds = self._compile_all()

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        # The model's forward runs under @torch.inference_mode(), which inductor rejects for graphs that
        # mutate a normal tensor (the KV pool): "Cannot set version_counter for inference tensor" (torch
        # 2.13). The undecorated function runs here under no_grad instead (see `run`).
        return type(self.model).forward.__wrapped__(self.model, batch, self.attn)

    def _compile_all(self) -> float:
        t0 = time.perf_counter()
        for bs in self.batch_sizes:
            # Two rows of 2 KV tokens (length 1 would be specialised as a constant); writes go to pad_slot.
            dummy = ForwardBatch.build_decode(
                [0] * bs,
                [2] * bs,
                [self.pad_req_pool_index] * bs,
                torch.full((bs,), self.pad_slot, dtype=torch.int64),
                device=self.attn.kv_pool.k[0].device,
            )
            self.run(dummy)
        return time.perf_counter() - t0

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and 0 < batch.batch_size <= self.max_bs and max(batch.seq_lens_cpu) >= 2

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [bs, vocab] of a decode batch."""
        if not self.can_run(batch):
            raise ValueError(f"cannot run a {batch.mode.value} batch of size {batch.batch_size} compiled")
        bs = batch.batch_size
        padded = padded_batch_size(bs, self.batch_sizes)
        assert padded is not None
        static = self._static[padded]
        with torch.no_grad():
            fill_padded_decode_batch(static, batch, padded, self.pad_req_pool_index, self.pad_slot)
            self.attn.init_forward_metadata(static)
            logits = self._compiled(static)
        return logits[:bs]
