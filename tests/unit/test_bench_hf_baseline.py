"""The HF baseline computes what radixlm computes: padded batches give the unpadded results, per-row limits
and stop strings hold inside one static batch, `select` scores like the native backend, and concurrent DSL
calls are merged into shared batches. A tiny random Llama with the default tokenizer's full vocabulary keeps
it fast.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bench.harness.hf_backend import HFBackend
from bench.harness.hf_model import GenRequest, generate_batch, left_pad, load_hf_model, score_batch
from lang.backends.base import Prompt
from tests.random_llama import save_full_vocab_llama


@pytest.fixture(scope="module")
def tiny_full_vocab_dir(tmp_path_factory, default_tokenizer) -> str:
    return save_full_vocab_llama(tmp_path_factory.mktemp("tiny_full_vocab"), default_tokenizer)


@pytest.fixture(scope="module")
def loaded(tiny_full_vocab_dir):
    model, tok, seconds = load_hf_model(tiny_full_vocab_dir)
    assert seconds > 0
    return model, tok


def _full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [len, vocab]


def test_left_pad_right_aligns_rows():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_score_batch_matches_unpadded_forward(loaded):
    model, tok = loaded
    seqs = [tok.encode("The quick brown fox jumps over"), tok.encode("Hi there"), tok.encode("A B C D E F G")]
    counts = [3, 1, 2]
    got = score_batch(model, seqs, counts, tok.pad_token_id)
    for seq, n, lps in zip(seqs, counts, got):
        full = _full_logprobs(model, seq)
        want = [float(full[len(seq) - n - 1 + k, seq[len(seq) - n + k]]) for k in range(n)]
        assert lps == pytest.approx(want, abs=1e-4)
    with pytest.raises(ValueError):
        score_batch(model, [[5]], [1], tok.pad_token_id)  # nothing before the scored token


def _greedy_alone(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(_full_logprobs(model, out)[-1].argmax()))
    return out[len(ids) :]


def test_padded_batch_generation_equals_each_row_alone_with_per_row_limits(loaded):
    model, tok = loaded
    prompts = [tok.encode("Once upon a time in a land"), tok.encode("Hello"), tok.encode("Numbers: 1 2 3 4")]
    reqs = [GenRequest(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, [6, 3, 5])]
    generate_batch(model, tok, reqs)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _greedy_alone(model, p, r.max_new_tokens)
        assert r.completion_tokens == r.max_new_tokens
        assert r.finish_reason == {"type": "length", "length": r.max_new_tokens}
        assert r.text == tok.decode(r.output_ids, skip_special_tokens=True)


def test_stop_string_cuts_one_row_only(loaded):
    model, tok = loaded
    prompt = tok.encode("Once upon a time in a land")
    free = GenRequest(prompt, max_new_tokens=8, ignore_eos=True)
    generate_batch(model, tok, [free])
    stop_text = tok.decode(free.output_ids[2:3])  # a piece of text the model is known to produce at step 3
    assert stop_text
    stopped = GenRequest(prompt, max_new_tokens=8, ignore_eos=True, stop=(stop_text,))
    other = GenRequest(prompt, max_new_tokens=8, ignore_eos=True)
    generate_batch(model, tok, [stopped, other])
    assert other.output_ids == free.output_ids
    assert stopped.finish_reason == {"type": "stop", "matched": stop_text}
    full_text = tok.decode(free.output_ids, skip_special_tokens=True)
    assert stopped.text == full_text[: full_text.index(stop_text)]
    assert stopped.completion_tokens <= 3


def test_select_scores_like_the_native_backend_and_batches_concurrent_calls(tiny_full_vocab_dir, loaded):
    model, tok = loaded
    backend = HFBackend(tiny_full_vocab_dir, batch_wait_s=0.3)
    try:
        prompt = Prompt("Question: is the sky blue? Answer:")
        choices = [" yes", " no", " maybe not"]
        res = backend.select(prompt, choices)
        n_prompt = len(tok.encode(prompt.text))
        want = []
        for c in choices:
            ids = tok.encode(prompt.text + c)
            full = _full_logprobs(model, ids)
            want.append(
                sum(float(full[i - 1, ids[i]]) for i in range(n_prompt, len(ids))) / (len(ids) - n_prompt)
            )
        assert res.normalized_logprobs == pytest.approx(want, abs=1e-4)
        assert res.index == max(range(len(want)), key=want.__getitem__)

        before = dict(backend.stats)
        results = [None] * 6

        def call(i: int) -> None:
            results[i] = backend.generate(
                Prompt(f"Item {i}:"), {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
            )

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.meta_info["completion_tokens"] == 3 for r in results)
        assert backend.stats["batch_rows"] - before["batch_rows"] == 6
        assert backend.stats["batches"] - before["batches"] < 6  # concurrent calls shared static batches
        alone = backend.generate(
            Prompt("Item 4:"), {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        )
        assert alone.text == results[4].text  # batching does not change greedy output
    finally:
        backend.close()


def test_unsupported_sampling_parameter_is_refused(tiny_full_vocab_dir):
    from lang.errors import BackendError

    backend = HFBackend(tiny_full_vocab_dir, batch_wait_s=0.0)
    try:
        with pytest.raises(BackendError, match="frequency_penalty"):
            backend.generate(Prompt("x"), {"max_new_tokens": 2, "frequency_penalty": 0.5})
    finally:
        backend.close()
