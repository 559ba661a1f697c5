"""The attention function prefixgate runs models with: transformers' SDPA, minus a copy on the CPU.

For grouped-query attention with a mask (every prefill chunk and every cached-prefix step), transformers repeats
K and V once per query group before calling SDPA, unless it knows the kernel handles the groups itself. PyTorch's
CPU SDPA does, so on a CPU the repeat only copies: for SmolLM2 (3 KV heads, 9 query heads) at 4k tokens of context
it writes about 570 MB per forward pass and costs a quarter of the step. Elsewhere (CUDA) masked GQA would leave the
fast kernels, so the stock path stays.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "prefixgate_sdpa"


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Compute attention as SDPA does, letting the CPU kernel expand grouped K and V itself."""
    plain = not kwargs.get("softcap") and kwargs.get("position_bias") is None and not kwargs.get("output_attentions")
    if (
        query.device.type == "cpu"
        and attention_mask is not None
        and plain
        and getattr(module, "num_key_value_groups", 1) > 1
    ):
        # query: [batch, heads, q, head_dim]; key, value: [batch, kv_heads, kv, head_dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None  # out: [batch, q, heads, head_dim]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


AttentionInterface.register(NAME, attention)
# transformers builds masks by attention name, and builds none for names it does not know: the masks are SDPA's.
AttentionMaskInterface.register(NAME, sdpa_mask)
