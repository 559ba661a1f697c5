"""The admin face: the /admin routes (inspect, evict, flush, warm and explain the cache), their request bodies, the
cache report, and the dashboard page."""

from prefixgate.proxy.admin.routes import add_admin

__all__ = ["add_admin"]
