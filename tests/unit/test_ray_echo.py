"""``draft_tools.bench.ray_echo``'s parent/child plumbing, without Ray: the child runs under an
interpreter whose ``ray`` is a small in-process stand-in that records what the deployment got, so the
test holds the harness to sending each payload's exact bytes, timing ``iters`` calls after its warm-up,
and failing with a clear error when the interpreter has no Ray."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from draft_tools.bench import ray_echo

FAKE_RAY = """
__version__ = "0.0-fake"
def init(**kw):
    assert kw.get("include_dashboard") is False
def shutdown():
    pass
"""

FAKE_SERVE = """
import asyncio, json, os
LOG = os.environ["FAKE_RAY_LOG"]
def start(http_options=None):
    assert http_options == {"location": "NoServer"}
def deployment(**kw):
    def wrap(cls):
        class D:
            @staticmethod
            def bind():
                return cls()
        return D
    return wrap
class _Resp:
    def __init__(self, v):
        self.v = v
    def result(self):
        return self.v
class _Handle:
    def __init__(self, obj):
        self.obj = obj
    def remote(self, data):
        with open(LOG, "a") as f:
            f.write(json.dumps([len(data), data[:8].hex()]) + "\\n")
        out = self.obj(data)
        return _Resp(asyncio.run(out) if asyncio.iscoroutine(out) else out)
def run(app, name, route_prefix):
    assert route_prefix is None
    return _Handle(app)
def shutdown():
    pass
"""


def _interpreter(tmp_path, with_ray: bool) -> str:
    """A wrapper around this interpreter whose imports see the stand-in ``ray`` (or none)."""
    site = tmp_path / "site"
    if with_ray:
        (site / "ray").mkdir(parents=True)
        (site / "ray" / "__init__.py").write_text(FAKE_RAY)
        (site / "ray" / "serve.py").write_text(FAKE_SERVE)
    else:
        site.mkdir()
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def test_each_payload_reaches_the_deployment_whole_and_is_timed(tmp_path, monkeypatch) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_RAY_LOG", str(log))
    python = _interpreter(tmp_path, with_ray=True)
    assert ray_echo.available(python)
    payloads = [b"\x01" * 300, bytes(range(256)) * 3]
    out = ray_echo.echo_ms(payloads, iters=7, python=python)
    assert out["ray"] == "0.0-fake" and len(out["ms"]) == 2 and all(ms >= 0 for ms in out["ms"])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # 20 untimed, then 7 timed calls per payload, in order, each with the payload's own bytes
    assert calls == [[300, "01" * 8]] * 27 + [[768, bytes(range(8)).hex()]] * 27


def test_an_interpreter_without_ray_is_refused_clearly(tmp_path) -> None:
    python = _interpreter(tmp_path, with_ray=False)
    assert not ray_echo.available(python)
    assert not ray_echo.available(os.path.join(tmp_path, "no-such-python"))
    with pytest.raises(RuntimeError, match="ray echo failed"):
        ray_echo.echo_ms([b"x"], iters=1, python=python)
