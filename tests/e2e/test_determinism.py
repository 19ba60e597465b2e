"""Greedy output is a function of the prompt alone: not of whether (part of) the prompt's KV came from the
radix cache, not of which other requests share the batch, not of chunked prefill. Seeded sampling repeats.

Reference: each prompt alone on an empty cache. Then the same prompts one by one with partial prefix hits, in
one batched /generate call with full hits, and after a flush as concurrent requests mixed with sampled ones.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
_rng = random.Random(7)
_WORDS = "river stone cloud ledger signal harvest lantern orbit canyon meadow cipher".split()
SYSTEM = "You are a terse assistant. Context: " + " ".join(_rng.choice(_WORDS) for _ in range(120)) + "\n"
PROMPTS = [
    SYSTEM + "Question: what is the first word of the context?",
    SYSTEM + "Question: name a word that appears twice.",
    SYSTEM + "Summarize the context in five words.",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning",
    "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n",
    # longer than the default --chunked-prefill-size (512): prefilled in chunks when cold
    "Story: " + " ".join(_rng.choice(_WORDS) for _ in range(550)) + "\nThe end. Moral:",
]


def _gen(url: str, prompt, params: dict) -> dict | list:
    r = requests.post(url + "/generate", json={"text": prompt, "sampling_params": params}, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def _flush(url: str) -> None:
    r = requests.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def reference(server_url) -> list[dict]:
    """Each prompt alone, on an empty cache (no prefix hit at all)."""
    refs = []
    for p in PROMPTS:
        _flush(server_url)
        out = _gen(server_url, p, GREEDY)
        assert out["meta_info"]["cached_tokens"] == 0
        refs.append(out)
    assert max(o["meta_info"]["prompt_tokens"] for o in refs) > 512  # the chunked-prefill case is real
    return refs


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_prefix_hits_do_not_change_greedy_output(server_url, reference):
    _flush(server_url)
    partial = [_gen(server_url, p, GREEDY) for p in PROMPTS]  # prompts 2 and 3 reuse the shared SYSTEM prefix
    hits = [(o["meta_info"]["cached_tokens"], o["meta_info"]["prompt_tokens"]) for o in partial]
    assert any(0 < c < n - 1 for c, n in hits[1:3]), hits
    assert _ids(partial) == _ids(reference)
    # Warm cache, one batched call: every prompt but its last token comes from the cache.
    full = _gen(server_url, PROMPTS, GREEDY)
    assert all(o["meta_info"]["cached_tokens"] >= o["meta_info"]["prompt_tokens"] - 1 for o in full)
    assert _ids(full) == _ids(reference)
    assert [o["text"] for o in full] == [o["text"] for o in reference]


def test_batch_composition_does_not_change_greedy_output(server_url, reference):
    # Cold again, as concurrent requests arriving in a shuffled order, mixed with sampled requests of other
    # lengths (so prefill and decode batches differ from the reference's).
    _flush(server_url)
    order = list(range(len(PROMPTS)))
    random.Random(11).shuffle(order)
    sampled = {"max_new_tokens": 2 * NEW, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    jobs = [(PROMPTS[i], GREEDY) for i in order] + [("Once upon a time", sampled), (PROMPTS[0], sampled)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _gen(server_url, *job), jobs))
    mixed = {i: outs[k]["output_ids"] for k, i in enumerate(order)}
    assert [mixed[i] for i in range(len(PROMPTS))] == _ids(reference)


def test_seeded_sampling_repeats_alone_and_in_a_batch(server_url):
    params = {"max_new_tokens": NEW, "temperature": 0.9, "top_k": 50, "seed": 1234, "ignore_eos": True}
    first = _gen(server_url, PROMPTS[3], params)
    again = _gen(server_url, PROMPTS[3], params)
    assert first["output_ids"] == again["output_ids"]
    in_batch = _gen(server_url, [PROMPTS[4], PROMPTS[3], PROMPTS[5]], [GREEDY, params, GREEDY])
    assert in_batch[1]["output_ids"] == first["output_ids"]
    other_seed = _gen(server_url, PROMPTS[3], {**params, "seed": 4321})
    assert other_seed["output_ids"] != first["output_ids"]  # the seed matters (8 tokens at T=0.9)
