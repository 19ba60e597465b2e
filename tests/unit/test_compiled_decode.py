"""--enable-torch-compile: the inductor-compiled decode gives the same greedy tokens as eager decode.

Compiling the tiny model's buckets takes ~1-3 minutes on the 2-core CI machine, hence `slow`.
"""

from __future__ import annotations

import pytest
import torch

from runtime.model_executor.compiled_decode import find_cxx_compiler
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.model_runner import ModelRunner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_cxx_compiler() is None, reason="inductor on CPU needs a C++ compiler"),
]


def greedy_decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefill every prompt in one extend batch, then `steps` greedy decode steps for all rows together.

    Rows have different lengths, so decode batches carry variable seq lens (masked padding inside the
    bucket) and the KV length grows each step. Returns (tokens per step, logits per step), the extend's
    first: `steps + 1` entries.
    """
    pool, alloc = runner.req_to_token_pool, runner.allocator
    rows = list(range(1, len(prompts) + 1))  # row 0 is the padding row of the compiled runner
    slots = [alloc.alloc(len(p) + steps) for p in prompts]
    for row, s in zip(rows, slots, strict=True):
        pool.req_to_token[row, : len(s)] = s
    loc = torch.cat([s[: len(p)] for s, p in zip(slots, prompts, strict=True)])
    logits = runner.forward(ForwardBatch.build_extend(prompts, [0] * len(prompts), rows, loc))
    toks = logits.argmax(-1).tolist()
    all_toks, all_logits = [toks], [logits]
    for step in range(steps):
        seq = [len(p) + step + 1 for p in prompts]
        loc = torch.stack([s[n - 1] for s, n in zip(slots, seq, strict=True)])
        logits = runner.forward(ForwardBatch.build_decode(toks, seq, rows, loc))
        toks = logits.argmax(-1).tolist()
        all_toks.append(toks)
        all_logits.append(logits)
    for s in slots:
        alloc.free(s)
    return all_toks, all_logits


def test_compiled_decode_matches_eager(tiny_model_dir, caplog):
    kwargs = dict(dtype="float32", max_total_tokens=512, max_running_requests=4)
    eager = ModelRunner(tiny_model_dir, **kwargs)
    with caplog.at_level("INFO", logger="radixlm.model_runner"):
        compiled = ModelRunner(tiny_model_dir, enable_torch_compile=True, **kwargs)
    assert compiled.compiled_decode is not None
    assert compiled.compiled_decode.batch_sizes == [1, 2, 4]
    assert any("decode compiled for batch sizes [1, 2, 4] in" in r.message for r in caplog.records)
    gen = torch.Generator().manual_seed(0)
    for lens in ([7], [5, 11, 3]):  # bs 1 (no padding) and bs 3 padded to the 4 bucket
        prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]
        want_toks, want_logits = greedy_decode(eager, prompts, steps=6)
        got_toks, got_logits = greedy_decode(compiled, prompts, steps=6)
        assert got_toks == want_toks
        for got, want in zip(got_logits, want_logits, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_max_bs_limits_buckets(tiny_model_dir):
    runner = ModelRunner(
        tiny_model_dir,
        max_total_tokens=256,
        max_running_requests=8,
        enable_torch_compile=True,
        torch_compile_max_bs=3,
    )
    assert runner.compiled_decode.batch_sizes == [1, 2, 4]
    batch = ForwardBatch.build_decode([1] * 5, [2] * 5, [0] * 5, torch.zeros(5, dtype=torch.int64))
    assert not runner.compiled_decode.can_run(batch)  # larger batches run eagerly


@pytest.mark.parametrize("quantization", ["w8a8", "w4a8"])
def test_compiled_int8_decode_is_one_graph_and_matches_eager(tiny_model_dir, quantization):
    """The int8-activation layers call opaque `radixlm::` ops (w8a8: fbgemm's packed weights by handle;
    w4a8: the C++ block kernel): the decode forward compiles to one graph without breaks (a graph
    break per layer would recompile until dynamo's limit), and gives the eager tokens."""
    from torch._dynamo.utils import counters

    kwargs = dict(dtype="float32", max_total_tokens=256, max_running_requests=1, quantization=quantization)
    eager = ModelRunner(tiny_model_dir, **kwargs)
    counters.clear()
    compiled = ModelRunner(tiny_model_dir, enable_torch_compile=True, torch_compile_max_bs=1, **kwargs)
    assert compiled.compiled_decode.batch_sizes == [1]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    prompts = [torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(1)).tolist()]
    want_toks, want_logits = greedy_decode(eager, prompts, steps=6)
    got_toks, got_logits = greedy_decode(compiled, prompts, steps=6)
    assert got_toks == want_toks
    for got, want in zip(got_logits, want_logits, strict=True):
        if quantization == "w8a8":
            # fbgemm quantizes each call's activations to 8 bits with one range per tensor: a float32
            # round-off difference between the compiled and the eager elementwise ops moves a value across a
            # rounding boundary now and then (one step, ~1/255 of the range), which moves logits by up to ~5%
            # of their spread (measured 0.15 at std 2.4 with full-range VNNI activations). A wrong or missing
            # layer moves them by about their whole spread.
            torch.testing.assert_close(got, want, atol=0.1 * float(want.std()), rtol=0)
        else:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
