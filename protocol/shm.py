"""The shared-memory ring of transport "shm": its segment layout, naming, lifetime and refusals.

Owns what both sides must agree on about a ring, and the OS calls that make and map one (POSIX
``shm_open`` through CPython's ``_posixshmem`` and ``mmap``: no ``multiprocessing.shared_memory``,
whose resource tracker unlinks segments and complains at exit). No sockets, no threads.

Layout of a segment (``nbytes`` in all)::

    [0, 4096)            header: MAGIC, nbytes (u64), creator pid (u64), nonce (16 bytes)
    [4096, nbytes)       regions, each 64-byte aligned: a 64-byte stamp (REGION_MAGIC,
                         generation u64, rows nbytes u64) and then the Step's rows

Lifetime, so that a SIGKILLed client or server leaves nothing in /dev/shm: the client creates the
segment (``create``: mode 0600, every page allocated up front so a full /dev/shm is one clear error
rather than a SIGBUS later) right before it sends the Hello that names it; the server opens it,
checks it (``open_ring``: same uid, the announced size, the header's nonce), maps it read-only and
unlinks the name at once; the client unlinks it too when the Welcome confirms the mapping (and on a
refusal). From then on only the two mappings hold the memory, and the kernel frees it when both are
gone, however the processes end. A client killed inside that window (a Hello round trip) leaves its
name behind; the next client to make a ring on the host removes names whose creator pid is dead
(``sweep_stale``). Only one direction is written: the client writes regions, the server reads.
"""

from __future__ import annotations

import _posixshmem  # CPython's shm_open/shm_unlink (what multiprocessing.shared_memory wraps)
import errno
import mmap
import os
import re
import struct
import time
from collections.abc import Callable

import numpy as np

from protocol.messages import RingAnnounce, RowsAt, Transport

MAGIC = b"DSPKRNG1"
REGION_MAGIC = 0x31474552_4B505344  # b"DSPKREG1" little-endian
HEADER_BYTES = 4096
STAMP_BYTES = 64
ALIGN = 64
SHM_DIR = "/dev/shm"
PREFIX = "dspark-ring-"
_NAME = re.compile(r"^/?dspark-ring-(\d+)-[0-9a-f]{16}$")
_HEADER = struct.Struct("<8sQQ16s")
_STAMP = struct.Struct("<QQQ")
TRANSPORTS = tuple(t.value for t in Transport)
_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
PACE_BYTES = 1 << 20  # a paced ``create`` allocates and maps this much between pauses


class RingError(Exception):
    """A ring that cannot be made or mapped; the message is one line naming the cause."""


def refusal(transport: str, offered: tuple[str, ...]) -> str | None:
    """Why a client asking for ``transport`` cannot use a server offering ``offered`` (one line), or None."""
    if transport not in offered:
        return f"transport {transport!r} refused: server accepts {', '.join(offered)}"
    return None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def region_bytes(rows_nbytes: int) -> int:
    """Ring bytes one region of ``rows_nbytes`` takes (stamp and alignment included)."""
    return STAMP_BYTES + aligned(rows_nbytes)


# ---------------------------------------------------------------- the client's side


def create(nbytes: int, pace_s: float | Callable[[], float] = 0.0) -> tuple[RingAnnounce, mmap.mmap]:
    """A new ring of ``nbytes`` (rounded up to pages), mapped read-write; RingError when /dev/shm
    cannot hold it (e.g. a container's 64 MB default: ``--shm-size``).

    Every page is allocated and mapped before this returns: tens of milliseconds of the kernel
    zeroing pages (40-65 ms for 64 MiB on a 2-core VM). ``pace_s`` > 0 (a spare made beside live
    traffic) does it a ``PACE_BYTES`` piece at a time with a pause of ``pace_s`` after each, so it
    never holds a core for more than about a millisecond at once; a callable is asked for the pause
    before each one (whoever waits for the ring can hurry it: 0 from then on)."""
    nbytes = max(HEADER_BYTES + 2 * mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    sweep_stale()
    nonce = os.urandom(16)
    name = f"/{PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
    try:
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        raise RingError(f"cannot create shm ring {name}: {e.strerror or e}") from None
    try:
        os.ftruncate(fd, nbytes)
        if callable(pace_s) or pace_s > 0:
            mm = _allocate_paced(fd, nbytes, pace_s)
        else:
            os.posix_fallocate(fd, 0, nbytes)  # every page now: a full /dev/shm fails here, not as SIGBUS later
            mm = mmap.mmap(fd, nbytes, flags=_POPULATE)  # page tables now, not a fault per page in the steps
    except OSError as e:
        unlink(name)
        free = _free_bytes()
        raise RingError(
            f"cannot allocate a {nbytes >> 20} MiB shm ring in {SHM_DIR} ({free}): {e.strerror or e}"
        ) from None
    finally:
        os.close(fd)
    _HEADER.pack_into(mm, 0, MAGIC, nbytes, os.getpid(), nonce)
    return RingAnnounce(name=name, nbytes=nbytes, nonce=nonce.hex()), mm


def _allocate_paced(fd: int, nbytes: int, pace_s: float | Callable[[], float]) -> mmap.mmap:
    """``create``'s allocation and mapping, a piece at a time: allocate a piece's pages (a full
    /dev/shm fails here, as unpaced), map them by writing one byte per page (a zero, as they hold),
    pause. The mapping is unmapped again when a piece fails."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    pages = np.frombuffer(mm, np.uint8)
    try:
        for a in range(0, nbytes, PACE_BYTES):
            b = min(nbytes, a + PACE_BYTES)
            os.posix_fallocate(fd, a, b - a)
            pages[a : b : mmap.PAGESIZE] = 0
            pause = pace_s() if callable(pace_s) else pace_s
            if pause > 0:
                time.sleep(pause)
    except BaseException:
        del pages  # the mapping closes only with no view of it left
        mm.close()
        raise
    del pages
    return mm


def _free_bytes() -> str:
    try:
        st = os.statvfs(SHM_DIR)
        return f"{st.f_bavail * st.f_frsize >> 20} MiB free"
    except OSError:
        return f"no {SHM_DIR}"


def write_region(mm: mmap.mmap, offset: int, generation: int, parts: list[np.ndarray]) -> int:
    """Stamp the region at ``offset`` and copy ``parts`` (rows, in order) after the stamp: one copy.
    Returns the rows' byte count."""
    pos = offset + STAMP_BYTES
    for p in parts:
        n = p.nbytes
        np.copyto(np.frombuffer(mm, np.uint8, n, pos), p.reshape(-1).view(np.uint8))
        pos += n
    nbytes = pos - offset - STAMP_BYTES
    stamp_region(mm, offset, generation, nbytes)
    return nbytes


def stamp_region(mm: mmap.mmap, offset: int, generation: int, nbytes: int) -> None:
    """Write the stamp of the region at ``offset`` whose ``nbytes`` of rows follow it (written already)."""
    _STAMP.pack_into(mm, offset, REGION_MAGIC, generation, nbytes)


def unmap(mm: mmap.mmap, wait_s: float = 0.0) -> bool:
    """Unmap ``mm``. While a buffer of it is still exported (the last view's, let go right after that
    view's finalizers ran), try again for up to ``wait_s``; False if it stays exported (the mapping
    then goes with that view). Unmapping a populated 64 MiB segment takes 15-20 ms of a core (the
    GIL is released meanwhile): never on a thread that serves steps."""
    end = time.monotonic() + wait_s
    while True:
        try:
            mm.close()
            return True
        except BufferError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)


