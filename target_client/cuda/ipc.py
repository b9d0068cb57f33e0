"""The client's CUDA IPC buffer (transport "cuda_ipc", ``protocol.cuda_ipc``): where a step's device rows go.

Owns ``CudaRing``: a device buffer of slots on the target's GPU (uint8, ``nbytes``), exported once
with CUDA IPC (torch's ``UntypedStorage._share_cuda_()``), a copy stream and ``EVENTS``
interprocess events, and the region bookkeeping (``target_client.client.regions.Regions``). Per
step, ``put`` copies the rows into the next free region on the copy stream, device to device (the
target's taps never touch host memory), after the caller's stream has produced them (the event
``record_ready`` recorded in the caller's thread), records ``events[generation % EVENTS]`` and
returns the ``RowsAt`` the Step names: no host sync anywhere. A region is written again only
after the server's ack says its copy out of it is done; when none is free the step's rows go in a
frame (``host_rows``: one device-to-host copy, counted as a fallback).

The buffer lives as long as the client: every Hello names it anew (``reannounce``: a new name, all
regions free), so a restarted server imports the same memory. Only the client's I/O thread calls
``put``/``ack``/``cancel``/``reannounce``; ``record_ready`` runs in the caller's thread.

Allocation: torch's caching allocator, with expandable segments turned off around the one
allocation when ``PYTORCH_CUDA_ALLOC_CONF`` turns them on (their IPC handles need the importer to
take a file descriptor from this process, which ptrace rules usually forbid).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import msgspec
import numpy as np

from protocol import CudaIpcAnnounce, RingAck, RowsAt
from protocol.cuda_ipc import (
    ALIGN,
    EVENTS,
    CudaIpcError,
    aligned,
    buffer_name,
    host_id,
    pid_namespace,
    start_time,
)
from target_client.client.regions import Regions, is_device


def current_device() -> int | None:
    """The calling thread's CUDA device index, or None when this process has no CUDA."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def record_ready(taps: Any) -> Any:
    """An event on the caller's current stream of ``taps``' device: the copy into the buffer waits on it."""
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(taps.device))
    return ev


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _allocate(torch: Any, nbytes: int, device: Any) -> Any:
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()
    expandable = "expandable_segments:true" in conf.replace(" ", "")
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if expandable and settings is not None:
        settings("expandable_segments:False")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        if expandable and settings is not None:
            settings("expandable_segments:True")


