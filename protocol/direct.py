"""Same-host direct links: header-only messages over a Unix SOCK_SEQPACKET socket beside ZeroMQ.

Owns what both ends of a direct link share: the socket kind, the abstract-namespace name the
server listens on, the token a client presents, the largest message and the non-blocking reads.

Why: a ZeroMQ message crosses two I/O threads (the sender's and the receiver's libzmq threads),
so a round trip wakes four threads more than the two that do the work; on a 2-core VM a bare
ZeroMQ echo of 600 bytes takes 138-155 us against 60 us over a SOCK_SEQPACKET pair
(``draft_tools/bench/direct_echo.py``). A client on transport "shm" or "cuda_ipc" (same host: its
rows are in a shared-memory ring or a device buffer the server mapped) is offered a link in its
Welcome (``Welcome.direct``, the listening socket's name, and ``Welcome.direct_token``, 16 random
bytes). It connects, sends the
token as its first message, and from then on sends every header-only message but Hello (Steps
whose rows lie in the ring, Frees, Pings) over the link; the server answers a connection with a
link over it. One datagram is one message's header (msgpack): no payload frames; a message with
payload frames, or one larger than ``MAX_MESSAGE``, goes over ZeroMQ as before, and so does every
message when the link is down (either side closes it on any error: the other reads end-of-file and
falls back). Replies are matched by call id, so a message on either path is answered on either.

The name is in Linux's abstract namespace (no file to clean up after a crash; reachable within the
network namespace), so the token, sent in the Welcome over the (possibly CurveZMQ) ZeroMQ
connection, is what binds a link to its client: a connection that presents another is closed.
"""

from __future__ import annotations

import contextlib
import os
import socket

MAX_MESSAGE = 1 << 16  # bytes: a larger header goes over ZeroMQ (64 sessions' Step: about 3 KB)
TOKEN_BYTES = 16
_FAMILY, _KIND = socket.AF_UNIX, socket.SOCK_SEQPACKET


def available() -> bool:
    """Whether this platform has abstract-namespace SOCK_SEQPACKET Unix sockets (Linux)."""
    return hasattr(socket, "AF_UNIX") and hasattr(socket, "SOCK_SEQPACKET") and os.uname().sysname == "Linux"


def listen(backlog: int = 64) -> tuple[socket.socket, str]:
    """A non-blocking listening socket under a fresh abstract name; (socket, name as Welcome gives it)."""
    name = f"draft-direct-{os.getpid()}-{os.urandom(6).hex()}"
    s = socket.socket(_FAMILY, _KIND | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        s.bind("\0" + name)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s, name


class Link:
    """One end of a link: the non-blocking socket and the buffer its messages are read into (a link is
    read by one thread at a time: whoever holds its owner's lock)."""

    __slots__ = ("_buf", "_view", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(MAX_MESSAGE)
        self._view = memoryview(self._buf)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, limit: int = 1024) -> tuple[list[bytes], bool]:
        """The messages waiting (at most ``limit``), and whether the link is still open (False: end
        of file or an error; the caller closes it)."""
        out: list[bytes] = []
        recv_into, view = self.sock.recv_into, self._view
        try:
            for _ in range(limit):
                n = recv_into(view)
                if not n:  # the peer closed (a datagram is never empty: every message has a header)
                    return out, False
                out.append(view[:n].tobytes())
        except (BlockingIOError, InterruptedError):
            return out, True
        except OSError:
            return out, False
        return out, True

    def send(self, data: bytes) -> bool | None:
        """One message: True sent, False not now (its buffer is full: send it the other way), None the
        link is broken (the caller closes it and sends the other way)."""
        try:
            return self.sock.send(data) == len(data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return None

    def shutdown(self) -> None:
        """Break the link (the peer reads end-of-file; this end's next read or send finds it broken)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def connect(name: str, token: bytes, timeout_s: float = 0.2) -> Link:
    """The client's end: connected to ``name``, the token sent, non-blocking (OSError if it cannot)."""
    s = socket.socket(_FAMILY, _KIND | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect("\0" + name)
        s.send(token)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return Link(s)
