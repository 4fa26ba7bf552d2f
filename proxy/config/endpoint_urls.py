"""What an endpoint URL looks like (config and POST /admin/endpoints; the API document states it),
and the name the proxy knows it by: without the credentials a configured URL may carry."""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["ENDPOINT_URL_PATTERN", "endpoint_url", "split_credentials"]

ENDPOINT_URL_PATTERN = r"^https?://[^/]"


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """(the URL without its userinfo, (user, password) or None). The pool keeps the first as the
    endpoint's name, which answers, errors, metrics, logs and the audit log show: credentials
    written in a configured URL (`http://user:pass@host`) go to that server and nowhere else.
    Plain string work, as URL parsers split the authority (at its last "@"): it never raises, for
    a URL any caller sent (POST /admin/endpoints) as for a configured one."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:cut].rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    return f"{scheme}://{host}{rest[cut:]}", (unquote(user), unquote(password))


def endpoint_url(url: str) -> str:
    """An endpoint's OpenAI base URL as the pool keeps it (no trailing slash), or ValueError."""
    if not re.search(ENDPOINT_URL_PATTERN, url):
        raise ValueError(f"endpoint {url!r} must start with http:// or https:// and a host")
    return url.rstrip("/")
