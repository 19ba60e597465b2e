"""radixlm::lora_sgmv_ (csrc/lora_sgmv.cpp) against the torch path of LoraLinear it replaces on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.models.lora import LoraBatch, LoraLinear
from runtime.models.native_kernels import LORA_SGMV, LORA_SGMV_PORTABLE_ENV
from tests.kernels.native import load_native_or_skip

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # builds a C++ kernel on first use (the fast tier needs no compiler)
SLOTS, RANK = 4, 16


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    load_native_or_skip(LORA_SGMV)


def reference(y, x, a, bt, slot_per_row, splits, rank):
    """y + each row's own adapter update, part by part, row by row (slot -1: unchanged)."""
    out = y.clone()
    for i, s in enumerate(slot_per_row):
        if s < 0:
            continue
        xa = a[s].float() @ x[i]
        off = 0
        for p, size in enumerate(splits):
            out[i, off : off + size] += xa[p * rank : (p + 1) * rank] @ bt[s, :, off : off + size].float()
            off += size
    return out


def weights(gen, splits, fan_in, dtype, ranks=(16, 16, 16, 16)):
    """A [slots, parts * R, in] and Bt [slots, R, out] with slot s of rank ranks[s] (zero padding rows)."""
    parts, out = len(splits), sum(splits)
    a = torch.randn(SLOTS, parts * RANK, fan_in, generator=gen)
    bt = torch.randn(SLOTS, RANK, out, generator=gen)
    for s, r in enumerate(ranks):
        for p in range(parts):
            a[s, p * RANK + r : (p + 1) * RANK] = 0
        bt[s, r:] = 0
    return a.to(dtype).contiguous(), bt.to(dtype).contiguous()


CASES = {
    "one row": [2],
    "many rows one adapter": [1] * 37,
    "all adapters, base rows between": [0, -1, 1, 2, -1, 3, 0, 0, 1, -1, 2, 3],
    "empty slots, unsorted runs": [3, 3, 0, 3, 0, -1, 3],
    "prefill-sized": [0] * 40 + [-1] * 5 + [2] * 70,
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "splits,fan_in", [([576, 192, 192], 576), ([80], 576), ([1536, 1536], 576), ([576], 1536), ([13, 7], 21)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_the_row_by_row_reference(case, splits, fan_in, dtype):
    slot_per_row = CASES[case]
    gen = torch.Generator().manual_seed(len(slot_per_row) * 7 + fan_in)
    a, bt = weights(gen, splits, fan_in, dtype, ranks=(16, 3, 8, 1))
    x = torch.randn(len(slot_per_row), fan_in, generator=gen)
    y = torch.randn(len(slot_per_row), sum(splits), generator=gen)
    want = reference(y, x, a, bt, slot_per_row, splits, RANK)
    state = LoraBatch(SLOTS, use_kernel=True)
    state.set_rows(slot_per_row, [1] * len(slot_per_row), torch.device("cpu"))
    got = y.clone()
    torch.ops.radixlm.lora_sgmv_(got, x, a, bt, *state.sgmv, splits, RANK)
    torch.testing.assert_close(got, want, atol=2e-3 * fan_in**0.5, rtol=1e-4)
    base_rows = [i for i, s in enumerate(slot_per_row) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # rows of the base model are not touched


def test_no_segments_is_a_no_op():
    gen = torch.Generator().manual_seed(0)
    a, bt = weights(gen, [64], 32, torch.float32)
    x, y = torch.randn(3, 32), torch.randn(3, 64)
    got = y.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    torch.ops.radixlm.lora_sgmv_(got, x, a, bt, empty, torch.zeros(1, dtype=torch.int64), empty, [64], RANK)
    assert torch.equal(got, y)


def test_bad_segments_are_refused():
    gen = torch.Generator().manual_seed(0)
    a, bt = weights(gen, [64], 32, torch.float32)
    x, y = torch.randn(3, 32), torch.randn(3, 64)
    rows, ptr = torch.tensor([0, 5]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="row out of range"):
        torch.ops.radixlm.lora_sgmv_(y, x, a, bt, rows, ptr, torch.tensor([0]), [64], RANK)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.radixlm.lora_sgmv_(
            y, x, a, bt, rows[:1], ptr - torch.tensor([0, 1]), torch.tensor([9]), [64], RANK
        )


class Plain(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()


@pytest.mark.parametrize("tokens_per_req", [[1] * 9, [5, 1, 12, 1, 3, 1, 7, 2, 1]])
def test_lora_linear_kernel_and_torch_paths_agree(tokens_per_req):
    """The same LoraLinear over one batch, the op's path against the torch path (per adapter or grouped)."""
    gen = torch.Generator().manual_seed(3)
    splits, fan_in = [576, 192, 192], 576
    a, bt = weights(gen, splits, fan_in, torch.float32, ranks=(16, 4, 16, 9))
    base = Plain(torch.randn(sum(splits), fan_in, generator=gen) * 0.05)
    slots = [0, 1, -1, 2, 3, 0, 1, -1, 2]
    x = torch.randn(sum(tokens_per_req), fan_in, generator=gen)
    outs = []
    for use_kernel in (True, False):
        state = LoraBatch(SLOTS, use_kernel=use_kernel)
        state.set_rows(slots, tokens_per_req, torch.device("cpu"))
        assert (state.sgmv is not None) == use_kernel
        outs.append(LoraLinear(base, a, bt, splits, state)(x))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


_PORTABLE_RUN = """
import sys, torch
from runtime.models.native_kernels import LORA_SGMV
LORA_SGMV.load()
y, x, a, bt, rows, ptr, slots = torch.load(sys.argv[1])
torch.ops.radixlm.lora_sgmv_(y, x, a, bt, rows, ptr, slots, [40, 24], 16)
torch.save(y, sys.argv[2])
"""


def test_portable_build_gives_the_same_results(tmp_path):
    """RADIXLM_LORA_SGMV_PORTABLE=1 builds the scalar loops (another process: one library per op)."""
    gen = torch.Generator().manual_seed(5)
    a, bt = weights(gen, [40, 24], 50, torch.bfloat16, ranks=(16, 5, 16, 2))
    slot_per_row = [1, -1, 0, 3, 3, 1]
    x, y = torch.randn(6, 50, generator=gen), torch.randn(6, 64, generator=gen)
    state = LoraBatch(SLOTS, use_kernel=True)
    state.set_rows(slot_per_row, [1] * 6, torch.device("cpu"))
    torch.save((y, x, a, bt, *state.sgmv), tmp_path / "args.pt")
    env = {**os.environ, LORA_SGMV_PORTABLE_ENV: "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", _PORTABLE_RUN, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        timeout=300,
    )
    scalar = torch.load(tmp_path / "out.pt")
    torch.ops.radixlm.lora_sgmv_(y, x, a, bt, *state.sgmv, [40, 24], RANK)
    torch.testing.assert_close(y, scalar, atol=1e-4, rtol=1e-5)