class CudaRing:
    """One exported device buffer of one client. See the module docstring."""

    def __init__(self, device: int | None, nbytes: int, events: int = EVENTS) -> None:
        try:
            import torch
        except ImportError as e:
            raise CudaIpcError(f"this process cannot use CUDA: torch is not installed ({e})") from None
        if not torch.cuda.is_available():
            raise CudaIpcError(
                f"this process has no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
            )
        if device is None:
            raise CudaIpcError("this process has no CUDA device for the buffer (ClientConfig.cuda_device)")
        self._torch = torch
        self.device = torch.device("cuda", device)
        nbytes = aligned(max(nbytes, ALIGN))
        try:
            with torch.cuda.device(self.device):
                self._buf = _allocate(torch, nbytes, self.device)
                share = self._buf.untyped_storage()._share_cuda_()
                self._stream = torch.cuda.Stream(self.device)
                self._buf.record_stream(self._stream)  # freed only after the copies into it have run
                self._events = [torch.cuda.Event(interprocess=True) for _ in range(events)]
                handles = tuple(bytes(e.ipc_handle()) for e in self._events)
                uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise CudaIpcError(
                f"cannot export a {nbytes >> 20} MiB CUDA IPC buffer on cuda:{device}: {_first_line(e)}"
            ) from None
        _dev, handle, storage_bytes, storage_offset, ref_counter, ref_counter_offset, _event, _sync = share
        self.size = nbytes
        self.token = os.urandom(8).hex()
        self._n = 0
        pid = os.getpid()
        self._base = CudaIpcAnnounce(
            name=buffer_name(pid, self.token, 0),
            nbytes=nbytes,
            handle=bytes(handle),
            storage_bytes=int(storage_bytes),
            storage_offset=int(storage_offset),
            ref_counter=bytes(ref_counter),
            ref_counter_offset=int(ref_counter_offset),
            events=handles,
            device=int(device),
            device_uuid=uuid,
            host=host_id(),
            pid=pid,
            pid_ns=pid_namespace(),
            start_time=start_time(pid) or 0,
        )
        self.announce = self._base
        self.name = self.announce.name
        self.regions = Regions(nbytes, ALIGN)
        self.mapped = False  # a server imported this announcement (its Welcome named it)

    @property
    def generation(self) -> int:
        return self.regions.generation

    @property
    def free_bytes(self) -> int:
        return self.regions.free_bytes

    def reannounce(self) -> None:
        """Name the buffer anew for the next Hello: a server that lost it (a restart, its TTL)
        imports it again; nothing of it is read by anyone then, so every region is free."""
        self._n += 1
        self.announce = msgspec.structs.replace(self._base, name=buffer_name(self._base.pid, self.token, self._n))
        self.name = self.announce.name
        self.mapped = False
        self.regions.reset()

    def confirm(self) -> None:
        """The server imported this announcement."""
        self.mapped = True

    def put(self, parts: list[Any], ready: Any = None) -> RowsAt | None:
        """Copy ``parts`` (rows, in order: device tensors, or host numpy arrays) into the next free
        region, on the copy stream after ``ready``; None when no region is free."""
        nbytes = sum(int(p.nbytes) for p in parts)
        got = self.regions.take(nbytes)
        if got is None:
            return None
        generation, offset = got
        torch = self._torch
        s = self._stream
        with torch.cuda.device(self.device):
            if ready is not None:
                s.wait_event(ready)
            with torch.cuda.stream(s):
                pos = offset
                for p in parts:
                    n = int(p.nbytes)
                    dst = self._buf[pos : pos + n]
                    if is_device(p):
                        dst.view(p.dtype).copy_(p.reshape(-1), non_blocking=True)
                        p.record_stream(s)  # the caller's allocator must not reuse it before this copy ran
                    else:  # host rows (tests, tools): one copy from pageable memory
                        with warnings.catch_warnings():  # read-only frames: torch only reads them
                            warnings.simplefilter("ignore", UserWarning)
                            src = torch.from_numpy(np.ascontiguousarray(p).reshape(-1).view(np.uint8))
                        dst.copy_(src)
                    pos += n
            self._events[generation % len(self._events)].record(s)
        return RowsAt(self.name, offset, nbytes, generation)

    def cancel(self, generation: int) -> None:
        """A region whose Step was never sent: free it at once."""
        self.regions.cancel(generation)

    def ack(self, ack: RingAck) -> None:
        """Free what the server is done with (acks of an earlier announcement are ignored)."""
        if ack.ring == self.name:
            self.regions.ack(ack)

    def host_rows(self, parts: list[Any], ready: Any = None) -> np.ndarray:
        """The rows of ``parts`` in one host array in wire storage (a frame, when no region is free)."""
        return host_rows(parts, ready, self._stream)

    def close(self) -> None:
        """Drop this process's references to the buffer. torch counts the one share as one reader
        that has not let go yet; this client stops stepping now, so it gives that count back itself
        (else torch keeps the memory for the process's life when no server ever imported it). A
        server that still maps it keeps the device memory alive until it releases its import."""
        if self._buf is None:
            return
        try:
            self._torch.UntypedStorage._release_ipc_counter_cuda(self._base.ref_counter, self._base.ref_counter_offset)
        except Exception:  # best effort, as torch's own release
            pass
        self._events = []
        self._buf = None


def cat_rows(parts: list[Any]) -> Any:
    """Row slices of one device (torch tensors) as one contiguous tensor there."""
    import torch

    return torch.cat(parts).contiguous()


def host_rows(parts: list[Any], ready: Any = None, stream: Any = None) -> np.ndarray:
    """``parts`` (device tensors or host arrays) as one C-contiguous host array in wire storage (bf16
    as uint16 bit patterns): one device-to-host copy per device part, after ``ready``."""
    out: list[np.ndarray] = []
    for p in parts:
        if not is_device(p):
            out.append(p)
            continue
        import torch

        with torch.cuda.device(p.device):
            s = stream if stream is not None else torch.cuda.current_stream(p.device)
            if ready is not None:
                s.wait_event(ready)
            with torch.cuda.stream(s):
                host = p.to("cpu")  # waits for the copy
        if host.dtype == torch.bfloat16:
            host = host.view(torch.int16)
        arr = host.numpy()
        out.append(arr.view(np.uint16) if arr.dtype == np.int16 else arr)
    return out[0] if len(out) == 1 else np.concatenate(out, axis=0)
