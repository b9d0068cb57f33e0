"""Several draft servers behind every engine (issue 15, must-show 1), through real processes.

Four ``draft-server`` processes (checksum drafter), two synthetic engine processes of draft-soak
(``draft_tools.soak.engine``) with 64 concurrent sessions each, both on a ``FleetClient`` over
the four endpoints; sessions come and go all the time. Mid-run one server is killed with
SIGKILL (and started again on its port a little later), another is SIGSTOPped for 1.5 s and
then continued. Shown:

* placement: every server takes sessions, and at every snapshot no server holds more than
  1.1 x the mean of an engine's sessions, plus the few that frees since the last placement leave;
* every step() returned within budget + 5 ms, net of the time the host did not run the engine
  (run-queue wait of its threads, steal), as ``tests/conftest.py`` ``assert_on_time`` counts it;
* every draft is the checksum of exactly the context its reply names (also right after a move);
* each session that moved off the killed or the paused server drafted again within 2 steps
  (counting the steps that wanted drafts and got none around the move), unless the host shows
  load in that window (run-queue wait or steal over the slack in the engine's calls, host-wide CPU
  pressure over half a budget in one call, or a live server answering expired), and that excuse
  covers at most 15% of the moves;
* the killed server takes new sessions again once it is back, and no session ever moves back to
  a server it left; the paused one likewise after SIGCONT;
* zero sessions anywhere at the end (Frees, also the ones queued at the paused server).

Wall time about 35 s on the 2-core CI machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import numpy as np
import pytest

from draft_tools.soak.engine import EngineSpec, engine_main
from tests.conftest import SLACK_MS, wait_for

pytestmark = pytest.mark.timeout(240)

# The servers' replies wait on a loaded host's run queue too (4 servers and 2 engines on 2 cores,
# with whatever else runs there): at 25 ms a server now and then missed two steps in a row away from
# the kill and the pause, its sessions moved, and the checks below (bounded loads, drafts back within
# 2 steps, no move back, 90 % drafted) counted that against the fleet.
BUDGET_MS = 50.0
SESSIONS = 64
TTL_S = 3.0
MIN_CALLS = 300  # calls per engine that the checks below rest on
BUSY_HOST_MS = 5.0  # an engine call that lost this much to the run queue or steal: the host was busy


def _cols(engine: dict, table: str, columns: str) -> tuple[np.ndarray, list[str]]:
    cols = engine[columns]
    arr = np.array(engine[table] or [], dtype=np.float64).reshape(-1, len(cols))
    return arr, cols


def test_four_servers_two_engines_kill_and_pause(tmp_path, server_factory):
    srvs = [server_factory("--session-ttl-s", str(TTL_S), "--max-sessions", "512") for _ in range(4)]
    endpoint = ",".join(s.endpoint for s in srvs)
    killed, paused = srvs[1], srvs[2]
    ctx = mp.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    specs, procs, readies = [], [], []
    progress = [ctx.Value("i", 0) for _ in range(2)]  # steps each engine has done so far
    for i in range(2):
        spec = EngineSpec(
            index=i,
            endpoint=endpoint,
            out_path=str(tmp_path / f"engine-{i}.json"),
            seed=11,
            sessions=SESSIONS,
            budget_ms=BUDGET_MS,
            step_ms=25.0,
            k=4,
            decode_steps=(20, 60),
            long_prefill_p=0.0,
            checksum=True,
            connect_timeout_s=30.0,
            late_stacks=False,  # never read here
        )
        ready = ctx.Event()
        p = ctx.Process(target=engine_main, args=(spec, stop, ready, go, progress[i]), name=f"fleet-engine-{i}")
        p.start()
        specs.append(spec)
        procs.append(p)
        readies.append(ready)
    try:
        for ready, p in zip(readies, procs, strict=True):
            assert wait_for(lambda r=ready, p=p: r.is_set() or not p.is_alive(), 90.0) and ready.is_set()
        time.sleep(0.3)
        go.set()
        time.sleep(5.0)
        t_kill = time.monotonic()
        killed.kill()  # SIGKILL
        time.sleep(2.0)
        killed.start()  # back on its port, a new epoch
        t_back = time.monotonic()
        time.sleep(2.5)
        t_stop = time.monotonic()
        paused.pause()  # SIGSTOP
        time.sleep(1.5)
        paused.resume()  # SIGCONT
        t_cont = time.monotonic()
        time.sleep(4.0)
        # a step takes about 50 ms, longer on a loaded host: the engines go on until each has made
        # its calls (the kill and the pause came at their times all the same)
        wait_for(
            lambda: all(n.value > MIN_CALLS or not p.is_alive() for n, p in zip(progress, procs, strict=True)), 120.0
        )
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(5)
    engines = [json.loads(open(s.out_path).read()) for s in specs]
    for e in engines:
        assert e["error"] is None, e["error"]

    # every wait within budget + SLACK_MS, net of run-queue wait and steal
    over = []
    for e in engines:
        calls, cols = _cols(e, "calls", "call_columns")
        c = {name: calls[:, i] for i, name in enumerate(cols)}
        host = np.maximum(c["run_delay_ms"], c["proc_run_delay_ms"]) + c["steal_ms"] / float(e["cpus"] or 1)
        net = c["wait_ms"] - host
        assert len(calls) > MIN_CALLS
        for i in np.nonzero(net > c["budget_ms"] + SLACK_MS)[0]:
            keys = ("t0", "wait_ms", "run_delay_ms", "proc_run_delay_ms", "gc_ms", "steal_ms")
            over.append({k: round(float(c[k][i]), 2) for k in keys})
        assert c["mismatch"].sum() == 0 and c["bad_drafts"].sum() == 0  # drafts name their exact context
        assert c["drafted"].sum() > 0.9 * c["want"].sum()
    assert not over, over[:10]

    # placement: every server takes sessions; bounded loads at every snapshot
    for e in engines:
        first = {}
        for row in e["sessions"]:
            s = dict(zip(e["session_columns"], row, strict=True))
            first[s["first_server"]] = first.get(s["first_server"], 0) + 1
        assert set(first) == {s.endpoint for s in srvs}, first
        for t, loads in e["loads"]:
            n = list(loads.values())
            # bounded loads hold at each placement; frees since then may leave a server a few over
            if t < t_kill and sum(n) >= 32:
                assert max(n) <= 1.1 * sum(n) / 4 + 3, loads

    # moved sessions: drafting back within 2 steps, around the kill and around the pause
    around_kill = around_pause = moved_back = late = 0
    for e in engines:
        moves, cols = _cols(e, "moves", "move_columns")
        m = {name: moves[:, i] for i, name in enumerate(cols)}
        calls, ccols = _cols(e, "calls", "call_columns")
        c = {name: calls[:, i] for i, name in enumerate(ccols)}
        host = np.maximum(c["run_delay_ms"], c["proc_run_delay_ms"]) + c["steal_ms"] / float(e["cpus"] or 1)
        back = m["t_back"] >= 0
        moved_back += int(back.sum())
        for i in np.nonzero(back & (m["steps_without"] > 2))[0]:
            # A move that took longer is the host's doing only where the host shows it in that
            # window: the engine's own calls lost time to the run queue or steal, tasks waited for a
            # CPU host-wide for over half a budget in one call (the servers' run queue, which the
            # engine cannot see otherwise), or a live server read a step past its budget (expired:
            # it sat behind the load). CI's 2 cores once opened breakers on all four servers at once.
            win = (c["t0"] >= m["t_first_miss"][i] - 0.001) & (c["t0"] < m["t_back"][i])
            busy = (host[win] > BUSY_HOST_MS) | (c["psi_ms"][win] > 0.5 * c["budget_ms"][win])
            loaded = bool(busy.any() or c["expired"][win].sum() > 0)
            rec = {
                "since_kill_s": round(float(m["t_first_miss"][i] - t_kill), 3),
                "since_stop_s": round(float(m["t_first_miss"][i] - t_stop), 3),
                **{k: float(m[k][i]) for k in ("steps_without", "from_server", "to_server", "expired", "overloaded")},
                "host_ms": [round(float(h), 1) for h in host[win]],
                "psi_ms": [round(float(h), 1) for h in c["psi_ms"][win]],
                "expired_calls": int(c["expired"][win].sum()),
            }
            assert loaded, f"a session took {int(m['steps_without'][i])} steps to draft again on an idle host: {rec}"
            late += 1
        around_kill += int(((m["t_first_miss"] >= t_kill - 0.1) & (m["t_first_miss"] < t_kill + 1.0) & back).sum())
        around_pause += int(((m["t_first_miss"] >= t_stop - 0.1) & (m["t_first_miss"] < t_stop + 1.0) & back).sum())
    assert around_kill >= 10 and around_pause >= 10, (around_kill, around_pause)
    # and the host's excuse stays the exception: nearly every move drafts again within 2 steps
    assert late <= 0.15 * moved_back, (late, moved_back)

    # servers that came back take new sessions again; the sessions that left them stay away
    for srv, since in ((killed, t_back + 1.0), (paused, t_cont + 1.0)):
        later = [
            s
            for e in engines
            for s in (dict(zip(e["session_columns"], row, strict=True)) for row in e["sessions"])
            if s["first_t0"] > since
        ]
        assert any(s["first_server"] == srv.endpoint for s in later), srv.endpoint
    sessions = [dict(zip(e["session_columns"], row, strict=True)) for e in engines for row in e["sessions"]]
    assert sum(s["moves"] for s in sessions) >= 20 and not any(s["moved_back"] for s in sessions)

    # zero sessions anywhere at the end
    for srv in srvs:
        assert wait_for(lambda srv=srv: srv.metrics().get("draft_server_sessions") == 0, TTL_S + 10.0), (
            srv.endpoint,
            srv.metrics().get("draft_server_sessions"),
        )
