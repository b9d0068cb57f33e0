"""A gRPC (grpcio) unary echo: the design issue 12 measures our Step against, for ``peers`` and ``rpc``.

The server answers every call with a 64-byte reply (as small as ours); the client sends one bytes
message per call, a Step's frames joined (gRPC carries one message: the join is part of its cost).

    python -m draft_tools.bench.grpc_echo PORT     (prints READY, serves until stdin closes)
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from draft_tools.common import median_ms, spawn_ready

REPLY = b"\0" * 64
METHOD = "/bench.Echo/Echo"
_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def available() -> bool:
    try:
        import grpc  # noqa: F401
    except ImportError:
        return False
    return True


def serve(port: int) -> None:
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: REPLY)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("READY", flush=True)
    sys.stdin.read()
    server.stop(0)


def spawn(port: int) -> subprocess.Popen:
    """The echo server in a child process, once it serves (kill it when done)."""
    return spawn_ready([sys.executable, "-m", "draft_tools.bench.grpc_echo", str(port)])


def one_message(frames: Sequence[Any]) -> bytes:
    """A Step's frames joined into the one message an RPC framework's echo carries."""
    return b"".join(bytes(memoryview(f)) for f in frames)


def echo_ms(port: int, frames: Sequence[Any], iters: int) -> float:
    """Median ms of one call carrying ``frames`` (joined into one message each call), after 10 untimed."""
    import grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS)
    call = ch.unary_unary(METHOD)

    try:
        return median_ms(lambda: call(one_message(frames)), iters)
    finally:
        ch.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
