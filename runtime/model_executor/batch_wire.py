"""How a `ForwardBatch` goes from tensor-parallel rank 0 to the other ranks: typed int64 tensors, no pickle.

The group's rendezvous (torch.distributed's TCPStore) has no authentication, so the bytes a rank receives are
not trusted to be objects: they are decoded into int64 tensors and lists of ints, and every size is checked
before anything is allocated. A message is

    header  int64[HEADER_LEN]: MAGIC, VERSION, op, mode, has_logits_indices, rows_r, rows_c, then the length
            of each field of `SEQ_FIELDS` in that order
    body    int64[sum of the lengths + rows_r * rows_c]: the fields concatenated, then the table rows

NOOP and STOP carry no body (every size is 0).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

MAGIC = 0x52584C4D5450  # "RXLMTP"
VERSION = 1
# The batch's sequences in body order; tensors (1-D int64) and lists of ints alike.
SEQ_FIELDS = (
    "input_ids",
    "positions",
    "req_pool_indices",
    "seq_lens",
    "out_cache_loc",
    "seq_lens_cpu",
    "extend_prefix_lens_cpu",
    "extend_seq_lens_cpu",
    "logits_indices",
)
LIST_FIELDS = frozenset({"seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"})
# Fields never sent: they must be None under tensor parallelism (ServerArgs refuses LoRA with --tp-size > 1).
UNSENT_FIELDS = frozenset({"lora_slots"})
HEADER_LEN = 7 + len(SEQ_FIELDS)
# Largest body a rank allocates (int64 elements, 2 GiB): far above any batch (rows of 256 requests x 128k
# tokens are 32M), low enough that a forged header cannot ask for an absurd allocation.
MAX_BODY = 1 << 28
_MODES = {ForwardMode.EXTEND: 1, ForwardMode.DECODE: 2}


class Op(enum.IntEnum):
    NOOP = 0  # heartbeat of an idle rank 0
    FORWARD = 1
    STOP = 2


class MalformedMessage(ValueError):
    """What a rank received is not a well-formed tensor-parallel control message."""


@dataclass(frozen=True)
class Spec:
    """A checked header: what the body holds."""

    op: Op
    mode: ForwardMode | None
    has_logits_indices: bool
    rows_shape: tuple[int, int]
    lengths: tuple[int, ...]  # one per SEQ_FIELDS

    @property
    def body_len(self) -> int:
        return sum(self.lengths) + self.rows_shape[0] * self.rows_shape[1]


def _check_fields_known() -> None:
    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    missing = names - set(SEQ_FIELDS) - UNSENT_FIELDS - {"mode"}
    if missing:  # a new field would silently not reach the other ranks
        raise TypeError(f"ForwardBatch fields {sorted(missing)} have no tensor-parallel wire encoding")


def encode(
    op: Op, batch: ForwardBatch | None = None, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) CPU int64 tensors of a message; FORWARD needs the batch and its table rows [bs, L]."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[2] = MAGIC, VERSION, int(op)
    if op is not Op.FORWARD:
        if batch is not None or rows is not None:
            raise ValueError(f"a {op.name} message carries no batch")
        return header, torch.empty(0, dtype=torch.int64)
    if batch is None or rows is None:
        raise ValueError("a FORWARD message needs the batch and its table rows")
    _check_fields_known()
    for name in UNSENT_FIELDS:
        if getattr(batch, name) is not None:
            raise ValueError(f"ForwardBatch.{name} cannot go to other tensor-parallel ranks")
    if rows.dtype != torch.int64 or rows.dim() != 2:
        raise TypeError(f"table rows must be a 2-D int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    parts = []
    for name in SEQ_FIELDS:
        value = getattr(batch, name)
        if value is None:  # only logits_indices may be None
            part = torch.empty(0, dtype=torch.int64)
        elif name in LIST_FIELDS:
            part = torch.tensor(list(value), dtype=torch.int64)
        elif value.dtype != torch.int64 or value.dim() != 1:
            raise TypeError(f"ForwardBatch.{name} must be 1-D int64, got {value.dtype} {tuple(value.shape)}")
        else:
            part = value.detach().cpu()
        parts.append(part)
    header[3] = _MODES[batch.mode]
    header[4] = int(batch.logits_indices is not None)
    header[5], header[6] = rows.shape
    header[7:] = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    body = torch.cat([*parts, rows.detach().cpu().reshape(-1)])
    return header, body


def decode_header(header: torch.Tensor) -> Spec:
    """The checked Spec of a received header; MalformedMessage naming the first problem otherwise."""
    if header.dtype != torch.int64 or tuple(header.shape) != (HEADER_LEN,):
        got = f"{header.dtype} {tuple(header.shape)}"
        raise MalformedMessage(f"header must be int64[{HEADER_LEN}], got {got}")
    h = header.tolist()
    if h[0] != MAGIC:
        raise MalformedMessage(f"bad magic {h[0]:#x} (not a radixlm tensor-parallel message)")
    if h[1] != VERSION:
        raise MalformedMessage(f"wire version {h[1]}, this rank speaks {VERSION} (mixed radixlm versions?)")
    try:
        op = Op(h[2])
    except ValueError:
        raise MalformedMessage(f"unknown op {h[2]}") from None
    mode_code, has_logits, rows_r, rows_c, lengths = h[3], h[4], h[5], h[6], tuple(h[7:])
    if op is not Op.FORWARD:
        if any(h[3:]):
            raise MalformedMessage(f"a {op.name} message must have no sizes, got {h[3:]}")
        return Spec(op, None, False, (0, 0), (0,) * len(SEQ_FIELDS))
    modes = {code: mode for mode, code in _MODES.items()}
    if mode_code not in modes:
        raise MalformedMessage(f"unknown forward mode {mode_code}")
    if has_logits not in (0, 1):
        raise MalformedMessage(f"has_logits_indices must be 0 or 1, got {has_logits}")
    sizes = dict(zip(SEQ_FIELDS, lengths))
    sizes.update(rows_r=rows_r, rows_c=rows_c)
    for name, n in sizes.items():
        if not 0 <= n <= MAX_BODY:
            raise MalformedMessage(f"size of {name} is {n}, outside 0..{MAX_BODY}")
    if not has_logits and sizes["logits_indices"]:
        raise MalformedMessage("logits_indices has elements but is marked absent")
    if rows_r != sizes["req_pool_indices"]:
        raise MalformedMessage(f"{rows_r} table rows for {sizes['req_pool_indices']} requests")
    spec = Spec(op, modes[mode_code], bool(has_logits), (rows_r, rows_c), lengths)
    if spec.body_len > MAX_BODY:
        raise MalformedMessage(f"body of {spec.body_len} elements is over the limit of {MAX_BODY}")
    return spec


def decode_body(
    spec: Spec, body: torch.Tensor, device: torch.device | str = "cpu"
) -> tuple[ForwardBatch | None, torch.Tensor | None]:
    """The batch and table rows (on `device`) of a FORWARD message; (None, None) for NOOP and STOP."""
    if body.dtype != torch.int64 or body.dim() != 1 or body.numel() != spec.body_len:
        raise MalformedMessage(
            f"body must be int64[{spec.body_len}] as its header says, got {body.dtype} {tuple(body.shape)}"
        )
    if spec.op is not Op.FORWARD:
        return None, None
    values, off = {}, 0
    for name, n in zip(SEQ_FIELDS, spec.lengths):
        part = body[off : off + n]
        off += n
        values[name] = part.tolist() if name in LIST_FIELDS else part.to(device)
    if not spec.has_logits_indices:
        values["logits_indices"] = None
    rows = body[off:].reshape(spec.rows_shape).to(device)
    return ForwardBatch(mode=spec.mode, **values), rows


def decode(header: torch.Tensor, body: torch.Tensor, device: torch.device | str = "cpu"):
    """(op, batch, rows) of one message held whole (the channel receives the body after the header)."""
    spec = decode_header(header)
    return (spec.op, *decode_body(spec, body, device))
