"""The CUDA IPC buffer of transport "cuda_ipc": its naming, region layout, host identity and refusals.

Owns what both sides must agree on about a client's device buffer, and nothing that needs torch
(the client's side, which exports it, is ``target_client.cuda.ipc``; the server's, which imports
it, is ``draft_server.io.cuda_ipc``). No sockets, no threads.

The buffer: ``nbytes`` of device memory on the client's GPU, exported once with CUDA IPC
(``CudaIpcAnnounce`` carries torch's share tuple of it) together with a few interprocess events.
A Step's rows are one region ``[offset, offset + nbytes)`` of it (``RowsAt``; ``ALIGN``-aligned,
no stamp: the server could not read one without a host sync). The client copies the rows in on
its own copy stream (device to device from the target's taps), records ``events[generation %
len(events)]`` and only then sends the Step; the server's copy out of the region waits on that
event on the GPU (no host sync on either side), into its own device memory (a peer copy when the
two processes use different GPUs of one host, a plain copy on one GPU). Regions are given back
with the shm ring's ``RingAck``: the client writes a region again only after the server said its
copy of it is done (the allocator is ``target_client.client.regions``).

Lifetime: the client keeps the buffer for its whole life and names it anew in every Hello (a
restarted server imports it again; the regions start free then). The server releases its import
(and with it the device memory, once the client is gone too) when the client's process is gone
(same pid namespace: ``alive`` by pid and start time, checked about twice a second) or nobody
stepped through it for the session TTL, whichever comes first. Another host (``host_id``
differs) is refused at Hello; a buffer the server cannot open (a container that does not share
the GPU's IPC with the server, no peer access between the GPUs) is refused with the driver's reason.
"""

from __future__ import annotations

import os
import re

from protocol.messages import RowsAt, Transport

PREFIX = "cuda-ipc-"
ALIGN = 256  # region alignment in the device buffer (bytes)
EVENTS = 16  # interprocess events per buffer: region g's write is recorded on events[g % EVENTS]
_NAME = re.compile(r"^cuda-ipc-(\d+)-([0-9a-f]{16})-(\d+)$")
CUDA_IPC = Transport.CUDA_IPC.value


class CudaIpcError(Exception):
    """A buffer that cannot be made, exported or imported; the message is one line naming the cause."""


def buffer_name(pid: int, token: str, n: int) -> str:
    """The name of announcement ``n`` of the buffer ``token`` of process ``pid``."""
    return f"{PREFIX}{pid}-{token}-{n}"


def token_of(name: str) -> str | None:
    """The buffer token a name carries (the same device buffer across re-announcements), or None."""
    m = _NAME.match(name)
    return m.group(2) if m else None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def refusal(offered: tuple[str, ...], has_cuda: bool, disabled: bool) -> str | None:
    """Why a server offering ``offered`` refuses a cuda_ipc client (one line), or None."""
    if CUDA_IPC in offered:
        return None
    why = ""
    if not has_cuda:
        why = " (the server has no CUDA device: its drafter runs on the CPU)"
    elif disabled:
        why = " (the server runs with --no-cuda-ipc)"
    return f"transport {CUDA_IPC!r} refused: server accepts {', '.join(offered)}{why}"


def check_region(at: RowsAt, size: int) -> str | None:
    """Why region ``at`` does not fit a buffer of ``size`` bytes (one line), or None."""
    if at.generation <= 0 or at.nbytes < 0 or at.offset < 0 or at.offset % ALIGN or at.offset + at.nbytes > size:
        return (
            f"region [{at.offset}, +{at.nbytes}) of generation {at.generation} outside the {size}-byte "
            f"buffer or not {ALIGN}-byte aligned"
        )
    return None


# ---------------------------------------------------------------- who and where the client is


def host_id() -> str:
    """This host's boot id ("" when unknown): two processes with different ones are on different hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace ("" when unknown), e.g. "pid:[4026531836]"."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "pid (comm)" (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of process ``pid`` in this pid namespace, or None."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of the line
    except (IndexError, ValueError):
        return None


def alive(pid: int, started: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) still runs (a zombie does not: its device memory is
    gone already) and is the one that started at ``started``."""
    fields = _stat(pid) if pid > 0 else None
    if not fields or fields[0] in ("Z", "X", "x"):
        return False
    try:
        return int(fields[19]) == started
    except (IndexError, ValueError):
        return False
