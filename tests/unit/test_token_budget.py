"""`check_token_budget`: the one prompt/context/KV-pool limit every layer applies, with one message."""

from __future__ import annotations

import pytest

from runtime.sampling_params import TokenBudgetError, check_token_budget


def test_explicit_budget_fits_up_to_the_context_exactly():
    assert check_token_budget(10, 22, 32) == 22
    assert check_token_budget(32, 0, 32) == 0  # prefill-only of a full-context prompt


def test_unset_max_new_tokens_takes_the_rest_of_the_context():
    assert check_token_budget(10, None, 32) == 22
    assert check_token_budget(31, None, 32) == 1


def test_past_context_names_the_numbers():
    with pytest.raises(TokenBudgetError) as e:
        check_token_budget(10, 23, 32)
    assert str(e.value) == "the prompt (10 tokens) + max_new_tokens (23) exceeds the context length (32)"
    assert (e.value.prompt_len, e.value.max_new_tokens, e.value.limit) == (10, 23, 32)
    assert isinstance(e.value, ValueError)


def test_unset_max_new_tokens_needs_room_for_one_token():
    with pytest.raises(TokenBudgetError) as e:
        check_token_budget(32, None, 32)
    assert str(e.value) == (
        "the prompt (32 tokens) + max_new_tokens (at least 1) exceeds the context length (32)"
    )


def test_empty_prompt():
    with pytest.raises(TokenBudgetError, match=r"^the prompt is empty \(no tokens\)$"):
        check_token_budget(0, 4, 32)


def test_kv_pool_bound_after_the_context_bound():
    assert check_token_budget(10, 6, 32, kv_pool_size=16) == 6
    with pytest.raises(TokenBudgetError) as e:
        check_token_budget(10, 7, 32, kv_pool_size=16)
    assert str(e.value) == "the prompt (10 tokens) + max_new_tokens (7) needs 17 KV slots; the pool has 16"
    assert e.value.limit == 16
    # The unset default is resolved from the context, then bounded by the pool.
    with pytest.raises(TokenBudgetError, match="needs 32 KV slots; the pool has 16"):
        check_token_budget(10, None, 32, kv_pool_size=16)
