"""llama.cpp as a benchmark side: the same GGUF file as radixlm's `--model default`, the same thread count.

llama-cpp-python comes with the `bench` extra only (it compiles llama.cpp at install time), so every entry
point first calls `import_llama_cpp()`, which fails with a message saying how to install it.

- `BatchDecoder` (decode_throughput) drives llama.cpp's C API through llama-cpp-python's ctypes bindings the
  way llama.cpp's own batched-bench does: `bs` sequences share one context, their prompts go through one
  `llama_decode`, then every step decodes one `llama_batch` holding the next token of each sequence.
  Sampling is a numpy argmax over the logits rows llama.cpp returns (greedy, like the other sides).
- `server_command` (serving) is llama-cpp-python's OpenAI-compatible server, `python -m llama_cpp.server`.
  It serves one request at a time (a lock around the model), so concurrent streams queue.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "install the bench extra: `pip install -e '.[bench]'` or `make bench` "
    "(llama-cpp-python compiles llama.cpp: about 10 minutes on 2 cores)"
)
LLAMACPP = "llamacpp"


def import_llama_cpp() -> Any:
    """The `llama_cpp` module, or a RuntimeError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as err:
        raise RuntimeError(
            f"the llamacpp side needs llama-cpp-python, which is not installed ({err}); {INSTALL_HINT}"
        ) from err
    return llama_cpp


def gguf_file(model: str = "default") -> str:
    """The GGUF file llama.cpp loads for `model`: the default model's file (the one radixlm converts), or a
    .gguf path. A Hugging Face folder has no GGUF for llama.cpp to run: ValueError."""
    from runtime.models.model_loader import default_gguf_path

    if model == "default":
        return default_gguf_path()
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"the llamacpp side runs a GGUF file; {model!r} is not a file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"the llamacpp side runs a GGUF file; {model!r} is not one (bad magic)")
    return str(path)


class BatchDecoder:
    """One llama.cpp model and context sized for `max_seqs` sequences of up to `max_tokens_per_seq` tokens.

    `decode(bs, prompt_len, steps, gen)` returns the same figures as decode_throughput's radixlm side
    (prefill_s, prefill_tok_s, decode_s, decode_tok_s, step_ms) and clears the KV cache afterwards.
    """

    def __init__(self, gguf: str, max_seqs: int, max_tokens_per_seq: int, threads: int):
        lc = import_llama_cpp()
        # llama-cpp-python prints every llama.cpp log line (loader, graph) unless its logger is set higher.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lc, self.threads = lc, threads
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = lc.llama_context_default_params()
        n_ctx = max_seqs * max_tokens_per_seq
        cp.n_ctx, cp.n_batch, cp.n_seq_max = n_ctx, n_ctx, max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        # kv_unified stays off (llama.cpp's default): each sequence attends over its own KV buffer, which
        # llama.cpp recommends for sequences that share no prefix, as here.
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(
                f"llama.cpp could not create a context of {n_ctx} tokens for {max_seqs} sequences"
            )
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)
        self.max_seqs, self.max_tokens_per_seq = max_seqs, max_tokens_per_seq

    def _clear_kv(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:  # older llama.cpp
            lc.llama_kv_self_clear(self.ctx)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> Any:
        """One llama_decode; returns the logits rows of the tokens marked in `logits`, [n_marked, vocab]."""
        import numpy as np

        b = self.batch
        for i, (t, p, s, want) in enumerate(zip(tokens, positions, seqs, logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, want
            b.seq_id[i][0] = s
        b.n_tokens = len(tokens)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc} ({len(tokens)} tokens)")
        rows = sum(logits)
        ptr = self.lc.llama_get_logits(self.ctx)
        flat = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * (rows * self.n_vocab))).contents
        return np.frombuffer(flat, dtype=np.float32).reshape(rows, self.n_vocab)

    def decode(
        self, bs: int, prompt_len: int, steps: int, gen: Any, return_tokens: bool = False
    ) -> dict[str, Any]:
        """Random prompts from `gen`, greedy decode; `return_tokens` adds `tokens` ([bs][steps] ids)."""
        import torch

        if bs > self.max_seqs or prompt_len + steps > self.max_tokens_per_seq:
            raise ValueError(
                f"bs {bs} x {prompt_len + steps} tokens exceeds the context "
                f"({self.max_seqs} x {self.max_tokens_per_seq})"
            )
        prompts = torch.randint(0, self.n_vocab, (bs, prompt_len), generator=gen).tolist()
        try:
            t0 = time.perf_counter()
            tokens = [t for p in prompts for t in p]
            positions = list(range(prompt_len)) * bs
            seqs = [s for s in range(bs) for _ in range(prompt_len)]
            marks = [j == prompt_len - 1 for _ in range(bs) for j in range(prompt_len)]
            nxt = self._decode(tokens, positions, seqs, marks).argmax(-1).tolist()
            prefill = time.perf_counter() - t0
            out: list[list[int]] = [[] for _ in range(bs)]
            t0 = time.perf_counter()
            for step in range(steps):
                if return_tokens:
                    for row, t in zip(out, nxt):
                        row.append(t)
                pos = [prompt_len + step] * bs
                nxt = self._decode(nxt, pos, list(range(bs)), [True] * bs).argmax(-1).tolist()
            decode = time.perf_counter() - t0
        finally:
            self._clear_kv()
        return {
            "prefill_s": prefill,
            "prefill_tok_s": bs * prompt_len / prefill,
            "decode_s": decode,
            "decode_tok_s": bs * steps / decode,
            "step_ms": 1000 * decode / steps,
            **({"tokens": out} if return_tokens else {}),
        }

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)
            self.ctx = self.model = None


def server_command(gguf: str, port: int, threads: int, n_ctx: int) -> list[str]:
    """`python -m llama_cpp.server` on 127.0.0.1:`port` (OpenAI API under /v1); checks the package first."""
    import_llama_cpp()
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        "default",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(n_ctx),
        # The server runs one request at a time; by default a queued request cuts the running stream short.
        "--interrupt_requests",
        "False",
    ]
