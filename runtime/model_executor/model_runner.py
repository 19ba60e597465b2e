"""The model worker: weights, KV memory and attention backend; runs a `ForwardBatch`, returns logits.

With tensor parallelism one runner lives in each rank's process, holding that rank's shard of the weights
and a KV pool of its own KV heads only; rank 0's `forward` first sends the batch to the others
(`runtime.model_executor.distributed`), whose worker loop calls `forward_local` with it.
"""

from __future__ import annotations

import logging
import time

import torch

from radixlm_kernels import create_backend, resolve_backend_name
from runtime import allocator
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlidingSlotAllocator, SlotAllocator
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.models.frozen_modules import freeze_attributes
from runtime.models.model_config import ModelConfig
from runtime.models.parallel import HeadShard, TensorParallel
from runtime.models.registry import model_class_for
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.model_runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without an explicit --max-total-tokens the KV pool takes this share of free host/GPU memory.
KV_MEMORY_FRACTION = 0.25
MAX_AUTO_TOTAL_TOKENS = 1 << 20


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        kv_cache_dtype: str | None = None,
        device: str = "cpu",
        max_total_tokens: int | None = None,
        max_running_requests: int = 64,
        context_length: int | None = None,
        attention_backend: str = "auto",
        disable_cuda_graph: bool = False,
        quantization: str = "none",
        enable_torch_compile: bool = False,
        torch_compile_max_bs: int = 32,
        tp: TensorParallel | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        sliding_pool_tokens: int | None = None,
        prefill_chunk: int = 0,
    ):
        """`sliding_pool_tokens`: rows of the sliding-window layers' own KV pool (`memory_pool.KVPool`'s
        `sliding_size`); -1 sizes it (`sliding_pool_size`, with `prefill_chunk` the longest extend); None
        keeps every layer in one pool, as do models without sliding layers, tensor parallelism, and
        backends that do not translate sliding rows (triton, flashinfer)."""
        from runtime.models.model_loader import iter_weights, load_hf_config
        from runtime.models.quantized_linear import quantize_model

        t0 = time.perf_counter()
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = DTYPES[kv_cache_dtype] if kv_cache_dtype not in (None, "auto") else self.dtype
        self.config = ModelConfig.from_hf(load_hf_config(model_dir))
        cfg = self.config
        self.context_length = min(context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.config = cfg = cfg.for_context_length(self.context_length)  # LongRoPE's set for this context
        self.tp = tp = tp or TensorParallel()
        self.local_kv_heads = HeadShard.of(cfg.num_heads, cfg.num_kv_heads, tp).num_kv_heads
        self.channel = None  # rank 0 of a group: sends every batch to the other ranks
        if tp.size > 1 and tp.rank == 0:
            from runtime.model_executor.distributed import BatchChannel

            self.channel = BatchChannel(tp)

        with torch.device("meta"):
            model_class = model_class_for(cfg.architecture)
            model = model_class(cfg, tp)
        if quantization == "mxfp4":  # a checkpoint's MXFP4 experts kept as blocks (gpt-oss)
            if not hasattr(model, "keep_mxfp4_experts") or self.device.type != "cpu":
                raise ValueError(
                    f"--quantization mxfp4 serves gpt-oss's MXFP4 experts on the CPU, not {cfg.architecture} "
                    f"on {self.device.type}: use --quantization none"
                )
            model.keep_mxfp4_experts()  # before the float experts are allocated
        elif quantization not in ("none", "auto", "gguf_native") and not getattr(
            model_class, "quantizable", True
        ):
            raise ValueError(
                f"{cfg.architecture} cannot be served with --quantization {quantization}: use "
                "--quantization mxfp4 (an MXFP4 checkpoint's experts kept as blocks, on the CPU), "
                "gguf_native (a GGUF file's blocks in place) or none (its float weights, MXFP4 experts "
                "dequantized at load)"
            )
        if max_loras > 0 and not getattr(model_class, "supports_lora", True):
            raise ValueError(f"{cfg.architecture} cannot serve LoRA adapters: leave --max-loras at 0")
        if quantization == "gguf_native":  # a GGUF file's blocks in place: no float weights are built
            from runtime.models.gguf_model import load_gguf_model

            model = load_gguf_model(model_dir, cfg, tp, self.device, self.dtype)
        else:
            model = model.to_empty(device=self.device).to(self.dtype)
            model.load_weights(iter_weights(model_dir))
            if quantization != "mxfp4":  # mxfp4's experts were kept as blocks by load_weights
                quantize_model(model, quantization, model_dir)
        self.quantization = quantization
        self.lora = None  # runtime.models.lora.LoraPool when LoRA adapters are served (max_loras > 0)
        if max_loras > 0:
            from runtime.models.lora import LoraPool

            self.lora = LoraPool(cfg, max_loras, max_lora_rank, self.device, self.dtype)
            self.lora.install(model)  # after quantization: the base projections stay quantized
            if enable_torch_compile or (self.device.type == "cuda" and not disable_cuda_graph):
                logger.info("LoRA: decode runs eagerly (no CUDA graphs or torch.compile)")
                disable_cuda_graph, enable_torch_compile = True, False
        self.model = model.eval()
        # The library also holds the sampler's greedy argmax, so it is loaded for every CPU model.
        fused_loaded = self.device.type == "cpu" and _load_fused_layers()
        self.fused_cpu_ops = fused_loaded and self.dtype == torch.float32 and not enable_torch_compile
        model.use_fused_cpu_ops(self.fused_cpu_ops)
        self.load_seconds = time.perf_counter() - t0

        self.backend_name = _load_backend_ops(
            resolve_backend_name(attention_backend, self.device.type), explicit=attention_backend != "auto"
        )
        sliding = [i for i in range(cfg.num_layers) if cfg.sliding_window(i)]
        if not (sliding and tp.size == 1 and self.backend_name in SLIDING_POOL_BACKENDS):
            sliding_pool_tokens = None
        window = max(cfg.sliding_windows, default=0)
        longest_extend = prefill_chunk if prefill_chunk > 0 else self.context_length
        if max_total_tokens is None:
            # every rank addresses the same slots: the smallest rank's share sizes them all
            fixed = max_running_requests * (window + SLIDING_SLACK_PER_REQUEST) + longest_extend
            sized = len(sliding) if sliding_pool_tokens == -1 else 0  # layers in a sized sliding pool
            max_total_tokens = tp.min_int(self._auto_total_tokens(sized, fixed))
        # +1 row so a full pool of running requests plus one being admitted never runs dry of rows.
        self.req_to_token_pool = ReqToTokenPool(
            max_running_requests + 1, self.context_length + 8, self.device
        )
        if sliding_pool_tokens == -1:
            sliding_pool_tokens = sliding_pool_size(
                max_total_tokens, window, max_running_requests, longest_extend
            )
        sliding_size = min(sliding_pool_tokens or 0, max_total_tokens)
        self.kv_pool = KVPool(
            max_total_tokens,
            cfg.num_layers,
            self.local_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            sliding_layers=sliding,
            sliding_size=sliding_size,
        )
        if sliding_size:
            self.allocator = SlidingSlotAllocator(
                max_total_tokens, sliding_size, self.kv_pool.full_to_sliding, self.device
            )
        else:
            self.allocator = SlotAllocator(max_total_tokens, self.device)
        self.backend = create_backend(self.backend_name, self.kv_pool, self.req_to_token_pool)
        if cfg.sliding_windows and not self.backend.supports_sliding_window:
            raise ValueError(
                f"{cfg.architecture} has sliding-window layers, which the {self.backend_name} attention "
                "backend does not implement: use --attention-backend cpu, torch_native or triton"
            )
        if cfg.attention_sinks and not self.backend.supports_sinks:
            raise ValueError(
                f"{cfg.architecture} has attention sinks, which the {self.backend_name} attention backend "
                "does not implement: use --attention-backend cpu or torch_native"
            )
        if cfg.attn_logit_softcap and not self.backend.supports_logit_softcap:
            raise ValueError(
                f"{cfg.architecture} soft-caps its attention logits, which the {self.backend_name} attention "
                "backend does not implement: use --attention-backend cpu or torch_native"
            )
        if cfg.sliding_windows and (
            enable_torch_compile or (self.device.type == "cuda" and not disable_cuda_graph)
        ):
            logger.info("sliding-window layers: decode runs eagerly (the backend builds each batch's window)")
            disable_cuda_graph, enable_torch_compile = True, False
        self.graph_runner = None
        if tp.size > 1 and (enable_torch_compile or (self.device.type == "cuda" and not disable_cuda_graph)):
            logger.info("tensor parallel: decode runs eagerly (no CUDA graphs or torch.compile across ranks)")
            disable_cuda_graph, enable_torch_compile = True, False
        if cfg.moe is not None and self.device.type == "cuda" and not disable_cuda_graph:
            logger.info("mixture of experts: decode runs eagerly (the grouped expert op syncs with the host)")
            disable_cuda_graph = True
        if self.device.type == "cuda" and not disable_cuda_graph:
            from runtime.model_executor.cuda_graph_runner import CudaGraphRunner, supports_cuda_graph

            if supports_cuda_graph(self.backend):
                sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if b <= max_running_requests]
                self.graph_runner = CudaGraphRunner(
                    lambda b: self.model(b, self.backend),
                    sizes,
                    attn_backend=self.backend,
                    device=self.device,
                )
        self.compiled_decode = None
        if enable_torch_compile:
            self.compiled_decode = self._compile_decode(min(max_running_requests, torch_compile_max_bs))
        else:  # eager forwards: the tree is final now (see runtime.models.frozen_modules)
            freeze_attributes(self.model)
        logger.info(
            "model loaded in %.2fs: %s, %d layers, dtype=%s, KV %s, quantization=%s, device=%s, backend=%s, "
            "KV pool %d tokens (%.0f MiB; sliding layers %d of them), tp rank %d/%d",
            self.load_seconds,
            cfg.architecture,
            cfg.num_layers,
            dtype,
            str(self.kv_dtype).removeprefix("torch."),
            quantization,
            device,
            self.backend_name,
            max_total_tokens,
            self.kv_pool.nbytes() / 2**20,
            sliding_size or max_total_tokens,
            tp.rank,
            tp.size,
        )

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, model_dir: str, tp: TensorParallel | None = None
    ) -> ModelRunner:
        """The runner `args` (resolved) describe; on CUDA "cuda" is this rank's GPU (set when it joined)."""
        return cls(
            model_dir,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            attention_backend=args.attention_backend,
            disable_cuda_graph=args.disable_cuda_graph,
            quantization=args.quantization,
            enable_torch_compile=args.enable_torch_compile,
            torch_compile_max_bs=args.torch_compile_max_bs,
            tp=tp,
            max_loras=args.max_loras if args.lora_enabled else 0,
            max_lora_rank=args.max_lora_rank,
            # the tiers copy every layer's K/V by full slot: they keep one pool
            sliding_pool_tokens=None
            if args.disable_sliding_window_pool or args.kv_host_tier_gb or args.kv_disk_dir
            else -1,
            prefill_chunk=args.chunked_prefill_size,
        )

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [num_selected_tokens, vocab] (last token of each request unless chosen)."""
        if self.channel is not None:
            rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices, : max(batch.seq_lens_cpu)]
            self.channel.send_forward(batch, rows)
        return self.forward_local(batch)

    def keepalive(self) -> None:
        """Rank 0, between forwards: tell the waiting ranks it is alive (see distributed.HEARTBEAT_S)."""
        if self.channel is not None:
            self.channel.keepalive()

    def forward_local(self, batch: ForwardBatch) -> torch.Tensor:
        """This rank's part of the forward (all ranks of a group call it with the same batch)."""
        if self.graph_runner is not None and batch.is_decode and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        if self.compiled_decode is not None and self.compiled_decode.can_run(batch):
            return self.compiled_decode.run(batch)
        self.backend.init_forward_metadata(batch)
        if self.lora is not None:
            tokens = batch.extend_seq_lens_cpu if not batch.is_decode else [1] * batch.batch_size
            self.lora.begin(batch.lora_slots, tokens)
        return self.model(batch, self.backend)

    def _compile_decode(self, max_bs: int):
        """The inductor-compiled decode runner, or None (logged once) where it cannot be used."""
        from runtime.model_executor.compiled_decode import DEFAULT_BUCKETS, CompiledDecodeRunner
        from runtime.platform import find_cxx_compiler

        if self.graph_runner is not None:
            logger.info("--enable-torch-compile ignored: decode already replays CUDA graphs")
            return None
        if self.device.type != "cpu":
            logger.warning("--enable-torch-compile is implemented for CPU only; decoding eagerly")
            return None
        if find_cxx_compiler() is None:
            logger.warning(
                "--enable-torch-compile: no C++ compiler (g++/clang++/$CXX) on PATH; decoding eagerly"
            )
            return None
        # Buckets up to max_bs, the last one covering it; larger decode batches run eagerly.
        sizes = [b for b in DEFAULT_BUCKETS if b < max_bs]
        sizes.append(min(b for b in DEFAULT_BUCKETS if b >= min(max_bs, DEFAULT_BUCKETS[-1])))
        runner = CompiledDecodeRunner(self.model, self.kv_pool, self.req_to_token_pool, sizes)
        logger.info(
            "torch.compile: decode compiled for batch sizes %s in %.1fs", sizes, runner.compile_seconds
        )
        return runner

    def _auto_total_tokens(self, sliding_layers: int = 0, sliding_fixed: int = 0) -> int:
        """Full-pool tokens that KV_MEMORY_FRACTION of free memory holds; with `sliding_layers` of the layers
        in a pool sized by `sliding_pool_size` (`sliding_fixed` its rows beyond the cache share), those
        layers cost their rows, not a token each (`auto_total_tokens`)."""
        c = self.config
        full = KVPool.bytes_per_token_for(
            c.num_layers - sliding_layers, self.local_kv_heads, c.head_dim, self.kv_dtype
        )
        rows = KVPool.bytes_per_token_for(sliding_layers, self.local_kv_heads, c.head_dim, self.kv_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = _available_host_memory()
        budget = free * KV_MEMORY_FRACTION
        return int(
            max(1024, min(MAX_AUTO_TOTAL_TOKENS, auto_total_tokens(budget, full, rows, sliding_fixed)))
        )


def _load_fused_layers() -> bool:
    """Whether the fused rope / SiLU * up / argmax kernels loaded (without them: torch ops)."""
    from runtime.models.native_kernels import FUSED_LAYERS, KernelUnavailable

    try:
        FUSED_LAYERS.load()
    except KernelUnavailable as e:
        logger.warning("fused CPU kernels unavailable (%s); rope, SiLU and argmax run as torch ops", e)
        return False
    return True


def _load_backend_ops(name: str, explicit: bool) -> str:
    """Build/load the C++ op the `cpu` backend calls; without it `auto` falls back to torch_native (logged)
    and an explicit `--attention-backend cpu` fails with the reason."""
    if name != "cpu":
        return name
    from runtime.models.native_kernels import PAGED_ATTENTION, KernelUnavailable

    try:
        PAGED_ATTENTION.load()
    except KernelUnavailable as e:
        if explicit:
            raise ValueError(f"--attention-backend cpu: {e}") from e
        logger.warning("attention backend cpu unavailable (%s); using torch_native", e)
        return "torch_native"
    return name


# Backends that read sliding layers through `KVPool.translate`.
SLIDING_POOL_BACKENDS = ("torch_native", "cpu")
# Sliding rows a running request may hold past its window: its decode run (the cache manager's DECODE_RUN)
# and the positions a verify step appends.
SLIDING_SLACK_PER_REQUEST = 64
# Share of the full pool the sliding pool adds for what the radix cache keeps of finished requests.
SLIDING_CACHE_SHARE = 0.25


def sliding_pool_size(full: int, window: int, max_running: int, longest_extend: int) -> int:
    """Rows of the sliding-layer pool: every running request's window and slack, one extend of
    `longest_extend` tokens (it takes rows for all its tokens before freeing those out of the window), and
    SLIDING_CACHE_SHARE of the full pool for the radix cache; never more than the full pool."""
    need = (
        max_running * (window + SLIDING_SLACK_PER_REQUEST) + longest_extend + int(SLIDING_CACHE_SHARE * full)
    )
    return min(full, need)


def auto_total_tokens(budget: float, full_bytes: int, row_bytes: int, fixed_rows: int) -> int:
    """The most full-pool tokens T whose KV fits `budget` bytes: T * full_bytes for the full layers plus
    `sliding_pool_size` rows, min(T, fixed_rows + SLIDING_CACHE_SHARE * T), at row_bytes each."""
    if row_bytes == 0:
        return int(budget // full_bytes)
    shared = (budget - fixed_rows * row_bytes) / (full_bytes + SLIDING_CACHE_SHARE * row_bytes)
    if shared * (1 - SLIDING_CACHE_SHARE) >= fixed_rows:  # the pool is smaller than the full one
        return int(shared)
    return int(budget // (full_bytes + row_bytes))  # it would not be: as large as the full pool


def _available_host_memory() -> int:
    """MemAvailable, or 8 GiB where /proc/meminfo does not say."""
    return allocator.meminfo_bytes("MemAvailable") or 8 << 30
