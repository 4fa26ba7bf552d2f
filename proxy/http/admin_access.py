"""Who may change what the proxy trusts or pays, and which hosts it may be told to trust.

Two keys (proxy.api_key_env, proxy.admin_api_key_env). The Edge classifies each request's bearer
token once (`Credentials.role_of`) and notes the role in the request's scope; `AdminOnly`, the one
dependency of every route that changes what the proxy trusts or pays (`/admin/*`, `POST
/progress/references`, and any such route later), turns the role into an answer:

    no admin key configured      403 admin_disabled       (the routes are off)
    the admin key                passes                   (it may also score: admin is a superset)
    the scoring key              403 admin_key_required   (a scorer is not an admin)
    no token, or a wrong one     401 unauthorized

Which hosts an admin may add as replicas (proxy.admin_endpoint_hosts) is proxy/config/endpoint_hosts.py.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Literal

from fastapi import Depends, Request

from proxy.errors import AdminDisabled, AdminKeyRequired, Unauthorized

__all__ = ["ADMIN_403", "AdminOnly", "Credentials", "Role", "require_admin"]

Role = Literal["admin", "scorer"]
ADMIN_403 = ("admin_disabled: no proxy.admin_api_key_env is configured (these routes are off); "
             "admin_key_required: the scoring key was sent, these routes take only the admin key")


@dataclass(frozen=True)
class Credentials:
    scoring_key: str | None = None
    admin_key: str | None = None

    def __post_init__(self) -> None:
        if self.admin_key is not None and self.admin_key == self.scoring_key:
            raise ValueError("the admin key equals the scoring key: every scoring client would be an admin")

    @property
    def scoring_required(self) -> bool:
        """Every route but /health needs a valid key (either one)."""
        return self.scoring_key is not None

    def role_of(self, authorization: bytes) -> Role | None:
        """Both keys compared in constant time, whichever matches."""
        admin = self.admin_key is not None and hmac.compare_digest(authorization, _bearer(self.admin_key))
        scorer = self.scoring_key is not None and hmac.compare_digest(authorization, _bearer(self.scoring_key))
        return "admin" if admin else ("scorer" if scorer else None)


def _bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


async def require_admin(request: Request) -> None:
    """The dependency of every route that changes what the proxy trusts or pays."""
    if request.app.state.settings.proxy.admin_api_key_env is None:
        raise AdminDisabled("this route changes what the proxy trusts or pays: it needs proxy.admin_api_key_env "
                            "(an admin key, other than the scoring key) and is off without one")
    role = request.scope.get("state", {}).get("role")
    if role == "scorer":
        raise AdminKeyRequired("this route takes only the admin key (proxy.admin_api_key_env), not the scoring key")
    if role != "admin":
        raise Unauthorized("missing or wrong bearer token (this route takes the admin key)")


AdminOnly = Depends(require_admin)
