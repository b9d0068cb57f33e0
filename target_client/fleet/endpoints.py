"""Which draft servers an endpoint setting names: a list, or DNS names that resolve to many.

Owns the endpoint syntax of a fleet and its resolution; no sockets of its own, no threads.
A setting is one item or a comma-separated list of items; an item is either a ZeroMQ endpoint
(``tcp://host:port``, ``ipc://path``), taken as it is, or ``dns+tcp://name:port``: every
address ``name`` resolves to (a Kubernetes headless Service gives one per ready pod) becomes
``tcp://address:port``. ``resolve`` is called at start and then periodically by the fleet's own
thread, never inside a step (``getaddrinfo`` blocks).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

DNS_SCHEME = "dns+tcp://"

Resolver = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's signature


def split(setting: str) -> list[str]:
    """The items of an endpoint setting (ValueError for an empty one or an item without a scheme)."""
    items = [x.strip() for x in setting.split(",") if x.strip()]
    if not items:
        raise ValueError(f"no endpoint in {setting!r}")
    for item in items:
        if "://" not in item:
            raise ValueError(f"endpoint {item!r} has no scheme: want tcp://host:port or dns+tcp://name:port")
        if item.startswith(DNS_SCHEME):
            _host_port(item)
    return items


def is_fleet(setting: str) -> bool:
    """Whether ``setting`` names several servers or a DNS name (anything but one plain endpoint)."""
    items = split(setting)
    return len(items) > 1 or items[0].startswith(DNS_SCHEME)


def _host_port(item: str) -> tuple[str, int]:
    rest = item[len(DNS_SCHEME) :]
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{item!r}: want dns+tcp://name:port")
    return host, int(port)


def resolve(items: list[str], resolver: Resolver = socket.getaddrinfo) -> tuple[list[str], list[str]]:
    """(the sorted ZeroMQ endpoints ``items`` name now, one error line per name that did not resolve)."""
    out: set[str] = set()
    errors: list[str] = []
    for item in items:
        if not item.startswith(DNS_SCHEME):
            out.add(item)
            continue
        host, port = _host_port(item)
        try:
            infos = resolver(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            errors.append(f"{item}: {exc}")
            continue
        for family, *_rest, addr in infos:
            ip = addr[0]
            out.add(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}")
    return sorted(out), errors
