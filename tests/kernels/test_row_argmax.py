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


@pytest.mark.parametrize("n", [1, 7, 8, 9, 49152, 49157])  # scalar only, one vector, vectors + a tail
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
