"""Shared fixtures: tiny random-weight models saved as HF folders, the default model's tokenizer."""

from __future__ import annotations

import os

import pytest

from tests.random_llama import save_random_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that load the default model's files (its tokenizer, or a model built from it): a test that asks
# for one is marked `model` and left out of `make test-fast`.
MODEL_FIXTURES = frozenset(
    {
        "default_model_dir",
        "default_tokenizer",
        "tiny_model_dir",
        "tokenizer",  # test_constrained, test_model_loader: SmolLM2's tokenizer
        "converted",  # test_model_loader: the converted default model
        "gguf_reference",
        "gguf_tensors",  # test_quantization: the GGUF's blocks
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from runtime.models.model_loader import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from runtime.models.model_loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> str:
    """A 2-layer Llama with a 512-token vocabulary (ids < 512 of the default tokenizer, which it ships)
    and weights scaled up so greedy choices are far from ties (outputs stable under round-off)."""
    return save_random_llama(
        tmp_path_factory.mktemp("tiny_llama"),
        default_tokenizer,
        seed=0,
        std=0.3,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
