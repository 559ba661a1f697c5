"""prefixgate: a prompt-caching proxy that reuses the attention KV cache of shared prompt prefixes.

The subpackages `prefixgate.proxy`, `prefixgate.backends`, `prefixgate.store` and `prefixgate.policies` live in
the repository's top-level folders of the same names; this package holds what they all share: the version, the
exception tree, how torch's CPU threads are shared out (`prefixgate.threads`), and URLs shown without their
passwords (`prefixgate.urls`).
"""

from prefixgate.errors import PrefixgateError

__all__ = ["PrefixgateError", "__version__"]
__version__ = "0.1.0"
