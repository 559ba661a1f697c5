"""Fixtures for backend tests: the tiny tokenizer and Llama, and a factory of HFBackends closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, StepRecord
from tests.backends.tiny_models import make_llama, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """Return the tiny tokenizer."""
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """Return the tiny random-weight Llama (seed 0)."""
    return make_llama(tokenizer)


BackendFactory = Callable[..., HFBackend]


@pytest.fixture
def make_backend(tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel) -> Iterator[BackendFactory]:
    """Build HFBackends (tiny Llama, block size 8, chunks of 16 by default) and close them after the test."""
    made: list[HFBackend] = []

    def build(model: PreTrainedModel | None = None, **kwargs: Any) -> HFBackend:
        options: dict[str, Any] = {"model_id": "tiny-llama", "block_size": 8, "prefill_chunk_tokens": 16}
        options.update(kwargs)
        backend = HFBackend(model if model is not None else llama, tokenizer, **options)
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()


@pytest.fixture
def steps() -> list[StepRecord]:
    """Collect the step records of a backend built with `on_step=steps.append`."""
    return []
