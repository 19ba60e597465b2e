"""The tensor-parallel control messages: a batch round-trips exactly through typed int64 tensors, and a rank
refuses anything that is not a well-formed message (with the problem named) instead of unpickling it."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch

from runtime.model_executor import batch_wire
from runtime.model_executor.batch_wire import HEADER_LEN, MAX_BODY, MalformedMessage, Op, decode, encode
from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

I64 = torch.iinfo(torch.int64)
ROOT = Path(__file__).resolve().parents[2]


def _extend() -> tuple[ForwardBatch, torch.Tensor]:
    b = ForwardBatch.build_extend(
        [[5, 17, 99], [12], [I64.max, I64.min, 0, -1]], [3, 0, 7], [2, 0, 1], torch.arange(8, 16)
    )
    return b, torch.arange(3 * 11).reshape(3, 11) - 5


def _decode() -> tuple[ForwardBatch, torch.Tensor]:
    b = ForwardBatch.build_decode([4, 8], [10, 1], [1, 3], torch.tensor([40, 41]))
    return b, torch.arange(2 * 10).reshape(2, 10)


def _empty() -> tuple[ForwardBatch, torch.Tensor]:
    e = torch.empty(0, dtype=torch.int64)
    return ForwardBatch(ForwardMode.EXTEND, e, e, e, e, e, [], [], [], logits_indices=e), e.reshape(0, 0)


def _assert_same(a: ForwardBatch, b: ForwardBatch) -> None:
    for f in dataclasses.fields(ForwardBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


@pytest.mark.parametrize("make", [_extend, _decode, _empty])
def test_forward_round_trips_exactly(make):
    batch, rows = make()
    header, body = encode(Op.FORWARD, batch, rows)
    assert header.dtype == body.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    op, got, got_rows = decode(header.clone(), body.clone())
    assert op is Op.FORWARD
    _assert_same(got, batch)
    assert got_rows.dtype == torch.int64 and torch.equal(got_rows, rows)


def test_absent_logits_indices_and_zero_columns_round_trip():
    batch, _ = _decode()
    batch = dataclasses.replace(batch, logits_indices=None, extend_seq_lens_cpu=[1, 1])
    rows = torch.empty(2, 0, dtype=torch.int64)
    _, got, got_rows = decode(*encode(Op.FORWARD, batch, rows))
    assert got.logits_indices is None and got.extend_seq_lens_cpu == [1, 1]
    _assert_same(got, batch)
    assert got_rows.shape == (2, 0)


@pytest.mark.parametrize("op", [Op.NOOP, Op.STOP])
def test_control_ops_carry_no_body(op):
    header, body = encode(op)
    assert body.numel() == 0
    assert decode(header, body) == (op, None, None)


def test_every_batch_field_has_an_encoding():
    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert names == set(batch_wire.SEQ_FIELDS) | batch_wire.UNSENT_FIELDS | {"mode"}


def test_lora_slots_never_go_to_other_ranks():
    """LoRA is refused under tensor parallelism: a batch that names adapter slots is not sent."""
    batch, rows = _decode()
    with pytest.raises(ValueError, match="lora_slots cannot go to other tensor-parallel ranks"):
        encode(Op.FORWARD, dataclasses.replace(batch, lora_slots=[0]), rows)


def test_sender_refuses_non_int64_fields():
    batch, rows = _decode()
    with pytest.raises(TypeError, match="ForwardBatch.out_cache_loc must be 1-D int64, got torch.int32"):
        encode(Op.FORWARD, dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc.int()), rows)
    with pytest.raises(TypeError, match="table rows must be a 2-D int64 tensor"):
        encode(Op.FORWARD, batch, rows.float())
    with pytest.raises(ValueError, match="a FORWARD message needs the batch"):
        encode(Op.FORWARD)


def _forged(**changes: int) -> torch.Tensor:
    """A valid decode header with some entries replaced (by index or by name)."""
    header, _ = encode(Op.FORWARD, *_decode())
    index = {"magic": 0, "version": 1, "op": 2, "mode": 3, "has_logits": 4, "rows_r": 5, "rows_c": 6}
    index.update({name: 7 + i for i, name in enumerate(batch_wire.SEQ_FIELDS)})
    for name, value in changes.items():
        header[index[name]] = value
    return header


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (torch.zeros(HEADER_LEN, dtype=torch.int32), "header must be int64"),
        (torch.zeros(HEADER_LEN + 1, dtype=torch.int64), f"header must be int64\\[{HEADER_LEN}\\]"),
        (_forged(magic=7), "bad magic 0x7 \\(not a radixlm tensor-parallel message\\)"),
        (_forged(version=2), "wire version 2, this rank speaks 1"),
        (_forged(op=9), "unknown op 9"),
        (_forged(mode=0), "unknown forward mode 0"),
        (_forged(has_logits=2), "has_logits_indices must be 0 or 1, got 2"),
        (_forged(input_ids=-1), f"size of input_ids is -1, outside 0..{MAX_BODY}"),
        (_forged(rows_c=MAX_BODY + 1), f"size of rows_c is {MAX_BODY + 1}"),
        (_forged(rows_c=MAX_BODY), f"body of {2 * MAX_BODY + 12} elements is over the limit"),
        (_forged(rows_r=3), "3 table rows for 2 requests"),
        (_forged(logits_indices=1), "logits_indices has elements but is marked absent"),
    ],
)
def test_malformed_headers_are_refused(header, message):
    with pytest.raises(MalformedMessage, match=message):
        batch_wire.decode_header(header)


def test_sizes_on_a_control_op_are_refused():
    header, _ = encode(Op.NOOP)
    header[7] = 5
    with pytest.raises(MalformedMessage, match="a NOOP message must have no sizes"):
        batch_wire.decode_header(header)


def test_a_body_that_disagrees_with_its_header_is_refused():
    header, body = encode(Op.FORWARD, *_decode())
    with pytest.raises(MalformedMessage, match=f"body must be int64\\[{body.numel()}\\]"):
        decode(header, body[:-1])
    with pytest.raises(MalformedMessage, match="as its header says, got torch.float64"):
        decode(header, body.double())


class _Exploit:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle payload executed')",))


def test_a_pickle_payload_is_refused_without_being_run():
    blob = pickle.dumps(_Exploit())
    blob += b"\0" * (-len(blob) % 8 + 8 * HEADER_LEN)
    as_ints = torch.frombuffer(bytearray(blob), dtype=torch.int64)
    with pytest.raises(MalformedMessage, match="bad magic"):
        batch_wire.decode_header(as_ints[:HEADER_LEN].clone())


def test_no_pickle_on_the_tensor_parallel_path():
    for rel in (
        "runtime/model_executor/batch_wire.py",
        "runtime/model_executor/distributed.py",
        "runtime/model_executor/tp_worker.py",
        "runtime/models/parallel.py",
    ):
        src = (ROOT / rel).read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|marshal)\b", src, re.M), rel
        assert not re.search(r"_object(_list)?\(|pickle\.load", src), rel
