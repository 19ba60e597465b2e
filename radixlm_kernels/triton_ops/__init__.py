"""Triton attention kernels over the paged KV pool (page size 1, slots read through `req_to_token`).

`decode_attention` is split-KV flash decoding (partials + log-sum-exp, then a merge kernel);
`extend_attention` is causal attention of each request's new tokens over its cached prefix plus the new
tokens. Both run on CUDA
and, for tests, on CPU tensors under `TRITON_INTERPRET=1` (which must be set before this package is imported:
`triton.jit` picks the interpreter when the kernels are decorated).
"""

from radixlm_kernels.triton_ops.decode import decode_attention, decode_grid_splits
from radixlm_kernels.triton_ops.extend import extend_attention

__all__ = ["decode_attention", "decode_grid_splits", "extend_attention"]
