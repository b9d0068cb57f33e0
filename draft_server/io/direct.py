"""The server's same-host direct links (``protocol.direct``): the listener, connections that have yet
to present a token, and the links bound to a client.

Owns the link table. Touched only under the router's lock (its I/O thread, the idle engine's read,
a reply's send), but ``fds``, the links' descriptors, which the idle engine polls without the lock:
a tuple replaced whole on every change. A token is offered with each Welcome to a client on
transport "shm" or "cuda_ipc" and taken once, by the first connection that presents it within ``TOKEN_TTL_S``;
a connection that presents anything else, or nothing within ``PENDING_S``, is closed, and at most
``PENDING_MAX`` wait at once. A client's new link replaces its old one. Any error on a link closes
it: the client reads end-of-file and falls back to ZeroMQ, as this side does for its replies.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from protocol import direct

log = logging.getLogger("draft_server.io")

TOKEN_TTL_S = 30.0  # a Welcome's token is good this long
PENDING_S = 1.0  # a connection must present its token within this
PENDING_MAX = 64  # connections waiting to present one


@dataclass(eq=False)
class Link:
    link: direct.Link
    ident: bytes  # the client's routing id: replies to it go here
    owner: bytes  # whose sessions its messages touch (the router's owner key)


class DirectLinks:
    def __init__(self, gauge: Any = None) -> None:
        self.listener, self.name = direct.listen()
        self._gauge = gauge  # draft_server_direct_links
        self._tokens: dict[bytes, tuple[bytes, bytes, float]] = {}  # token -> (ident, owner, offered at)
        self._pending: dict[int, tuple[socket.socket, float]] = {}  # fd -> (connection, accepted at)
        self._by_ident: dict[bytes, Link] = {}
        self.links: tuple[Link, ...] = ()
        self.fds: tuple[int, ...] = ()  # the links' descriptors (read without the lock)

    def watch_fds(self) -> list[int]:
        """What the I/O thread polls for the links' housekeeping: the listener and waiting connections."""
        return [self.listener.fileno(), *self._pending]

    def offer(self, ident: bytes, owner: bytes) -> tuple[str, bytes]:
        """A token for the client ``ident`` (a Welcome's ``direct_token``) and the name to connect to."""
        now = time.monotonic()
        for t in [t for t, (_, _, at) in self._tokens.items() if now - at > TOKEN_TTL_S]:
            del self._tokens[t]
        token = os.urandom(direct.TOKEN_BYTES)
        self._tokens[token] = (ident, owner, now)
        return self.name, token

    def housekeep(self) -> bool:
        """Accept new connections and bind those that presented their token; close the stale ones.
        True when a link was bound (the engine's poll must learn its descriptor)."""
        now = time.monotonic()
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. out of descriptors: the client falls back to ZeroMQ
                log.warning("direct link: accept failed: %s", e)
                break
            if len(self._pending) >= PENDING_MAX:
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn.fileno()] = (conn, now)
        bound = False
        for fd, (conn, at) in list(self._pending.items()):
            try:
                token = conn.recv(direct.TOKEN_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                if now - at > PENDING_S:
                    del self._pending[fd]
                    conn.close()
                continue
            except OSError:
                token = b""
            del self._pending[fd]
            who = self._tokens.pop(token, None)
            if who is None:
                conn.close()  # not a token we gave (or one used already): no link
                continue
            ident, owner, _ = who
            old = self._by_ident.get(ident)
            if old is not None:
                self.drop(old)
            self._by_ident[ident] = Link(direct.Link(conn), ident, owner)
            bound = True
        if bound:
            self._changed()
        return bound

    def read(self, link: Link) -> list[bytes]:
        """The messages waiting on ``link``; a link that ended or failed is dropped."""
        msgs, alive = link.link.read()
        if not alive:
            self.drop(link)
        return msgs

    def send(self, ident: bytes, data: bytes) -> bool:
        """A header-only message to ``ident`` over its link; False: send it over ZeroMQ (no link, too
        large, its buffer full, or the link just broke)."""
        link = self._by_ident.get(ident)
        if link is None or len(data) > direct.MAX_MESSAGE:
            return False
        sent = link.link.send(data)
        if sent is None:
            self.drop(link)
            return False
        return sent

    def drop(self, link: Link) -> None:
        if self._by_ident.get(link.ident) is link:
            del self._by_ident[link.ident]
        link.link.close()
        self._changed()

    def _changed(self) -> None:
        self.links = tuple(self._by_ident.values())
        self.fds = tuple(link.link.fileno() for link in self.links)
        if self._gauge is not None:
            self._gauge.set(len(self.links))

    def close(self) -> None:
        for link in self.links:
            link.link.close()
        for conn, _ in self._pending.values():
            conn.close()
        self._by_ident.clear()
        self._pending.clear()
        self._changed()
        self.listener.close()
