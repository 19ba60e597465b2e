"""Joining the tensor-parallel group, and the channel that carries each forward from rank 0 to the others.

Rank 0 runs the scheduler: before every forward it broadcasts the `ForwardBatch` (plus the batch's rows of
the request->slot table, which only rank 0's cache manager writes) over a gloo group; the other ranks apply
the rows to their own table and run the same forward, so every rank writes its heads' K/V into the same
slots. Only rank 0 samples. While idle, rank 0 sends a heartbeat every `HEARTBEAT_S`, so a follower waiting
for work can use a finite timeout: a rank 0 that stops sending for `COLLECTIVE_TIMEOUT_S` makes the
follower raise and exit instead of waiting forever (a dead process is caught sooner by the Supervisor).

Payload per step: the batch's int64 tensors and `bs x max(seq_len)` table entries (decode bs 8 at 1k tokens:
64 KiB), pickled, one gloo broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta

import torch

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
    """Rank 0 -> all ranks: ("forward", batch, table rows) | ("noop",). One broadcast per message."""

    def __init__(self, tp: TensorParallel):
        if tp.control_group is None:
            raise ValueError("a BatchChannel needs the group's control (gloo) process group")
        self.tp, self.group = tp, tp.control_group
        self._last_send = time.monotonic()

    def send_forward(self, batch: ForwardBatch, rows: torch.Tensor) -> None:
        """rows: [bs, max(seq_lens)] int64, req_to_token[batch.req_pool_indices, :max(seq_lens)]."""
        self._broadcast(("forward", _to_device(batch, torch.device("cpu")), rows.cpu()))

    def keepalive(self) -> None:
        if time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._broadcast(("noop",))

    def recv(self) -> tuple:
        return self._broadcast(None)

    def _broadcast(self, msg: tuple | None) -> tuple:
        import torch.distributed as dist

        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self._last_send = time.monotonic()
        return box[0]


def _to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


def receive_forward(msg: tuple, device: torch.device) -> tuple[ForwardBatch, torch.Tensor] | None:
    """The batch (on `device`) and table rows of a "forward" message; None for a heartbeat."""
    if msg[0] == "noop":
        return None
    if msg[0] != "forward":
        raise ValueError(f"unknown tensor-parallel control message {msg[0]!r}")
    _, batch, rows = msg
    return _to_device(batch, device), rows.to(device)
