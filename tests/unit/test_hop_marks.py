"""draft_tools.bench.hop_marks' alignment of the two sides' timestamps (no sockets): a step's server
marks are the first of each kind after the client's send, in order, all before its reply is read;
a step without the whole chain between those two (read by the I/O thread, say) is left out."""

from __future__ import annotations

from draft_tools.bench.hop_marks import SERVER_MARKS, align


def test_each_step_lines_up_into_segments_and_partial_chains_are_left_out() -> None:
    names = [name for name, _, _ in SERVER_MARKS]
    client = {"enter": [0.0, 100.0], "send": [1.0, 101.0], "sent": [2.0, 102.0], "reply_read": [20.0, 120.0],
              "return": [22.0, 121.0]}  # fmt: skip
    # step 0: every server mark 1 s apart from 3 s on; step 1: the chain stops short (no "sent")
    server = {name: [3.0 + i] for i, name in enumerate(names)}
    for name in names[:-1]:
        server[name].append(103.0 + names.index(name))
    res = align(client, server, skip=0)
    assert res["aligned_steps"] == 1
    assert res["client.enter -> client.send"] == 1e6 and res["client.sent -> server.engine_serve"] == 1e6
    assert res["server.send -> server.sent"] == 1e6
    assert res["server.sent -> client.reply_read"] == (20.0 - (3.0 + len(names) - 1)) * 1e6
    assert res["client.reply_read -> client.return"] == 2e6 and res["total"] == 22e6
    assert align(client, server, skip=1) == {"aligned_steps": 0}
