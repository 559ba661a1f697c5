"""The engines and the prompt rules (canonicalization, layout, explain), the aiohttp app with its OpenAI and Anthropic
faces, the admin face (`admin/`), the Python face (`python/`), settings and the CLI.

Exported here: the Python face, `PromptCache` and what its decorated functions return.
"""

from prefixgate.proxy.python.decorator import AsyncCachedFunction, CachedFunction, GenerationOptions, Options, Prompt
from prefixgate.proxy.python.prompt_cache import PromptCache
from prefixgate.proxy.python.reply import AsyncReplyStream, Reply, ReplyStream, ReplyUsage
from prefixgate.proxy.python.targets import ServerError

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
