"""`draft_tools.common.free_port`: the ports the tests hand to servers they start next."""

from __future__ import annotations

import socket

import zmq

from draft_tools.common import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), [p for p in ports if not 1024 <= p < low]
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_outgoing_connections_never_take_a_free_port_before_its_server_binds() -> None:
    """The CI failure: a port picked by bind(0) came from the range outgoing connections use, and one
    took it before the server bound. Many connections opened after the pick leave it free."""
    picked = [free_port() for _ in range(20)]
    ctx = zmq.Context.instance()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    conns = [socket.create_connection(listener.getsockname()) for _ in range(200)]
    dealers = [ctx.socket(zmq.DEALER) for _ in range(20)]
    try:
        for d in dealers:
            d.connect(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        local = {c.getsockname()[1] for c in conns}
        assert not local & set(picked)
        for p in picked:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    finally:
        for d in dealers:
            d.close(linger=0)
        for c in conns:
            c.close()
        listener.close()
