"""Scheduler process entry point: drives `Scheduler` with messages from ZMQ.

Loop: drain incoming messages -> one `step()` -> push outputs to the detokenizer. When idle it blocks on the
socket (no busy spin) and checks the KV accounting invariant once per transition to idle.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import traceback

import zmq

from runtime import ipc
from runtime.messages import BatchTokenIDOut
from runtime.server_args import ServerArgs


def run_scheduler_process(args: ServerArgs, model_dir: str, endpoints: ipc.IpcEndpoints, ready_conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    _setup_logging(args, "scheduler")
    logger = logging.getLogger("radixlm.scheduler")
    try:
        import torch

        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        from runtime.managers.scheduler.scheduler import Scheduler

        tp = None
        if args.tp_size > 1:  # this process is rank 0: it schedules, the other ranks follow its batches
            from runtime.model_executor.distributed import init_tensor_parallel

            tp = init_tensor_parallel(args, rank=0)
        scheduler = Scheduler(args, model_dir, tp=tp)
        if scheduler.args.num_threads_auto and args.tp_size == 1 and scheduler.runner.device.type == "cpu":
            from runtime.managers.scheduler.cpu_share import ThreadGovernor

            scheduler.threads = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
        ctx = zmq.Context()
        recv_sock = ipc.socket(ctx, zmq.PULL, endpoints.scheduler, bind=True)
        detok_sock = ipc.socket(ctx, zmq.PUSH, endpoints.detokenizer, bind=False)
        reply_sock = ipc.socket(ctx, zmq.PUSH, endpoints.tokenizer, bind=False)
        _freeze_startup_objects()
        scheduler.memory.start()  # the footprint --memory-budget-mb counts from
        r = scheduler.runner
        ready_conn.send(
            {
                "status": "ready",
                "max_total_tokens": r.max_total_tokens,
                "context_length": r.context_length,
                "vocab_size": r.vocab_size,
                "attention_backend": r.backend_name,
                "load_seconds": r.load_seconds,
            }
        )
    except Exception as e:  # report startup failures to the parent instead of dying silently
        ready_conn.send(
            {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        )
        return
    poller = zmq.Poller()
    poller.register(recv_sock, zmq.POLLIN)
    if scheduler.kv_publisher is not None and scheduler.kv_publisher.replay is not None:
        poller.register(scheduler.kv_publisher.replay, zmq.POLLIN)  # an idle scheduler still answers replays
    was_busy = False
    stopping: list[int] = []
    if args.kv_disk_dir:  # SIGTERM (the supervisor's graceful stop): write the cache to disk, then exit
        signal.signal(signal.SIGTERM, lambda sig, frame: stopping.append(sig))
    while not stopping:
        scheduler.runner.keepalive()  # tensor parallel: idle rank 0 heartbeats to the waiting ranks
        if not scheduler.has_work():
            if was_busy:
                _check_accounting_or_exit(scheduler, logger)
                scheduler.memory.trim()  # what the burst left free in the heap goes back (while idle)
                was_busy = False
            # automatic retention's prefetch runs in idle time too; while it loads, look again at once
            poller.poll(timeout=0 if scheduler.prefetch() else 1000)
        elif not scheduler.can_run():
            poller.poll(timeout=5)  # only grammars compiling: check their futures without spinning
        while (msg := ipc.recv_nowait(recv_sock)) is not None:
            try:
                reply = scheduler.handle(msg)
            except Exception:  # a bad control message must not take the server down
                logger.exception("failed to handle %s", type(msg).__name__)
                reply = _error_reply(msg)
            if reply is not None:
                ipc.send(reply_sock, reply)
        if scheduler.has_work():
            was_busy = True
            try:
                outputs = scheduler.step()
            except Exception:  # not one request's fault (those are failed inside step): fail them all
                logger.exception("scheduler step failed; failing every live request")
                outputs = scheduler.recover()
                _check_accounting_or_exit(scheduler, logger)
            if outputs:
                ipc.send(detok_sock, BatchTokenIDOut(outputs=outputs))
        scheduler.publish_events()
    logger.info("SIGTERM: writing the prefix cache to %s", args.kv_disk_dir)
    scheduler.cm.save_to_disk()
    logger.info("prefix cache written: %s", scheduler.cm.disk.info())


def _freeze_startup_objects() -> None:
    """Move what start-up created (the model, the tokenizer, torch's and the libraries' objects: ~360k that
    Python's GC tracks) out of the collector's reach: they live as long as the process, and a full
    collection walked them all, an 85-105 ms stall of every running request (default model, this 2-core
    machine) whenever enough new objects had outlived the younger generations (the speculative drafting
    indexes make them). vLLM does the same."""
    gc.collect()
    gc.freeze()


def _check_accounting_or_exit(scheduler, logger: logging.Logger) -> None:
    """The one failure that stops the process: a KV slot lost or held twice."""
    try:
        scheduler.check_accounting()
    except AssertionError as e:
        logger.error("KV accounting invariant broken: %s", e)
        os._exit(3)  # a leak is a bug: fail loudly so a supervisor restarts us


def _error_reply(msg):
    from runtime.messages import FlushCacheReq, FlushCacheResp, GetServerInfoReq, ServerInfoResp

    if isinstance(msg, FlushCacheReq):
        return FlushCacheResp(success=False, message="internal error while flushing; see the scheduler log")
    if isinstance(msg, GetServerInfoReq):
        return ServerInfoResp(
            info={"error": "internal error while collecting server info; see the scheduler log"}
        )
    from runtime.messages import DashboardStateReq, DashboardStateResp

    if isinstance(msg, DashboardStateReq):
        return DashboardStateResp(state={"error": "internal error while building the dashboard state"})
    return None


def _setup_logging(args: ServerArgs, role: str) -> None:
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
