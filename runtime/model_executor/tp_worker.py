"""Tensor-parallel rank > 0: load this rank's shard, then run every forward rank 0 sends, forever.

The process is started by the Supervisor (one per rank on each node); it never samples, never talks to the
tokenizer or detokenizer, and exits when a collective fails or times out (rank 0 gone or stuck), which the
Supervisor turns into the server's exit, or receives malformed control data (`batch_wire.MalformedMessage`),
or rank 0 sends STOP.
"""

from __future__ import annotations

import logging
import signal
import traceback

from runtime.server_args import ServerArgs


def run_tp_worker_process(args: ServerArgs, model_dir: str, endpoints, ready_conn, *, rank: int) -> None:
    """Supervisor child entry (the `endpoints` of the process trio are not used by a worker rank)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [tp-rank-{rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    try:
        import torch

        from runtime.model_executor.distributed import BatchChannel, init_tensor_parallel
        from runtime.model_executor.model_runner import ModelRunner

        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        tp = init_tensor_parallel(args, rank)
        runner = ModelRunner.from_server_args(args, model_dir, tp)
        channel = BatchChannel(tp)
        ready_conn.send({"status": "ready"})
    except Exception as e:
        ready_conn.send(
            {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        )
        return
    serve_forwards(runner, channel)


def serve_forwards(runner, channel) -> None:
    """Run every forward rank 0 sends until it sends STOP (typed tensors only: no pickle off the network)."""
    from runtime.model_executor.batch_wire import Op

    table = runner.req_to_token_pool.req_to_token
    while True:
        op, batch, rows = channel.recv(runner.device)
        if op is Op.STOP:
            return
        if op is Op.NOOP:
            continue
        table[batch.req_pool_indices, : rows.shape[1]] = rows  # rank 0's slots for this batch's requests
        runner.forward_local(batch)  # logits are gathered on every rank; only rank 0 samples
