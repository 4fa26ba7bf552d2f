"""Endpoints added and removed while the proxy serves: `GET` and `POST /admin/endpoints`.

A launcher that places vLLM replicas (on a Ray cluster, say) tells the running proxy which
endpoint URLs exist as replicas die, restart and get added. An HTTP route rather than a watched
file: the launcher may run on another machine than the proxy, and the answer says at once what
changed, or why nothing did (a typed 422 or 404, checked before anything changes). Removing
drains (proxy/upstream/pool.py): the endpoint takes no new call, the calls in flight on it end normally,
and it leaves the pool when the last one does. Changes live in memory: a restart serves the
config's endpoints again.

These routes change what the proxy trusts (the prober sends the backend's vLLM key to every
endpoint in its pool), so they take only the admin key (proxy/http/admin_access.py): 403
`admin_disabled` without proxy.admin_api_key_env, 403 `admin_key_required` for the scoring key,
401 for none; an added host outside proxy.admin_endpoint_hosts is 403 `endpoint_host_forbidden`.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from proxy.config import ENDPOINT_URL_PATTERN, endpoint_url, split_credentials
from proxy.config.endpoint_hosts import check_endpoint_host
from proxy.errors import InvalidRequest
from proxy.http.admin_access import ADMIN_403, AdminOnly
from proxy.http.error_answers import error_answers
from proxy.http.json_body import JSONBodyRoute
from proxy.metrics import Metrics
from proxy.upstream.backends import Backend, BackendRegistry
from proxy.upstream.health import Prober

__all__ = ["ChangeAnswer", "EndpointChange", "EndpointsAnswer", "router"]

log = logging.getLogger("vlm_reward_proxy")

MAX_URLS, MAX_URL_CHARS = 256, 2048
EndpointUrl = Annotated[str, StringConstraints(max_length=MAX_URL_CHARS), AfterValidator(endpoint_url), WithJsonSchema(
    {"type": "string", "pattern": ENDPOINT_URL_PATTERN, "maxLength": MAX_URL_CHARS,
     "description": "an OpenAI base URL, as in backends.<name>.endpoints (e.g. http://10.0.0.7:8001/v1)"})]


_ADMIN_MEANINGS = {401: "missing or wrong bearer token (these routes take the admin key)",
                   403: ADMIN_403 + "; endpoint_host_forbidden (POST): an added host outside "
                        "proxy.admin_endpoint_hosts",
                   503: "the proxy is shutting down (Retry-After)",
                   404: "unknown backend (the message lists them)",
                   422: "a bad field; `field` names it (a URL that is not an endpoint, one both added and removed)"}


router = APIRouter(prefix="/admin", dependencies=[AdminOnly], route_class=JSONBodyRoute)


class EndpointView(BaseModel):
    url: str
    state: Literal["closed", "open", "half_open"] = Field(description="the endpoint's circuit")
    in_flight: int = Field(description="calls on it now")
    draining: bool = Field(description="removed: takes no new call, leaves when the calls in flight end")


class EndpointsAnswer(BaseModel):
    backends: dict[str, list[EndpointView]]


class EndpointChange(BaseModel):
    """Endpoints to add to and remove from one backend, checked as a whole before any change."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(description="a backend's name, served model name or alias")
    add: list[EndpointUrl] = Field(default_factory=list, max_length=MAX_URLS,
                                   description="put in rotation: new, or draining (the drain is cancelled)")
    remove: list[EndpointUrl] = Field(default_factory=list, max_length=MAX_URLS,
                                      description="endpoints of the backend to drain and remove")


class ChangeAnswer(BaseModel):
    backend: str
    added: list[str]
    removed: list[str] = Field(description="draining now, or already gone (nothing was in flight)")
    unchanged: list[str] = Field(description="added while in rotation, or removed while draining")
    endpoints: list[EndpointView] = Field(description="the backend's endpoints after the change")


def endpoint_views(backend: Backend) -> list[dict[str, Any]]:
    return [{"url": e.base_url, "state": e.state(), "in_flight": e.in_flight, "draining": e.draining}
            for e in backend.pool.endpoints]


@router.get("/endpoints", response_model=EndpointsAnswer,
            responses=error_answers(401, 403, 500, 503, meanings=_ADMIN_MEANINGS))
async def list_endpoints(request: Request) -> dict[str, Any]:
    """Every backend's endpoints now (those draining included)."""
    registry: BackendRegistry = request.app.state.services.registry
    return {"backends": {b.name: endpoint_views(b) for b in registry.backends.values()}}


@router.post("/endpoints", response_model=ChangeAnswer,
             responses=error_answers(401, 403, 404, 422, 500, 503, meanings=_ADMIN_MEANINGS))
async def change_endpoints(body: EndpointChange, request: Request) -> dict[str, Any]:
    """Add and remove one backend's endpoints; removing drains (calls in flight end normally)."""
    backend = request.app.state.services.registry.resolve(body.backend, kind=None)
    request.state.backend = backend.name  # the request counter's label
    add, remove = list(dict.fromkeys(body.add)), list(dict.fromkeys(body.remove))  # in order, once each
    both = [url for url in add if url in remove]
    if both:
        raise InvalidRequest(f"both added and removed: {', '.join(split_credentials(u)[0] for u in both)}",
                             field="remove")
    for url in add:
        if backend.pool.find(url) is None:  # new to the pool: a host the admin may add (config's are trusted)
            check_endpoint_host(url, request.app.state.settings.proxy.admin_endpoint_hosts)
    unknown = [split_credentials(url)[0] for url in remove if backend.pool.find(url) is None]
    if unknown:
        raise InvalidRequest(f"not an endpoint of backend {backend.name!r}: {', '.join(unknown)}; its endpoints: "
                             f"{', '.join(e.base_url for e in backend.pool.endpoints) or 'none'}", field="remove")
    added, removed, unchanged = [], [], []
    prober: Prober = request.app.state.prober
    for url in add:
        fresh = backend.pool.find(url) is None
        name = split_credentials(url)[0]  # what the pool, the answer and the log call it
        (added if backend.pool.add(url) else unchanged).append(name)
        if fresh:
            prober.forget(backend.name, name)  # not probed yet (a result of an earlier one is stale)
    for url in remove:
        (removed if backend.pool.remove(url) else unchanged).append(split_credentials(url)[0])
    prober.prune()
    metrics: Metrics = request.app.state.services.metrics
    metrics.endpoint_changes.labels(backend.name, "added").inc(len(added))
    metrics.endpoint_changes.labels(backend.name, "removed").inc(len(removed))
    metrics.observe_endpoints(backend.name, backend.pool.endpoints)
    endpoints = endpoint_views(backend)
    if added or removed:
        log.info("endpoints of backend %r changed at run time: added %s, removed %s (draining until their calls "
                 "end); now %s", backend.name, added, removed,
                 [e["url"] + (" (draining)" if e["draining"] else "") for e in endpoints])
    return {"backend": backend.name, "added": added, "removed": removed, "unchanged": unchanged,
            "endpoints": endpoints}
