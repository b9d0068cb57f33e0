"""Endpoint settings of a fleet (target_client.fleet.endpoints): lists and DNS names.

DNS is answered by a resolver function handed in (``socket.getaddrinfo``'s signature), so the
tests see exactly which names were looked up and what came back; one test resolves localhost
through the real resolver.
"""

from __future__ import annotations

import socket

import pytest

from target_client.fleet.endpoints import is_fleet, resolve, split


def fake_dns(table: dict[str, list[str]], asked: list[tuple[str, int]] | None = None):
    def resolver(host: str, port: int, type: int = 0):
        if asked is not None:
            asked.append((host, port))
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for ip in table[host]:
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            addr = (ip, port, 0, 0) if fam == socket.AF_INET6 else (ip, port)
            out.append((fam, socket.SOCK_STREAM, 6, "", addr))
        return out

    return resolver


def test_split_and_is_fleet():
    assert split("tcp://a:1") == ["tcp://a:1"]
    assert split(" tcp://a:1 , tcp://b:2,") == ["tcp://a:1", "tcp://b:2"]
    assert not is_fleet("tcp://127.0.0.1:5557")
    assert is_fleet("tcp://a:1,tcp://b:2")
    assert is_fleet("dns+tcp://draft-server.default.svc:5557")
    for bad in ("", " , ", "a:1", "tcp://a:1,b:2", "dns+tcp://name", "dns+tcp://:5557", "dns+tcp://n:99999"):
        with pytest.raises(ValueError):
            split(bad)


def test_resolve_expands_names_keeps_plain_endpoints_and_reports_failures():
    asked: list[tuple[str, int]] = []
    dns = fake_dns({"draft.svc": ["10.0.0.2", "10.0.0.1", "10.0.0.2"], "v6.svc": ["fd00::7"]}, asked)
    eps, errors = resolve(
        ["dns+tcp://draft.svc:5557", "tcp://static:1", "dns+tcp://v6.svc:6000", "dns+tcp://nowhere:1"], dns
    )
    assert eps == ["tcp://10.0.0.1:5557", "tcp://10.0.0.2:5557", "tcp://[fd00::7]:6000", "tcp://static:1"]
    assert len(errors) == 1 and errors[0].startswith("dns+tcp://nowhere:1")
    assert asked == [("draft.svc", 5557), ("v6.svc", 6000), ("nowhere", 1)]


def test_resolve_localhost_with_the_real_resolver():
    eps, errors = resolve(["dns+tcp://localhost:5557"])
    assert not errors and "tcp://127.0.0.1:5557" in eps
