"""`EngineBackend`: run programs on an in-process `runtime.Engine` (no HTTP), same protocol as the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lang.backends.base import REQUEST_OPTIONS
from lang.backends.native import NativeBackend
from lang.errors import BackendError

# Request-body keys that Engine.generate takes as keyword arguments (the rest of its signature is defaults).
_ENGINE_KWARGS = (
    "lora_path",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    *REQUEST_OPTIONS,
)


class EngineBackend(NativeBackend):
    """Backend over `engine.generate(prompt_or_list, sampling_params, ...)`, which returns the native response
    dicts (an iterator of cumulative chunks with `stream=True`). Engine errors become `BackendError`s.
    `options` go with every request (see `NativeBackend`)."""

    def __init__(self, engine: Any, options: dict[str, Any] | None = None, lora: str | None = None) -> None:
        super().__init__(options, lora)
        self.engine = engine

    def __repr__(self) -> str:
        return f"EngineBackend({self.engine!r})"

    def _call(self, body: dict[str, Any], stream: bool) -> Any:
        kwargs = {k: body[k] for k in _ENGINE_KWARGS if k in body}
        if stream:
            kwargs["stream"] = True
        try:
            return self.engine.generate(body["text"], body["sampling_params"], **kwargs)
        except BackendError:
            raise
        except Exception as e:
            raise _as_backend_error(e) from e

    def request(self, body: dict[str, Any]) -> Any:
        return self._call(body, stream=False)

    def request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        chunks = self._call(body, stream=True)
        try:
            for chunk in chunks:
                if isinstance(chunk, dict) and "error" in chunk:
                    err = chunk["error"]
                    raise BackendError(str(err.get("message", err) if isinstance(err, dict) else err))
                yield chunk
        except BackendError:
            raise
        except Exception as e:
            raise _as_backend_error(e) from e

    def model_info(self) -> dict[str, Any]:
        """`engine.get_model_info()` (same dict as GET /get_model_info),
        else built from `engine.tokenizer`.
        """
        getter = getattr(self.engine, "get_model_info", None)
        if callable(getter):
            return getter()
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise BackendError(
                "the engine exposes neither get_model_info() nor a tokenizer; cannot render roles"
            )
        info: dict[str, Any] = {"chat_template": getattr(tokenizer, "chat_template", None)}
        info.update(
            {k: str(v) for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
        )
        return info


def _as_backend_error(e: Exception) -> BackendError:
    """Keep the engine's own message and HTTP-equivalent status (runtime's RequestError carries both)."""
    status = getattr(e, "status", None)
    return BackendError(str(getattr(e, "message", None) or e), status if isinstance(status, int) else None)
