"""The exception tree: everything a user can cause is a `PrefixgateError`.

Each class also inherits the builtin exception whose meaning fits, so callers that know nothing of prefixgate
still catch it sensibly. Messages say what to change.
"""


class PrefixgateError(Exception):
    """Root of every error a user of prefixgate can cause."""


class ConfigError(PrefixgateError, ValueError):
    """A setting is missing, malformed or out of range."""


class UnknownPolicyError(ConfigError, KeyError):
    """A policy name is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StoreError(PrefixgateError):
    """The KV block store cannot do what was asked."""


class BlockMismatchError(StoreError, ValueError):
    """A block does not fit the store's block layout (shape, dtype or token count)."""


class ModelError(PrefixgateError):
    """A model cannot be found, loaded or used as asked."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model name or path does not resolve to a loadable model."""


class ModelStoppedError(ModelError):
    """The model thread stopped on a fault; nothing more runs until the server restarts."""


class UnsupportedModelError(ModelError):
    """A model kind whose KV cache prefixgate cannot restore as a plain prefix."""


class RequestError(PrefixgateError, ValueError):
    """A request asks for something the backend cannot serve; `param` names the field to change."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OverloadedError(PrefixgateError):
    """The server is at capacity and its wait queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ContextLengthError(RequestError):
    """The prompt (plus the requested tokens) does not fit the model's context."""


class DynamicPatternError(ConfigError):
    """A dynamic-content pattern setting has a bad name, or a regex that does not compile or matches empty text."""
