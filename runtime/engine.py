"""Offline `Engine`: the process trio without HTTP, for scripts and notebooks.

The TokenizerManager runs on a private asyncio loop in a background thread; `generate` blocks the caller,
`async_generate` awaits from any loop, and `generate(..., stream=True)` returns a plain iterator.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from runtime.entrypoints.generate_input import parse_generate_body
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.server_args import ServerArgs

_END = object()
logger = logging.getLogger("radixlm.engine")


class Engine:
    def __init__(self, model: str = "default", **server_args: Any):
        from runtime.model_executor.quant_probe import auto_quantization
        from runtime.models.model_loader import resolve_model_path

        self.args = ServerArgs(model=model, **server_args).resolve(probe=auto_quantization)
        if self.args.dp_size != 1:
            raise ValueError(
                "Engine runs one replica in this process; --dp-size is for the HTTP server (radixlm serve)"
            )
        a = self.args
        logger.info("quantization %s, dtype %s: %s", a.quantization, a.dtype, a.quantization_reason)
        self.model_dir = resolve_model_path(self.args.model)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="radixlm-engine-loop", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self.tm = self._run(self._create())
        except BaseException:
            self._stop_loop()
            raise

    async def _create(self) -> TokenizerManager:
        tm = await asyncio.to_thread(TokenizerManager, self.args, self.model_dir)
        tm.start()
        return tm

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def tokenizer(self):
        return self.tm.tokenizer

    @staticmethod
    def _body(prompt, sampling_params, input_ids, **kw) -> dict[str, Any]:
        body = {"sampling_params": sampling_params, **{k: v for k, v in kw.items() if v is not None}}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = prompt
        return body

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list | None = None,
        input_ids: list | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        cache_ttl_s: float | None = None,
        timeout: float | None = None,
        priority: int | None = None,
        lora_path: str | list | None = None,
        program_id: str | None = None,
    ):
        """Native response dict (a list for list input); with stream=True an iterator of cumulative dicts."""
        body = self._body(
            prompt,
            sampling_params,
            input_ids,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            stream=stream,
            rid=rid,
            cache_salt=cache_salt,
            session_id=session_id,
            cache_ttl_s=cache_ttl_s,
            timeout=timeout,
            priority=priority,
            lora_path=lora_path,
            program_id=program_id,
        )
        reqs, is_batch = parse_generate_body(body)
        if stream:
            return self._stream(reqs[0])
        results = self._run(self.tm.generate_all(reqs))
        return results if is_batch or len(results) > 1 else results[0]

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, **kw):
        body = self._body(prompt, sampling_params, input_ids, **kw)
        reqs, is_batch = parse_generate_body(body)
        fut = asyncio.run_coroutine_threadsafe(self.tm.generate_all(reqs), self._loop)
        results = await asyncio.wrap_future(fut)
        return results if is_batch or len(results) > 1 else results[0]

    def _stream(self, req) -> Iterator[dict[str, Any]]:
        q: queue.Queue = queue.Queue()

        async def pump():
            try:
                async for out in self.tm.generate(req):
                    q.put(out)
            except BaseException as e:  # surfaces in the caller's thread
                q.put(e)
            finally:
                q.put(_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()  # consumer stopped early: the request is aborted

    def get_model_info(self) -> dict[str, Any]:
        """The same fields as GET /get_model_info."""
        tok = self.tm.tokenizer
        return {
            "model_path": self.args.model,
            "model_dir": self.model_dir,
            "served_model_name": self.args.model_name,
            "tokenizer_path": self.model_dir,
            "is_generation": True,
            "chat_template": tok.chat_template,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "context_length": self.tm.context_length,
            "vocab_size": self.tm.info.get("vocab_size"),
        }

    def flush_cache(self) -> bool:
        return self._run(self.tm.flush_cache()).success

    def server_info(self) -> dict[str, Any]:
        return self._run(self.tm.server_info())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def close():
            self.tm.shutdown()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._run(close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
