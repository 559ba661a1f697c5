"""The admin dashboard: one self-contained page (`dashboard.html`, inline CSS and JS, nothing fetched from elsewhere).

The page holds no data. It asks for the admin key, keeps it in the tab's sessionStorage, and polls `/admin/cache`
and `/admin/cache/prefixes` with it; a `#key=...` fragment signs it in directly (the fragment never leaves the
browser, and the page removes it from the address bar).
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from aiohttp import web

PAGE = resources.files("prefixgate.proxy.admin").joinpath("dashboard.html").read_text(encoding="utf-8")


def _digest(tag: str) -> str:
    """Return the CSP hash source of the page's one inline `<tag>` block."""
    found = re.search(rf"<{tag}>(.*?)</{tag}>", PAGE, re.DOTALL)
    assert found is not None, f"dashboard.html has no <{tag}> block"
    return "'sha256-" + base64.b64encode(hashlib.sha256(found.group(1).encode()).digest()).decode() + "'"


# Only the page's own script and style run, and it talks only to this server: a value shown on the page that
# smuggled in markup could neither run nor send the admin key anywhere. Hashes rather than 'unsafe-inline' for that.
_HEADERS = {
    "Content-Security-Policy": (
        f"default-src 'none'; script-src {_digest('script')}; style-src {_digest('style')}; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


async def dashboard(request: web.Request) -> web.Response:
    """GET /admin/: the dashboard page."""
    return web.Response(text=PAGE, content_type="text/html", charset="utf-8", headers=_HEADERS)
