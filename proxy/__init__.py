"""The engine, canonicalization and layout, the aiohttp app, the admin endpoint, the decorator, the CLI.

Exported here: the Python face, `PromptCache` and what its decorated functions return.
"""

from prefixgate.proxy.decorator import AsyncCachedFunction, CachedFunction, GenerationOptions, Options, Prompt
from prefixgate.proxy.prompt_cache import PromptCache
from prefixgate.proxy.reply import AsyncReplyStream, Reply, ReplyStream, ReplyUsage
from prefixgate.proxy.targets import ServerError

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
