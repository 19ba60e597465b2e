"""`Program` (what `@function` makes): run one program, a streamed one, or a batch on a thread pool."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from lang import sampling as sampling_kw
from lang.backends.base import Backend
from lang.errors import ProgramError
from lang.interpreter import Executor
from lang.state import ProgramState

MAX_AUTO_THREADS = 64

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """Backend used by `run`/`run_batch` calls that pass none."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _resolve_backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ProgramError("no backend: pass backend=... or call lang.set_default_backend(...)")
    return backend


class Program:
    """A DSL program: `func(s, **args)` appends to `s`. Calling it directly (`prog(s, ...)`) inlines it into
    another program's state."""

    def __init__(self, func: Callable[..., Any]) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{func.__name__}: a program takes the state as its first parameter")
        self.func = func
        self._arg_names = {p.name for p in params[1:]}
        functools.update_wrapper(self, func)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.func(s, *args, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(program arguments, default sampling kwargs):
        a sampling name that is not a parameter is a default.
        """
        args, sampling = {}, {}
        for k, v in kwargs.items():
            (sampling if sampling_kw.is_sampling_key(k) and k not in self._arg_names else args)[k] = v
        return args, sampling_kw.normalize(sampling)

    def _start(
        self, backend: Backend, args: tuple, kwargs: dict[str, Any], defaults: dict[str, Any], stream: bool
    ) -> ProgramState:
        state = ProgramState(Executor(backend, defaults, stream=stream))
        if not stream:
            state.ret_value = self.func(state, *args, **kwargs)
            return state

        def body() -> None:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            except BaseException as e:  # handed to the readers of the stream
                state._ex.events.finish(e)
            else:
                state._ex.events.finish()

        state._runner = threading.Thread(target=body, name=f"lang-{self.func.__name__}", daemon=True)
        state._runner.start()
        return state

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run the program. Keyword arguments that are sampling parameters (`temperature`, `max_tokens`, ...)
        and not program parameters become defaults for every gen. With `stream=True` this returns at once and
        the state fills in the background (read it with `text_iter`)."""
        kw, defaults = self._split(kwargs)
        return self._start(_resolve_backend(backend), args, kw, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
        return_exceptions: bool = False,
        **sampling: Any,
    ) -> list[Any]:
        """Run the program once per kwargs dict, concurrently; results keep the input order.

        A failure re-raises (after cancelling what has not started) unless `return_exceptions`, in which case
        the exception takes that program's place in the list.
        """
        from tqdm.auto import tqdm

        backend = _resolve_backend(backend)
        unknown = sorted(k for k in sampling if not sampling_kw.is_sampling_key(k))
        if unknown:
            raise TypeError(
                f"run_batch got unexpected keyword argument(s) {unknown}: pass program arguments per item"
            )
        defaults = sampling_kw.normalize(sampling)
        jobs = [self._split(dict(kw)) for kw in batch_kwargs]
        if num_threads == "auto":
            num_threads = max(1, min(len(jobs), MAX_AUTO_THREADS))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or a positive int, got {num_threads!r}")
        results: list[Any] = [None] * len(jobs)
        with (
            tqdm(total=len(jobs), disable=not progress_bar, desc=self.func.__name__) as bar,
            ThreadPoolExecutor(max_workers=num_threads) as pool,
        ):
            futures = {
                pool.submit(self._start, backend, (), kw, sampling_kw.merge(defaults, own), False): i
                for i, (kw, own) in enumerate(jobs)
            }
            for fut in as_completed(futures):
                try:
                    results[futures[fut]] = fut.result()
                except Exception as e:
                    if not return_exceptions:
                        pool.shutdown(wait=True, cancel_futures=True)
                        raise
                    results[futures[fut]] = e
                bar.update(1)
        return results


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator that makes a program: `@function` or `@function()`."""
    if func is None:
        return Program
    return Program(func)
