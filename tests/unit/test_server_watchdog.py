"""The server's watchdog thread outlives its own exceptions, and health turns red without it."""

from __future__ import annotations

import time

from draft_server.app import DraftServer
from draft_server.config import ServerConfig
from draft_server.drafters.checksum import ChecksumDrafter
from tests.conftest import wait_for


def test_the_watchdog_survives_an_exception_and_health_needs_it() -> None:
    srv = DraftServer(ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum"), ChecksumDrafter())
    real = srv._watch_once
    calls = {"n": 0}

    def flaky(fired_for):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(fired_for)

    srv._watch_once = flaky  # type: ignore[method-assign]
    srv.start()
    try:
        assert wait_for(lambda: calls["n"] >= 4, 5)
        assert srv._watchdog.is_alive() and srv.metrics.io_errors._value.get() == 1
        assert srv.health()["healthy"]
        srv._running.clear()  # the watchdog stops: while the server runs on, health must not say green
        srv._watchdog.join(2)
        srv._running.set()
        time.sleep(0.01)
        assert not srv.health()["healthy"]
    finally:
        srv.stop()


def test_a_pong_answered_while_the_threads_start_is_healthy() -> None:
    """start() starts the engine, the router and the watchdog one after another, and the idle engine
    already answers Pings (a restarted server's clients probe it meanwhile): a Pong then must not
    call the threads not started yet dead, or a client's breaker stays open after the restart."""
    srv = DraftServer(ServerConfig(bind="tcp://127.0.0.1:0", metrics_port=-1, drafter="checksum"), ChecksumDrafter())
    seen: list[bool] = []
    real = srv.router.start

    def start_router() -> None:
        seen.append(srv.router._pong(1).healthy)  # the engine runs; the router and the watchdog not yet
        real()
        seen.append(srv.router._pong(2).healthy)  # the watchdog not yet

    srv.router.start = start_router  # type: ignore[method-assign]
    srv.start()
    try:
        assert seen == [True, True] and srv.router._pong(3).healthy
    finally:
        srv.stop()
    assert not srv.router._pong(4).healthy  # stopped: its threads are gone
