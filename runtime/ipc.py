"""ZMQ plumbing shared by the three processes: private ipc:// endpoints and typed send/recv."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import zmq

from runtime import messages


@dataclass(frozen=True)
class IpcEndpoints:
    """`ipc://` socket paths inside a private (0700) directory: nothing outside this user can connect."""

    directory: str
    scheduler: str  # TokenizerManager -> Scheduler
    detokenizer: str  # Scheduler -> Detokenizer
    tokenizer: str  # Detokenizer / Scheduler -> TokenizerManager

    @classmethod
    def create(cls) -> IpcEndpoints:
        d = tempfile.mkdtemp(prefix="radixlm-ipc-")
        os.chmod(d, 0o700)
        return cls(d, f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/tokenizer")

    def cleanup(self) -> None:
        for name in ("scheduler", "detokenizer", "tokenizer"):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop: back-pressure is the scheduler's job
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


def send(sock: zmq.Socket, msg: messages.Message) -> None:
    sock.send(messages.encode(msg), copy=False)


def recv_nowait(sock: zmq.Socket) -> messages.Message | None:
    try:
        return messages.decode(sock.recv(zmq.NOBLOCK))
    except zmq.Again:
        return None
