"""Addresses agents are told to call back on: this node's routable address, and whether an address
can be reached from outside this machine's private network.

Pure apart from `routable_address`, which asks the kernel which local interface would route to a
public address (a UDP socket is connected, nothing is sent). Used by pre-flight (warnings about
`gateway.advertise_url` and `rollout.result_host`), the gateway (`gateway.advertise_url=auto`) and
the rollout actors (`rollout.result_host=auto`).

Invariant: `routable_address()` never returns an empty string; when no interface routes outward it
falls back to the host name's address, then to 127.0.0.1, and `reach_warning` says so.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

AUTO = "auto"  # config value: this node's routable address
_PROBE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): connect() picks the outbound interface; no packet is sent


def routable_address() -> str:
    """The IPv4 address of this node's outbound interface (the one a route to the internet uses).

    Falls back to the address of the host name, then 127.0.0.1. Never raises.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(_PROBE)
            addr = s.getsockname()[0]
            if addr and addr != "0.0.0.0":
                return addr
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def listen_and_advertise(host: str) -> tuple[str, str | None]:
    """(interface to listen on, host to advertise or None for the listen address) of a configured
    host: "auto" and "0.0.0.0" listen on every interface and advertise this node's routable
    address; any other host is both."""
    if host in (AUTO, "0.0.0.0"):
        return "0.0.0.0", routable_address()
    return host, None


def host_of(url_or_host: str) -> str:
    """The host part of a URL (`http://10.0.0.5:8000/v1` -> `10.0.0.5`), or the argument itself."""
    if "://" in url_or_host:
        return urlsplit(url_or_host).hostname or ""
    return url_or_host


def reach_warning(url_or_host: str, what: str) -> str | None:
    """A warning when agents running in AgentCore Runtime could not reach `url_or_host`, else None.

    Loopback, link-local and unspecified addresses are reachable from this machine only; private
    (RFC 1918 / RFC 4193) addresses only from inside the VPC, i.e. an ACR runtime configured with
    VPC network mode and a security group that admits it. Host names are not resolved (their
    reachability is the DNS's business) and give no warning.
    """
    host = host_of(url_or_host)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None if host and host != "localhost" else f"{what}={url_or_host!r} is this machine only: agents in ACR cannot reach it"
    if ip.is_loopback or ip.is_unspecified or ip.is_link_local:
        return (f"{what}={url_or_host!r} is reachable from this machine only: agents running in AgentCore "
                "Runtime cannot call it (set it to an address they can reach; see docs/agents.md, 'Network path')")
    if ip.is_private:
        return (f"{what}={url_or_host!r} is a private address: agents in AgentCore Runtime reach it only when the "
                "runtime uses VPC network mode in this VPC and a security group admits the port "
                "(see docs/agents.md, 'Network path')")
    return None