def unlink(name: str) -> bool:
    """Remove a ring's name (its mappings live on); False when it was gone already."""
    try:
        _posixshmem.shm_unlink(name)
        return True
    except FileNotFoundError:
        return False


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove ring names left by dead processes (a creator killed between create and Welcome).
    Only creators in this pid namespace can be told alive; a name whose pid is alive stays."""
    gone = []
    try:
        names = os.listdir(directory)
    except OSError:
        return gone
    for n in names:
        m = _NAME.match(n)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or not ours to signal: EPERM below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if unlink("/" + n):
            gone.append("/" + n)
    return gone


# ---------------------------------------------------------------- the server's side


def open_ring(ring: RingAnnounce) -> mmap.mmap:
    """Map a client's ring read-only after checking it, and unlink its name; RingError (one line)
    when it cannot be used: not on this host or not in this /dev/shm, another user's, another size
    or another segment than announced."""
    if _NAME.match(ring.name) is None:
        raise RingError(f"{ring.name!r} is not a ring name ({PREFIX}PID-HEX)")
    try:
        fd = _posixshmem.shm_open(ring.name, os.O_RDONLY, 0)
    except OSError as e:
        hint = ""
        if e.errno == errno.ENOENT:
            hint = " (the client is on another host, or in a container that does not share /dev/shm)"
        raise RingError(f"cannot open shm ring {ring.name}: {e.strerror or e}{hint}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            # whoever can write the segment can shrink it under the mapping (SIGBUS on read): only a
            # peer that could signal this process anyway is trusted with that
            raise RingError(f"shm ring {ring.name} belongs to uid {st.st_uid}, the server runs as uid {os.geteuid()}")
        if st.st_size != ring.nbytes or ring.nbytes < HEADER_BYTES + ALIGN:
            raise RingError(f"shm ring {ring.name} holds {st.st_size} bytes, the Hello says {ring.nbytes}")
        mm = mmap.mmap(fd, ring.nbytes, flags=_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    magic, nbytes, _pid, nonce = _HEADER.unpack_from(mm, 0)
    if magic != MAGIC or nbytes != ring.nbytes or nonce.hex() != ring.nonce:
        mm.close()
        raise RingError(f"shm ring {ring.name} is not the segment the Hello announced (header or nonce differ)")
    unlink(ring.name)  # mapped: from now on only the mappings hold it
    return mm


def region_rows(mm: mmap.mmap, at: RowsAt) -> np.ndarray:
    """The rows of region ``at`` as a read-only uint8 view of the mapping (no copy); RingError
    when the reference does not fit the ring or the region's stamp says another Step wrote it."""
    size = len(mm)
    off = at.offset
    if off < HEADER_BYTES or off % ALIGN or at.nbytes < 0 or off + STAMP_BYTES + at.nbytes > size:
        raise RingError(f"region [{off}, +{at.nbytes}) outside the {size}-byte ring or not {ALIGN}-byte aligned")
    magic, gen, nbytes = _STAMP.unpack_from(mm, off)
    if magic != REGION_MAGIC or gen != at.generation or nbytes != at.nbytes:
        raise RingError(
            f"region at {off} holds generation {gen} ({nbytes} bytes), "
            f"the Step says {at.generation} ({at.nbytes} bytes)"
        )
    return np.frombuffer(mm, np.uint8, at.nbytes, off + STAMP_BYTES)
