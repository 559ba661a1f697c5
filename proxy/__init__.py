"""The engines and the prompt rules (canonicalization, layout, explain), the aiohttp app, one package per face (OpenAI's
APIs in `openai/`, Anthropic's in `anthropic/`, the admin endpoint in `admin/`, the Python face in `python/`), settings
and the CLI.

Exported here: the Python face, `PromptCache` and what its decorated functions return.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixgate.proxy.python.decorator import (
        AsyncCachedFunction,
        CachedFunction,
        GenerationOptions,
        Options,
        Prompt,
    )
    from prefixgate.proxy.python.prompt_cache import PromptCache
    from prefixgate.proxy.python.reply import AsyncReplyStream, Reply, ReplyStream, ReplyUsage
    from prefixgate.proxy.python.targets import ServerError

# Where each export lives; imported on first use, so `prefixgate --help` (whose module is in this package) does not
# wait seconds for torch and transformers.
_EXPORTS = {
    "AsyncCachedFunction": "decorator",
    "CachedFunction": "decorator",
    "GenerationOptions": "decorator",
    "Options": "decorator",
    "Prompt": "decorator",
    "PromptCache": "prompt_cache",
    "AsyncReplyStream": "reply",
    "Reply": "reply",
    "ReplyStream": "reply",
    "ReplyUsage": "reply",
    "ServerError": "targets",
}
__all__ = [
    "AsyncCachedFunction",
    "AsyncReplyStream",
    "CachedFunction",
    "GenerationOptions",
    "Options",
    "Prompt",
    "PromptCache",
    "Reply",
    "ReplyStream",
    "ReplyUsage",
    "ServerError",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'prefixgate.proxy' has no attribute {name!r}")
    module = importlib.import_module(f"prefixgate.proxy.python.{_EXPORTS[name]}")
    return getattr(module, name)
