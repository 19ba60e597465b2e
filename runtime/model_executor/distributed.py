"""Joining the tensor-parallel group, and the channel that carries each forward from rank 0 to the others.

Rank 0 runs the scheduler: before every forward it broadcasts the `ForwardBatch` (plus the batch's rows of
the request->slot table, which only rank 0's cache manager writes) over a gloo group; the other ranks apply
the rows to their own table and run the same forward, so every rank writes its heads' K/V into the same
slots. Only rank 0 samples. While idle, rank 0 sends a heartbeat every `HEARTBEAT_S`, so a follower waiting
for work can use a finite timeout: a rank 0 that stops sending for `COLLECTIVE_TIMEOUT_S` makes the
follower raise and exit instead of waiting forever (a dead process is caught sooner by the Supervisor).

Wire format (`batch_wire`): no pickle. The group's rendezvous has no authentication, so whatever reaches it
must not be able to make a rank build arbitrary objects; every message is a fixed int64 header (magic,
version, op, mode, sizes) and one int64 body, two gloo broadcasts. Payload per step: the batch's int64
tensors and `bs x max(seq_len)` table entries (decode bs 8 at 1k tokens: 64 KiB).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch

from runtime.model_executor import batch_wire
from runtime.model_executor.batch_wire import Op
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.models.parallel import TensorParallel
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.distributed")

# Longest wait of one collective (rendezvous included) before the waiting rank raises.
COLLECTIVE_TIMEOUT_S = 300.0
# Rank 0 sends a no-op this often while it has no forward to send (well under the timeout above).
HEARTBEAT_S = 5.0


def init_tensor_parallel(args: ServerArgs, rank: int) -> TensorParallel:
    """Join the group of `args.tp_size` ranks at `args.dist_init_addr` as global rank `rank`.

    The model's collectives use NCCL on CUDA, gloo on CPU; control messages always go over gloo.
    """
    import torch.distributed as dist

    if args.dist_init_addr is None:
        raise ValueError("tensor parallelism needs a resolved --dist-init-addr (call ServerArgs.resolve())")
    local_rank = rank - args.tp_ranks_here.start
    device = torch.device("cpu")
    backend = "gloo"
    if args.device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"tensor-parallel rank {rank} needs GPU {local_rank}, but this node has "
                f"{torch.cuda.device_count()} (each node's ranks take one GPU each)"
            )
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=args.dist_init_addr, world_size=args.tp_size, rank=rank, timeout=timeout
    )
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    logger.info("tensor-parallel rank %d/%d joined (%s, %s)", rank, args.tp_size, backend, device)
    return TensorParallel(rank, args.tp_size, dist.group.WORLD, device, control_group=control)


class BatchChannel:
    """Rank 0 -> all ranks: FORWARD (batch, table rows) | NOOP (heartbeat) | STOP; two broadcasts each."""

    def __init__(self, tp: TensorParallel):
        if tp.control_group is None:
            raise ValueError("a BatchChannel needs the group's control (gloo) process group")
        self.tp, self.group = tp, tp.control_group
        self._last_send = time.monotonic()

    def send_forward(self, batch: ForwardBatch, rows: torch.Tensor) -> None:
        """rows: [bs, max(seq_lens)] int64, req_to_token[batch.req_pool_indices, :max(seq_lens)]."""
        self._send(*batch_wire.encode(Op.FORWARD, batch, rows))

    def keepalive(self) -> None:
        if time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._send(*batch_wire.encode(Op.NOOP))

    def send_stop(self) -> None:
        """Tell the other ranks to leave their loop (they return from `run_tp_worker_process`)."""
        self._send(*batch_wire.encode(Op.STOP))

    def recv(self, device: torch.device) -> tuple[Op, ForwardBatch | None, torch.Tensor | None]:
        """Ranks > 0: the next message; batch and rows (on `device`) for FORWARD, else None.
        Raises batch_wire.MalformedMessage on anything that is not a well-formed message."""
        import torch.distributed as dist

        header = torch.empty(batch_wire.HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        spec = batch_wire.decode_header(header)
        body = torch.empty(spec.body_len, dtype=torch.int64)
        if spec.body_len:
            dist.broadcast(body, src=0, group=self.group)
        batch, rows = batch_wire.decode_body(spec, body, device)
        return spec.op, batch, rows

    def _send(self, header: torch.Tensor, body: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(header, src=0, group=self.group)
        if body.numel():
            dist.broadcast(body, src=0, group=self.group)
        self._last_send = time.monotonic()
