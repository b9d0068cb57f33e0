"""Placement of sessions over several draft servers (target_client.fleet.placement), as pure logic.

Rendezvous order, what adding and removing a server moves, the bounded-load spread at 1,000
sessions (issue 15: within 10%), failover to the next server in each session's own order and
never back, shedding of fresh sessions on ``overloaded``, reroutes within a step, servers that
leave DNS. No sockets, no clock: ``now`` is passed in.
"""

from __future__ import annotations

import collections

import pytest

from target_client.fleet.placement import FAIL_HOLD_S, Placement, rank, score

KEYS = [f"tcp://10.0.0.{i}:5557" for i in range(1, 5)]


def fleet(keys=KEYS, slack: float = 0.1) -> Placement:
    p = Placement(load_slack=slack)
    for k in keys:
        p.add(k)
        p.set_usable(k, True)
    return p


def place(p: Placement, sessions, now: float = 0.0) -> dict[str, str]:
    out = {}
    for s in sessions:
        key, left = p.route(s, now)
        assert left is None
        out[s] = key
    return out


def test_rank_is_rendezvous_order_and_stable():
    assert score("s", "a") == score("s", "a")  # no per-process salt (hashlib, not hash())
    order = rank("req-1", KEYS)
    assert sorted(order) == sorted(KEYS)
    assert order == sorted(KEYS, key=lambda k: score("req-1", k), reverse=True)
    # removing a server keeps everyone else's relative order: the next in line takes over
    for s in (f"r{i}" for i in range(50)):
        full = rank(s, KEYS)
        assert rank(s, full[1:]) == full[1:]


def test_no_load_bound_is_pure_rendezvous_and_adding_a_server_takes_only_its_share():
    sessions = [f"e0-s{i}" for i in range(2000)]
    p = fleet(KEYS[:3], slack=1e9)
    before = place(p, sessions)
    assert all(before[s] == rank(s, KEYS[:3])[0] for s in sessions)
    q = fleet(KEYS, slack=1e9)  # the same sessions placed with a fourth server present
    after = place(q, sessions)
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == KEYS[3] for s in moved)  # only to the new server
    assert 0.2 < len(moved) / len(sessions) < 0.3  # about its 1/4 share


def test_thousand_sessions_spread_within_ten_percent():
    for engine in range(4):  # several engines, each with its own placement and session names
        p = fleet()
        place(p, [f"e{engine}-s{i}" for i in range(1000)])
        loads = [p.servers[k].load for k in KEYS]
        assert sum(loads) == 1000
        assert max(loads) <= 1.1 * 250 and min(loads) >= 0.9 * 250, loads


def test_bounded_loads_hold_while_sessions_come_and_go():
    p = fleet()
    live: collections.deque[str] = collections.deque()
    for i in range(5000):
        p.route(f"s{i}", 0.0)
        live.append(f"s{i}")
        if len(live) > 1000:
            p.free(live.popleft())
        if i > 1000:
            loads = [p.servers[k].load for k in KEYS]
            assert max(loads) <= 1.1 * sum(loads) / 4 + 1, loads


def test_dead_server_sessions_move_to_their_next_server_and_never_back():
    p = fleet(slack=1e9)
    first = place(p, [f"s{i}" for i in range(400)])
    dead = KEYS[0]
    p.set_usable(dead, False)
    moved = {}
    for s, key in first.items():
        new, left = p.route(s, 1.0)
        if key == dead:
            assert left == dead and new == rank(s, KEYS)[1]  # next in its own order
            moved[s] = new
        else:
            assert (new, left) == (key, None)  # the others stay put
    assert p.counts.moves == len(moved) > 50
    p.set_usable(dead, True)  # the server is back
    for s in moved:
        assert p.route(s, 2.0) == (moved[s], None)  # moved sessions stay where they went
    newcomers = place(p, [f"n{i}" for i in range(400)], now=2.0)
    assert sum(1 for k in newcomers.values() if k == dead) > 50  # new sessions go to it again


def test_a_moved_session_moves_again_when_its_new_server_dies_too():
    p = fleet(slack=1e9)
    ((s, _),) = place(p, ["only"]).items()
    order = rank(s, KEYS)
    p.set_usable(order[0], False)
    assert p.route(s, 1.0) == (order[1], order[0])
    p.set_usable(order[1], False)
    assert p.route(s, 2.0) == (order[2], order[1])
    for k in KEYS:
        p.set_usable(k, False)
    assert p.route(s, 3.0) == (order[2], None)  # nowhere better: it waits where it is
    assert p.seats[s].moves == 2


