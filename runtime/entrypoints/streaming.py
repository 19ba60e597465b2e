"""One streaming loop for every endpoint; each endpoint supplies only a `StreamFormatter`.

The loop owns what all streams share: prefilling a prompt shared by n choices once, interleaving the
choices' outputs, tracking what each choice has already been sent (text, logprob entries), remembering
final outputs, the trailing `[DONE]`, and pulling the first event before the 200 goes out so that bad input
is still answered 4xx. Formatters only turn outputs into events (native JSON, OpenAI chat or completion).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from runtime.entrypoints.http_common import SSE_DONE, sse_stream
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import GenerateReq


class StreamFormatter(Protocol):
    """Turns one endpoint's outputs into SSE events (bytes)."""

    def start(self, num_choices: int) -> list[bytes]:
        """Events sent once, when the first output arrives (e.g. chat's role deltas)."""
        ...

    def update(self, index: int, out: dict[str, Any], text_delta: str, logprob_start: int) -> bytes | None:
        """The event for choice `index`'s new cumulative output `out` (None: nothing to send).

        `text_delta`: text not sent before; `logprob_start`: how many output logprob entries were sent
        (an update answered None sent none).
        """
        ...

    def end(self, finals: list[dict[str, Any]]) -> list[bytes]:
        """Events after every choice finished, before `[DONE]`; `finals` in choice order (e.g. usage)."""
        ...


async def stream_events(
    tm: TokenizerManager, reqs: list[GenerateReq], fmt: StreamFormatter
) -> AsyncIterator[bytes]:
    """Run `reqs` (n > 1 expanded into choices, the shared prompt prefilled once) and yield their events."""
    choices = await tm.prepare_choices(reqs)
    sent_text = [0] * len(choices)
    sent_lp = [0] * len(choices)
    finals: dict[int, dict[str, Any]] = {}
    started = False
    async for i, out in merge_outputs(tm, choices):
        if not started:
            for event in fmt.start(len(choices)):
                yield event
            started = True
        delta = out["text"][sent_text[i] :]
        sent_text[i] = len(out["text"])
        event = fmt.update(i, out, delta, sent_lp[i])
        if event is not None:  # entries of a skipped update (no text yet) go out with the next event
            sent_lp[i] = len(out["meta_info"].get("output_token_logprobs") or [])
            yield event
        if out["meta_info"]["finish_reason"]:
            finals[i] = out
    for event in fmt.end([finals[k] for k in sorted(finals)]):
        yield event
    if getattr(fmt, "done_marker", True):  # Responses and Messages streams end with their own last event
        yield SSE_DONE


async def stream_response(
    tm: TokenizerManager, reqs: list[GenerateReq], fmt: StreamFormatter
) -> StreamingResponse:
    """A text/event-stream response; errors up to the first event raise here (the handler answers 4xx/5xx),
    later ones become an error event (`sse_stream`). Closing the response aborts every choice."""
    events = stream_events(tm, reqs, fmt)
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return StreamingResponse(sse_stream(body()), media_type="text/event-stream")


async def merge_outputs(
    tm: TokenizerManager, reqs: list[GenerateReq]
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave the cumulative outputs of several streams as (choice index, output), in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, req: GenerateReq) -> None:
        try:
            async for out in tm.generate(req):
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
