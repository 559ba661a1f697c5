"""The model runner: one forward pass of a causal LM over new tokens, extending a KV cache in place."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from prefixgate.errors import UnsupportedModelError

_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")  # newest name first


class ModelRunner:
    """Run forward passes of one model; call only from the thread that owns the model."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.device: torch.device = torch.device(model.device)
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed the forward arguments `past_key_values` (attention) and `cache_params` (state
        # space) to `cache`; the old names still work but warn, and go in 5.40. The signature says which one this
        # release takes; a version string would not cover backports or models with custom code.
        names = [name for name in _CACHE_ARGUMENTS if name in params]
        if not names:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward takes none of {', '.join(_CACHE_ARGUMENTS)}; "
                "prefixgate needs a causal LM that accepts a KV cache"
            )
        self.cache_argument = names[0]
        # Asking for the last position's logits only saves a [chunk, vocab] matrix per prefill chunk.
        self._keeps_last_logits = "logits_to_keep" in params

    def forward(self, token_ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Feed `token_ids` after what `cache` holds, extend it in place, and return the last position's logits."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # ids: [1, new]
        kwargs: dict[str, object] = {self.cache_argument: cache, "use_cache": True}
        if self._keeps_last_logits:
            kwargs["logits_to_keep"] = 1
        # Position ids are left to the model: it counts them from the cache length, and for models with special
        # position schemes (e.g. multimodal RoPE) its own rule is the right one.
        logits = self.model(input_ids=input_ids, **kwargs).logits  # logits: [1, kept, vocab]
        assert isinstance(logits, torch.Tensor)
        return logits[0, -1].float()  # logits: [vocab]
