"""The Anthropic face: the Messages API (`api` its shapes, `routes` its handlers)."""
