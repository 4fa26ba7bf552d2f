"""Who may change what the proxy trusts or pays, and which hosts it may be told to trust.

Two keys (proxy.api_key_env, proxy.admin_api_key_env), and scoring keys limited to some runs
(proxy.run_keys: a `scorer` whose writes proxy/http/run_access.py checks). The Edge classifies each
request's bearer token once (`Credentials.caller_of`) and notes the role, and a limited key's runs,
in the request's scope; `AdminOnly`, the one
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

from proxy.config import RunScope
from proxy.errors import AdminDisabled, AdminKeyRequired, Unauthorized

__all__ = ["ADMIN_403", "AdminOnly", "Credentials", "Role", "require_admin"]

Role = Literal["admin", "scorer"]
ADMIN_403 = ("admin_disabled: no proxy.admin_api_key_env is configured (these routes are off); "
             "admin_key_required: the scoring key was sent, these routes take only the admin key")


@dataclass(frozen=True)
class Credentials:
    scoring_key: str | None = None
    admin_key: str | None = None
    run_keys: tuple[tuple[str, RunScope], ...] = ()  # (key, the runs it may write)

    def __post_init__(self) -> None:
        if self.admin_key is not None and self.admin_key == self.scoring_key:
            raise ValueError("the admin key equals the scoring key: every scoring client would be an admin")
        values = [k for k in (self.scoring_key, self.admin_key, *(k for k, _ in self.run_keys)) if k is not None]
        if len(set(values)) != len(values):
            raise ValueError("two of the keys (scoring, admin, run keys) have one value: one key would hold two "
                             "sets of rights")

    @property
    def scoring_required(self) -> bool:
        """Every route but /health needs a valid key (any one): a limited key means nothing if no key is needed."""
        return self.scoring_key is not None or bool(self.run_keys)

    def caller_of(self, authorization: bytes) -> tuple[Role | None, RunScope | None]:
        """The role of whichever key matches, and the runs of a limited one (None: unlimited). Every key
        is compared, each in constant time, so the time taken says nothing of which one matched."""
        admin = self.admin_key is not None and hmac.compare_digest(authorization, _bearer(self.admin_key))
        scorer = self.scoring_key is not None and hmac.compare_digest(authorization, _bearer(self.scoring_key))
        limited = [scope for key, scope in self.run_keys if hmac.compare_digest(authorization, _bearer(key))]
        if admin or scorer:
            return ("admin" if admin else "scorer"), None
        return ("scorer", limited[0]) if limited else (None, None)


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
