"""proxy.admin_endpoint_hosts: the hosts an admin may add as replicas with POST /admin/endpoints
(the prober and every call send the backend's vLLM key to each endpoint of its pool). Unset: any.

Entries are host names, addresses or CIDR networks. Names are compared literally (case aside) and
never resolved: what a name resolves to can change between the check and the connection (DNS
rebinding), and a lookup would block the event loop; a name never matches a network. To allow a
network, list its addresses or CIDR. Anything odd (userinfo, backslashes, spaces before the path,
an address spelled other than dotted or bracketed) fails closed.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

from proxy.errors import EndpointHostForbidden

__all__ = ["EndpointHost", "check_endpoint_host"]


def _endpoint_host(entry: str) -> str:
    """A host name (lower case, as URLs compare it) or an address / CIDR network (normalised)."""
    entry = entry.strip().lower()
    try:
        return str(ipaddress.ip_network(entry, strict=False))
    except ValueError:
        pass
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", entry):
        raise ValueError(f"{entry!r} is neither a host name nor an address or CIDR network (e.g. 10.0.0.0/8)")
    return entry


EndpointHost = Annotated[str, AfterValidator(_endpoint_host)]


def check_endpoint_host(url: str, allowed: list[str] | None) -> None:
    """Refuse an endpoint URL whose host is not in `allowed` (None: any host)."""
    if allowed is None:
        return
    authority = url.split("://", 1)[-1].split("/", 1)[0]
    # Userinfo, backslashes or spaces are where URL parsers disagree on the host: refused outright.
    if any(c in authority for c in "@\\ \t") or not authority.isprintable():
        raise EndpointHostForbidden(f"endpoint {url!r}: credentials or unusual characters before the path are "
                                    "not accepted when proxy.admin_endpoint_hosts is set", field="add")
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        host = ""
    if not _host_allowed(host, allowed):
        raise EndpointHostForbidden(f"endpoint {url!r}: host {host!r} is not in proxy.admin_endpoint_hosts "
                                    f"({', '.join(allowed)})", field="add")


def _host_allowed(host: str, allowed: list[str]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host in allowed  # a name: only the same name, never through a network
    return any(address in network for network in _networks(allowed))


def _networks(allowed: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for entry in allowed:
        try:
            networks.append(ipaddress.ip_network(entry))
        except ValueError:
            continue  # a host name
    return networks
