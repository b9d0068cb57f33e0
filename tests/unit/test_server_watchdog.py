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
