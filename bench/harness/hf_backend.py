"""`HFBackend`: the DSL's `Backend` over plain transformers, so every `@function` program runs unchanged on
radixlm (`EngineBackend` / `RuntimeEndpoint`) and on the Hugging Face baseline.

Programs call the backend one request at a time from many threads (`run_batch`); a single worker thread
collects the requests that arrive within `batch_wait_s` into one padded static batch -- generation requests
with the same sampling mode together, scoring requests (select) together up to a padded-token budget -- runs
it, and wakes the callers. No KV is kept between batches: a shared prompt prefix is recomputed every time.

`select` scores exactly as radixlm's native backend does: the prompt is tokenized alone (n tokens) and with
each choice appended; a choice's score is the mean log-probability of the tokens past the first n, so both
sides pick the same choice on the same items up to float round-off.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bench.harness.hf_model import SUPPORTED_KEYS, GenRequest, generate_batch, load_hf_model, score_batch
from lang.backends.base import Backend, GenResult, Prompt, SelectResult, pick
from lang.chat_template import ChatTemplate
from lang.errors import BackendError

_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "skip_special_tokens": True,
    "no_stop_trim": False,
}


@dataclass
class _Job:
    kind: str  # "gen" | "score"
    key: tuple  # jobs batch together only with equal keys
    rows: int  # sequences this job adds to a batch
    tokens: int  # its longest sequence (the padded width it needs)
    payload: Any
    future: Future


class HFBackend(Backend):
    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 32,
        max_batch_tokens: int = 8192,
        batch_wait_s: float = 0.05,
    ):
        self.model, self.tokenizer, self.load_seconds = load_hf_model(model_dir, dtype, device)
        self.model_dir, self.dtype = model_dir, dtype
        self.max_batch_size, self.max_batch_tokens, self.batch_wait_s = (
            max_batch_size,
            max_batch_tokens,
            batch_wait_s,
        )
        self._template = ChatTemplate.from_model_info(_model_info(self.tokenizer))
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._pending: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.stats = {"batches": 0, "batch_rows": 0, "padded_tokens": 0, "real_tokens": 0}
        self._worker = threading.Thread(target=self._loop, name="hf-backend-worker", daemon=True)
        self._worker.start()

    def __repr__(self) -> str:
        return f"HFBackend({self.model_dir!r}, dtype={self.dtype})"

    # ------------------------------------------------------------------------------------------ Backend
    def chat_template(self) -> ChatTemplate:
        return self._template

    def generate(self, prompt: Prompt, sampling: dict[str, Any]) -> GenResult:
        t0 = time.perf_counter()
        req, key = self._gen_request(prompt.text, sampling)
        self._submit(_Job("gen", key, 1, len(req.input_ids) + req.max_new_tokens, req, Future()))
        meta = {
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": req.completion_tokens,
            "cached_tokens": 0,
            "finish_reason": req.finish_reason,
            "e2e_latency": time.perf_counter() - t0,
        }
        return GenResult(req.text, meta)

    def select(self, prompt: Prompt, choices: list[str]) -> SelectResult:
        if not choices:
            raise ValueError("select needs at least one choice")
        n_prompt = len(self.tokenizer.encode(prompt.text))
        seqs = [self.tokenizer.encode(prompt.text + c) for c in choices]
        counts = [max(0, len(s) - n_prompt) for s in seqs]
        job = _Job("score", ("score",), len(seqs), max(len(s) for s in seqs), (seqs, counts), Future())
        logprobs = self._submit(job)
        normalized = [sum(lp) / n if n > 0 else -math.inf for lp, n in zip(logprobs, counts)]
        meta = {
            "normalized_logprobs": normalized,
            "prompt_tokens": n_prompt,
            "choice_tokens": counts,
            "cached_tokens": 0,
        }
        return SelectResult(pick(normalized), normalized, meta)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=30)

    # ------------------------------------------------------------------------------------------ requests
    def _gen_request(self, text: str, sampling: dict[str, Any]) -> tuple[GenRequest, tuple]:
        bad = {k: v for k, v in sampling.items() if k not in SUPPORTED_KEYS and v not in (None, 0, [], False)}
        if bad:
            raise BackendError(f"the HF baseline does not implement sampling parameters {sorted(bad)}")
        grammar = None
        if sampling.get("regex") is not None:
            grammar = self._compile("regex", sampling["regex"])
        elif sampling.get("json_schema") is not None:
            grammar = self._compile("json_schema", sampling["json_schema"])
        stop = sampling.get("stop") or ()
        req = GenRequest(
            input_ids=self.tokenizer.encode(text),
            max_new_tokens=int(sampling.get("max_new_tokens", 128)),
            stop=tuple([stop] if isinstance(stop, str) else stop),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
            ignore_eos=bool(sampling.get("ignore_eos", False)),
            skip_special_tokens=bool(sampling.get("skip_special_tokens", True)),
            grammar=grammar,
        )
        temperature = float(sampling.get("temperature", _DEFAULTS["temperature"]))
        key = (
            ("gen", 0.0)
            if temperature == 0
            else ("gen", temperature, float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", -1)))
        )
        return req, key

    def _compile(self, kind: str, spec: Any) -> Any:
        from constrained import GrammarCompiler, GrammarError

        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        try:
            return self._compiler.compile(kind, spec if isinstance(spec, str) else _json(spec)).new_matcher()
        except GrammarError as e:
            raise BackendError(str(e), 400) from e

    # ------------------------------------------------------------------------------------------ batching
    def _submit(self, job: _Job) -> Any:
        with self._cond:
            if self._closed:
                raise BackendError("the HF backend is closed")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future.result()

    def _take_batch(self) -> list[_Job] | None:
        """Wait for a job, then up to `batch_wait_s` for compatible ones; remove and return the batch."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed)
            if not self._pending:
                return None
            deadline = time.monotonic() + self.batch_wait_s
            while True:
                batch = self._compatible()
                rows = sum(j.rows for j in batch)
                remaining = deadline - time.monotonic()
                if rows >= self.max_batch_size or remaining <= 0 or self._closed:
                    break
                self._cond.wait(timeout=remaining)
            for job in batch:
                self._pending.remove(job)
            return batch

    def _compatible(self) -> list[_Job]:
        """The head job plus later jobs with its key, within the row and padded-token limits."""
        head = self._pending[0]
        batch, rows, width = [head], head.rows, head.tokens
        for job in list(self._pending)[1:]:
            if job.key != head.key:
                continue
            w = max(width, job.tokens)
            if rows + job.rows > self.max_batch_size or (
                head.kind == "score" and (rows + job.rows) * w > self.max_batch_tokens
            ):
                break
            batch.append(job)
            rows, width = rows + job.rows, w
        return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                results = self._run(batch)
            except BaseException as e:  # every caller in the batch sees the failure
                for job in batch:
                    job.future.set_exception(e)
                continue
            for job, res in zip(batch, results):
                job.future.set_result(res)

    def _run(self, batch: list[_Job]) -> list[Any]:
        self.stats["batches"] += 1
        if batch[0].kind == "gen":
            reqs = [j.payload for j in batch]
            key = batch[0].key
            sampling = {} if key[1] == 0.0 else {"temperature": key[1], "top_p": key[2], "top_k": key[3]}
            self._account([r.input_ids for r in reqs])
            generate_batch(self.model, self.tokenizer, reqs, sampling)
            return [None] * len(batch)
        seqs = [s for j in batch for s in j.payload[0]]
        counts = [n for j in batch for n in j.payload[1]]
        self._account(seqs)
        flat = score_batch(self.model, seqs, counts, self.tokenizer.pad_token_id)
        out, at = [], 0
        for job in batch:
            out.append(flat[at : at + job.rows])
            at += job.rows
        return out

    def _account(self, seqs: list[list[int]]) -> None:
        self.stats["batch_rows"] += len(seqs)
        self.stats["padded_tokens"] += len(seqs) * max(len(s) for s in seqs)
        self.stats["real_tokens"] += sum(len(s) for s in seqs)


def _model_info(tokenizer: Any) -> dict[str, Any]:
    """What `EngineBackend` derives from the same tokenizer, so both sides render identical role blocks."""
    info: dict[str, Any] = {"chat_template": getattr(tokenizer, "chat_template", None)}
    info.update(
        {k: str(v) for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    )
    return info


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj)
