"""The server's CUDA IPC imports (transport "cuda_ipc", ``protocol.cuda_ipc``): import, copy, ack, release.

Owns ``CudaBuffers``: the device buffers clients announced in their Hello, imported on the
drafter's CUDA device, per connection; the rows of a Step that names a region, copied out of the
client's buffer into this server's device memory at once, on the I/O thread's own stream, after
the client's interprocess event for that region (a GPU-side wait: no host sync) and handed to the
engine as ``DeviceRows`` (its ingest waits on the copy, again on the GPU); which regions the
server may still read (a region is held until its copy is done, an event query: so the client
gets it back with the reply that follows, and the imported memory is never referenced by queued
work); the ``RingAck`` each reply to that connection carries (the shm ring's); and releasing an
import (closing the CUDA IPC mapping, which frees the client's device memory once that process is
gone too) as soon as its client process is gone, or nobody stepped through it for the session TTL.

The device side is an ``Importer`` (``TorchImporter``: torch's own CUDA IPC import, as
``torch.multiprocessing`` rebuilds a shared CUDA tensor, on the drafter's device: a peer mapping
when the client's GPU is another one of this host). Tests give a fake one. I/O thread only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from draft_server.drafters.base import DeviceRows
from protocol import ErrorCode, ProtocolError
from protocol.cuda_ipc import CudaIpcError, alive, check_region, host_id, pid_namespace, token_of
from protocol.messages import CudaIpcAnnounce, DType, RingAck, RowsAt, TensorSpec

log = logging.getLogger("draft_server.io")

MAX_BUFFERS_PER_CONNECTION = 2  # a client re-Hellos with its buffer named anew; older names go
SWEEP_S = 0.5  # how often gone clients are looked for
_HINT = (
    " (the client is on another host, in a container that does not share the GPU's IPC and pid namespace with "
    "this server, or its GPU has no peer access to this one)"
)


class Importer(Protocol):
    """The device side of ``CudaBuffers`` (``TorchImporter``; a fake in tests)."""

    def open(self, ann: CudaIpcAnnounce) -> Any:
        """Import the announced buffer and its events; CudaIpcError (one line) when it cannot be."""

    def copy(self, handle: Any, at: RowsAt, spec: TensorSpec) -> tuple[DeviceRows, Any]:
        """Copy region ``at`` out (after the client's event) into new device memory: the rows and a
        marker of the copy (``done`` tells when it finished)."""

    def done(self, marker: Any) -> bool: ...

    def settle(self) -> None:
        """Wait until every copy issued so far has finished (a buffer named anew: its regions are free)."""

    def close(self, handle: Any) -> None: ...

    def where(self, ann: CudaIpcAnnounce) -> str:
        """How rows get here from that buffer, for the log ("same GPU", "peer GPU ...")."""


@dataclass(eq=False)
class Imported:
    name: str
    token: str
    owner: bytes
    ann: CudaIpcAnnounce
    handle: Any
    watch_pid: bool  # the client's process is in this pid namespace: released as soon as it is gone
    seen: int = 0  # newest generation received
    held: dict[int, Any] = field(default_factory=dict)  # generation -> marker of the copy still reading it
    used: float = field(default_factory=time.monotonic)

    def settled(self, done: Any) -> bool:
        """Forget the copies that finished; whether none is left."""
        for g in [g for g, m in self.held.items() if done(m)]:
            del self.held[g]
        return not self.held


class CudaBuffers:
    """Imported client buffers per connection (I/O thread). See the module docstring."""

    def __init__(self, importer: Importer | None, idle_s: float, gauge: Any) -> None:
        """``importer`` None: this server has no CUDA device (every cuda_ipc Hello is refused)."""
        self.importer = importer
        self.idle_s = idle_s
        self._gauge = gauge
        self._by_ident: dict[bytes, dict[str, Imported]] = {}
        self._last_sweep = time.monotonic()
        self._host = host_id()
        self._pid_ns = pid_namespace()

    @classmethod
    def serving(cls, drafter: Any, enabled: bool, idle_s: float, gauge: Any) -> CudaBuffers:
        """The table of a server whose drafter is ``drafter`` (an importer on its CUDA device, if it has one)."""
        dev = drafter.cuda_device()
        return cls(TorchImporter(dev) if (enabled and dev is not None) else None, idle_s, gauge)

    @property
    def offered(self) -> bool:
        return self.importer is not None

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_ident.values())

    def map(self, ident: bytes, owner: bytes, ann: CudaIpcAnnounce, call_id: int) -> str:
        """Import the buffer a Hello announced (again: the same import, for a Hello sent twice);
        ProtocolError(TRANSPORT) naming why it cannot be."""
        assert self.importer is not None
        bufs = self._by_ident.setdefault(ident, {})
        have = bufs.get(ann.name)
        if have is not None and have.owner == owner and have.ann == ann:
            have.used = time.monotonic()
            return have.name
        token = token_of(ann.name)
        why = None
        if token is None:
            why = f"{ann.name!r} is not a CUDA IPC buffer name (cuda-ipc-PID-HEX-N)"
        elif ann.host and self._host and ann.host != self._host:
            why = f"the client is on another host (boot id {ann.host}, this server's {self._host})"
        elif not ann.events or ann.nbytes <= 0 or ann.nbytes > ann.storage_bytes:
            why = (
                f"buffer {ann.name} announces {ann.nbytes} bytes in a {ann.storage_bytes}-byte storage "
                f"with {len(ann.events)} events"
            )
        handle = None
        if why is None:
            same = [b for b in bufs.values() if b.token == token and b.owner == owner]
            if same:
                # the same device memory named anew: the client writes its regions again after the
                # Welcome, so every copy still reading them must be done first (microseconds)
                self.importer.settle()
            try:
                handle = self.importer.open(ann)
            except CudaIpcError as e:
                why = str(e)
        if why is not None:
            if not bufs:
                del self._by_ident[ident]
            raise ProtocolError(ErrorCode.TRANSPORT, f"transport 'cuda_ipc' refused: {why}", call_id) from None
        watch = bool(ann.pid) and ann.pid_ns == self._pid_ns and bool(self._pid_ns) and alive(ann.pid, ann.start_time)
        bufs[ann.name] = Imported(ann.name, token, owner, ann, handle, watch)  # type: ignore[arg-type]
        for old in [b.name for b in bufs.values() if b.token == token and b.name != ann.name]:
            self._drop(ident, old, force=True)  # settled above
        for old in list(bufs)[:-MAX_BUFFERS_PER_CONNECTION]:
            self._drop(ident, old)
        self._gauge.set(len(self))
        log.info(
            "imported CUDA IPC buffer %s (%d MiB, %s, pid %d%s) for %r",
            ann.name,
            ann.nbytes >> 20,
            self.importer.where(ann),
            ann.pid,
            "" if watch else ", not in this pid namespace: released after the TTL",
            owner[-16:],
        )
        return ann.name

    def rows(self, ident: bytes, owner: bytes, at: RowsAt, spec: TensorSpec, call_id: int) -> DeviceRows:
        """The rows of region ``at`` (``spec``'s dtype and shape), copied into this server's device memory."""
        buf = self._by_ident.get(ident, {}).get(at.ring)
        if buf is None or buf.owner != owner or self.importer is None:
            why = f"CUDA IPC buffer {at.ring} is not imported for this connection (send a Hello)"
            raise ProtocolError(ErrorCode.TRANSPORT, why, call_id)
        why = check_region(at, buf.ann.nbytes)
        if why is not None:
            raise ProtocolError(ErrorCode.BAD_FRAMES, f"CUDA IPC buffer {at.ring}: {why}", call_id)
        buf.used = time.monotonic()
        buf.seen = max(buf.seen, at.generation)
        try:
            rows, marker = self.importer.copy(buf.handle, at, spec)
        except RuntimeError as e:  # a CUDA error: the client Hellos again, the import is dropped
            self._drop(ident, at.ring, force=True)
            raise ProtocolError(
                ErrorCode.TRANSPORT, f"CUDA IPC buffer {at.ring}: copy failed ({str(e).splitlines()[0]})", call_id
            ) from None
        buf.held[at.generation] = marker
        return rows

    def ack(self, ident: bytes) -> RingAck | None:
        """The newest buffer's ack for a reply to ``ident`` (None: it announced none)."""
        bufs = self._by_ident.get(ident)
        if not bufs or self.importer is None:
            return None
        buf = next(reversed(bufs.values()))
        buf.settled(self.importer.done)
        return RingAck(buf.name, buf.seen, tuple(sorted(buf.held)))

    def sweep(self, now: float) -> None:
        """Release imports whose client process is gone, or that nobody used for ``idle_s``."""
        if now - self._last_sweep < min(SWEEP_S, self.idle_s / 4) or not self._by_ident:
            return
        self._last_sweep = now
        for ident, bufs in list(self._by_ident.items()):
            for name, buf in list(bufs.items()):
                gone = buf.watch_pid and not alive(buf.ann.pid, buf.ann.start_time)
                if gone or now - buf.used > self.idle_s:
                    self._drop(ident, name, why="its process is gone" if gone else "idle past the TTL")

    def _drop(self, ident: bytes, name: str, force: bool = False, why: str = "") -> None:
        bufs = self._by_ident[ident]
        buf = bufs[name]
        if not force and self.importer is not None and not buf.settled(self.importer.done):
            return  # a copy still reads it: at the next sweep
        del bufs[name]
        if not bufs:
            del self._by_ident[ident]
        if self.importer is not None:
            self.importer.close(buf.handle)
        self._gauge.set(len(self))
        log.info("released CUDA IPC buffer %s%s", name, f" ({why})" if why else "")

    def close(self) -> None:
        if self.importer is not None and self._by_ident:
            self.importer.settle()
        for ident, bufs in list(self._by_ident.items()):
            for name in list(bufs):
                self._drop(ident, name, force=True)


# ---------------------------------------------------------------- the device side, torch

_STORAGE = {  # torch dtype each wire dtype's rows are held in (bf16 as its bit patterns)
    DType.BF16: "int16",
    DType.F16: "float16",
    DType.F32: "float32",
    DType.I32: "int32",
    DType.I64: "int64",
    DType.U8: "uint8",
}


@dataclass(eq=False)
class _Handle:
    storage: Any
    buf: Any  # uint8 [storage_bytes] over the imported memory
    events: list[Any]


class TorchImporter:
    """Imports with torch's CUDA IPC on the drafter's device ``dev``; copies on its own stream."""

    def __init__(self, dev: Any) -> None:
        import torch

        self.torch = torch
        self.dev = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.dev):
            self.stream = torch.cuda.Stream(self.dev)
        self.uuid = str(getattr(torch.cuda.get_device_properties(self.dev), "uuid", ""))

    def open(self, ann: CudaIpcAnnounce) -> _Handle:
        torch = self.torch
        try:
            with torch.cuda.device(self.dev):
                # torch.multiprocessing's rebuild_cuda_tensor, opened on this server's device (a peer
                # mapping when the memory is on another GPU); the share-time event is not waited on:
                # every region has its own event
                storage = torch.UntypedStorage._new_shared_cuda(
                    self.dev.index,
                    ann.handle,
                    ann.storage_bytes,
                    ann.storage_offset,
                    ann.ref_counter,
                    ann.ref_counter_offset,
                    bytes(64),
                    False,
                )
                typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
                buf = torch._utils._rebuild_tensor(typed, 0, (ann.storage_bytes,), (1,))
                events = [torch.cuda.Event.from_ipc_handle(self.dev, h) for h in ann.events]
        except (RuntimeError, TypeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CudaIpcError(f"cannot open CUDA IPC buffer {ann.name}: {first}{_HINT}") from None
        return _Handle(storage, buf, events)

    def copy(self, handle: _Handle, at: RowsAt, spec: TensorSpec) -> tuple[DeviceRows, Any]:
        torch = self.torch
        with torch.cuda.device(self.dev):
            s = self.stream
            s.wait_event(handle.events[at.generation % len(handle.events)])  # the client's write of the region
            with torch.cuda.stream(s):
                dst = torch.empty(at.nbytes, dtype=torch.uint8, device=self.dev)
                dst.copy_(handle.buf[at.offset : at.offset + at.nbytes], non_blocking=True)
            done = torch.cuda.Event()
            done.record(s)
        rows = dst.view(getattr(torch, _STORAGE[spec.dtype])).view(tuple(spec.shape))
        return DeviceRows(rows, done), done

    def done(self, marker: Any) -> bool:
        return bool(marker.query())

    def settle(self) -> None:
        self.stream.synchronize()

    def close(self, handle: _Handle) -> None:
        handle.events.clear()
        handle.buf = None
        handle.storage = None  # the last reference: torch closes the IPC mapping

    def where(self, ann: CudaIpcAnnounce) -> str:
        if ann.device_uuid and ann.device_uuid == self.uuid:
            return f"same GPU as {self.dev}: plain device copies"
        return f"client's cuda:{ann.device}, another GPU: peer copies to {self.dev}"
