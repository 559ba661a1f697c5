"""URLs as logs, errors and stats may show them: without the passwords they carry."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


def masked_url(url: str) -> str:
    """Return `url` with any password in it replaced by `***`, fit for logs and stats."""
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = parts.query
    fields = parse_qsl(query, keep_blank_values=True)
    if any(name == "password" for name, _ in fields):  # redis-py also takes `?password=`
        query = urlencode([(name, "***" if name == "password" else value) for name, value in fields], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))