def test_nothing_usable_places_on_the_best_server_and_moves_once_one_is():
    p = fleet()
    for k in KEYS:
        p.set_usable(k, False)
    key, left = p.route("s", 0.0)
    assert key == rank("s", KEYS)[0] and left is None and p.counts.stranded == 1
    other = rank("s", KEYS)[1]
    p.set_usable(other, True)
    assert p.route("s", 1.0) == (other, key)


def test_overloaded_fresh_session_sheds_and_the_server_takes_none_for_its_hint():
    p = fleet(slack=1e9)
    order = rank("s", KEYS)
    assert p.route("s", 0.0) == (order[0], None)
    assert p.answered("s", order[0], True, 200.0, 0.0) == order[0]  # shed: free it there
    assert p.where("s") == order[1] and p.counts.sheds == 1
    # within the hint no new session goes to the overloaded server
    placed = place(p, [f"n{i}" for i in range(200)], now=0.1)
    assert order[0] not in placed.values()
    placed = place(p, [f"m{i}" for i in range(200)], now=0.3)
    assert order[0] in placed.values()


def test_established_session_answered_overloaded_stays():
    p = fleet()
    key, _ = p.route("s", 0.0)
    assert p.answered("s", key, False, 0.0, 0.0) is None  # taken: no longer fresh
    assert p.answered("s", key, True, 100.0, 0.1) is None
    assert p.where("s") == key and p.counts.sheds == 0


def test_fail_within_a_step_reroutes_outside_the_failed_servers_and_holds_the_server_back():
    p = fleet(slack=1e9)
    order = rank("s", KEYS)
    p.route("s", 0.0)
    assert p.fail("s", order[0], (), 1.0) == (order[1], order[0])
    assert p.fail("s", order[1], (order[0],), 1.0) == (order[2], order[1])
    # the failed servers take no new sessions for FAIL_HOLD_S
    for s in (f"n{i}" for i in range(100)):
        assert p.route(s, 1.0 + FAIL_HOLD_S / 2)[0] not in order[:2]
    assert order[0] in place(p, [f"m{i}" for i in range(100)], now=1.0 + FAIL_HOLD_S).values()
    assert p.fail("other-session-never-placed", order[2], (), 2.0) == (None, None)


def test_miss_limit_misses_move_the_sessions_and_hold_the_server_back():
    p = fleet(slack=1e9)
    order = rank("s", KEYS)
    p.route("s", 0.0)
    p.outcome(order[0], "timeout", 1.0)
    assert p.route("s", 1.001) == (order[0], None)  # one miss: stays
    p.outcome(order[0], "ok", 1.02)
    p.outcome(order[0], "timeout", 1.04)
    assert p.route("s", 1.041) == (order[0], None)  # an answer in between: the count starts again
    p.outcome(order[0], "timeout", 1.06)
    assert p.route("s", 1.061) == (order[1], order[0])  # miss_limit misses in a row: moves
    # held back while its client still reports it usable (its breaker not open yet) ...
    assert all(p.route(f"n{i}", 1.06 + FAIL_HOLD_S / 2)[0] != order[0] for i in range(50))
    assert any(p.route(f"m{i}", 1.06 + FAIL_HOLD_S)[0] == order[0] for i in range(50))
    # ... and once the client reported it (breaker open), its breaker alone decides: half-open is back
    p.outcome(order[0], "timeout", 3.0)
    p.outcome(order[0], "timeout", 3.0)
    p.set_usable(order[0], False)
    p.set_usable(order[0], True)
    assert any(p.route(f"k{i}", 3.01)[0] == order[0] for i in range(50))
    p.outcome(order[0], "ok", 4.0)
    assert p.servers[order[0]].misses == 0


def test_server_leaving_dns_loses_its_sessions_and_free_forgets():
    p = fleet(slack=1e9)
    placed = place(p, [f"s{i}" for i in range(200)])
    gone = KEYS[2]
    p.remove(gone)
    for s, key in placed.items():
        new, left = p.route(s, 1.0)
        assert new != gone
        assert (left == gone) == (key == gone)
    assert p.servers[gone].load == 0
    p.drop(gone)
    assert gone not in p.servers
    assert p.free("s0") is not None and p.free("s0") is None
    assert sum(s.load for s in p.servers.values()) == len(p.seats) == 199


def test_settings_checked():
    with pytest.raises(ValueError):
        Placement(load_slack=-0.1)
    with pytest.raises(ValueError):
        Placement(miss_limit=0)
