"""draft_tools.bench.hop_marks' alignment of the two sides' timestamps (no sockets): a step's server
marks are the first of each kind after the client's send, in order, before its reply is read (the
server's ``sent`` before the client's next step); the idle engine's marks (engine_serve, served) only
where the engine read the Step, else the step counts on the I/O thread's path; a step missing a
required mark is left out."""

from __future__ import annotations

from draft_tools.bench.hop_marks import SERVER_MARKS, align

NAMES = [name for name, _, _ in SERVER_MARKS]


def test_steps_line_up_by_path_and_partial_chains_are_left_out() -> None:
    client = {"enter": [0.0, 100.0, 200.0], "send": [1.0, 101.0, 201.0], "sent": [2.0, 102.0, 202.0],
              "reply_read": [20.0, 120.0, 220.0], "return": [22.0, 121.0, 222.0]}  # fmt: skip
    server: dict[str, list[float]] = {name: [] for name in NAMES}
    for i, name in enumerate(NAMES):  # step 0: the idle engine read it, every mark 1 s apart from 3 s on
        server[name].append(3.0 + i)
    io = [n for n in NAMES if n not in ("engine_serve", "served")]
    for i, name in enumerate(io):  # step 1: the I/O thread read it; the server's send returned late
        server[name].append(125.0 if name == "sent" else 103.0 + i)
    for i, name in enumerate(NAMES):  # step 2: no reply mark before the client read the reply
        if name not in ("reply", "send", "sent"):
            server[name].append(203.0 + i)
    server["engine_serve"].append(230.0)  # the engine's next idle read: after step 1's reply, not step 1's
    server["served"].append(230.5)
    for v in server.values():
        v.sort()
    res = align(client, server, skip=0)
    assert res["aligned_steps"] == 2
    eng, io_path = res["engine"], res["io"]
    assert eng["steps"] == 1 and io_path["steps"] == 1
    assert eng["client.enter -> client.send"] == 1e6 and eng["client.sent -> server.engine_serve"] == 1e6
    assert eng["server.send -> server.sent"] == 1e6
    assert eng["server.sent -> client.reply_read"] == (20.0 - (3.0 + len(NAMES) - 1)) * 1e6
    assert eng["client.reply_read -> client.return"] == 2e6 and eng["total"] == 22e6
    assert io_path["client.sent -> server.header_read"] == 1e6
    assert not any("served" in k or "engine_serve" in k for k in io_path)
    assert io_path["server.send -> client.reply_read"] == (120.0 - (103.0 + len(io) - 2)) * 1e6
    assert io_path["client.return -> server.sent"] == 4e6 and io_path["total"] == 21e6
    assert align(client, server, skip=2) == {"aligned_steps": 0}  # step 2 alone: its chain stops short
