"""The sampler's greedy pick (`radixlm::row_argmax`, C++) against torch.argmax, which it replaces on the CPU:
the same index (first on ties, NaN as the maximum) and the maximum itself, for every row layout."""

from __future__ import annotations

import pytest
import torch

from runtime.model_executor.sampler import greedy_ids
from runtime.models.native_kernels import FUSED_LAYERS
from tests.kernels.native import load_native_or_skip

pytestmark = pytest.mark.slow  # builds a C++ kernel on first use (the fast tier needs no compiler)


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    load_native_or_skip(FUSED_LAYERS)


def check(x: torch.Tensor) -> None:
    ids, values = torch.ops.radixlm.row_argmax(x)
    assert torch.equal(ids, x.argmax(dim=-1)), (ids, x.argmax(dim=-1))
    torch.testing.assert_close(values, x.gather(1, ids.unsqueeze(1)).squeeze(1), equal_nan=True)
    assert torch.equal(greedy_ids(x), ids)


# scalar only (n < 32); the four 8-float chains (32, 64); the chains and a tail of 1-31 floats
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32, 33, 63, 64, 95, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 5])
def test_random_rows(n, rows):
    check(torch.randn(rows, n, generator=torch.Generator().manual_seed(n + rows)))


@pytest.mark.parametrize("n", [5, 64, 1001])
def test_ties_take_the_first_index_and_nan_is_the_maximum(n):
    x = torch.zeros(6, n)
    x[0, n // 2] = x[0, n - 1] = 3.0  # a tie
    x[1, :] = -float("inf")  # all -inf: index 0
    x[2, n - 1] = float("nan")  # NaN in the tail
    x[3, 1] = float("nan")  # NaN in the first vector
    x[3, 2] = float("inf")
    x[4, 0], x[4, n - 1] = 1.0, float("nan")  # NaN after the maximum
    x[5, 2:] = -0.0  # -0.0 and 0.0 are equal: the first of them
    check(x)


@pytest.mark.parametrize("where", [0, 5, 8, 17, 30, 31, 40, 63, 990])
def test_each_chain_and_lane_finds_its_maximum_and_nan(where):
    """The max runs four vector chains of 8 floats: a maximum, a tie after it, or a NaN in any of them
    (and in the tail, past the last full group of 32) is found at its first index."""
    n = 1001
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(where)).clamp(-5, 5)
    x[0, where] = 9.0
    x[1, where] = x[1, n - 1 - where // 2] = 9.0  # a tie: the first
    x[2, where] = float("nan")
    x[3, where], x[3, where + 1] = float("nan"), float("inf")
    check(x)


def test_strided_rows():
    full = torch.randn(4, 300)
    check(full[:, :257])  # rows 300 apart, 257 long


def test_bad_inputs_are_errors():
    with pytest.raises(RuntimeError, match="row_argmax: x must be a float32"):
        torch.ops.radixlm.row_argmax(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row_argmax"):
        torch.ops.radixlm.row_argmax(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="row_argmax"):
        torch.ops.radixlm.row_argmax(torch.zeros(8, 2).t())  # last dim not contiguous
