"""``WakePipe``: the self-pipe both sides' threads ring to end another thread's ``select.poll``;
``repoll``: a poll's descriptors changed to a new set.

One byte written ends the poll that watches ``fd``; a full pipe means a wake-up is pending already,
so a ring never blocks and never fails. ``close`` takes the same lock a ring writes under, so a late
ring never writes into a closed (or reused) descriptor. Used by the server's I/O thread and engine
and by the client's I/O loop (its thread, and a caller that watches the socket itself).
"""

from __future__ import annotations

import os
import select
import threading


def repoll(poller: select.poll, polled: set[int], want: set[int]) -> set[int]:
    """Make ``poller`` watch exactly ``want`` (for input) where it watched ``polled``; returns ``want``."""
    if want != polled:
        for fd in polled - want:
            poller.unregister(fd)
        for fd in want - polled:
            poller.register(fd, select.POLLIN)
    return want


class WakePipe:
    __slots__ = ("_lock", "_w", "fd")

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()  # held for one write, or for closing

    def ring(self) -> None:
        """Any thread: end the watcher's poll (now, or its next one)."""
        with self._lock:
            if self._w < 0:
                return  # closed
            try:
                os.write(self._w, b"\0")
            except OSError:  # full: a wake-up is pending already
                pass

    def drain(self) -> bool:
        """The watcher: take every pending byte; whether there was any."""
        got = False
        try:
            while os.read(self.fd, 4096):
                got = True
        except OSError:  # empty (BlockingIOError), or closed
            pass
        return got

    def close(self) -> None:
        with self._lock:
            if self._w < 0:
                return
            fds, self._w = (self.fd, self._w), -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
