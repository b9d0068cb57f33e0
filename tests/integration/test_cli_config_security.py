"""CLI, TOML config and CurveZMQ: what an operator types, and who may talk to the server."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import zmq.auth

from draft_server.config import ServerConfig
from protocol import Status
from target_client import ClientConfig, DraftClient, StepRequest
from tests.conftest import ROOT, ServerProc, random_taps


def test_help_explains_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "draft_server", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert " ".join(f.metadata["help"].split())[:40] in text, f.name


def test_toml_config_and_flag_precedence(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('[server]\ndrafter = "checksum"\nmax_sessions = 7\nmax_queue_rows = 100\n')
    srv = ServerProc("--config", str(cfg), "--max-queue-rows", "200", drafter="checksum").start()
    try:
        met = srv.metrics()
        assert met["draft_server_max_sessions"] == 7  # from the file
        assert met["draft_server_max_queue_rows"] == 200  # the flag wins over the file
    finally:
        srv.kill()
    bad = tmp_path / "bad.toml"
    bad.write_text("max_sesions = 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "draft_server", "serve", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "unknown config keys ['max_sesions']" in out.stderr


def test_bad_config_values_fail_with_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "draft_server", "serve", "--drafter", "checksum", "--max-queue-rows", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["draft-server: config error: max_queue_rows must be > 0, got 0"]


@pytest.mark.timeout(120)
def test_curve_encryption_with_allow_list(tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_pub, server_secret = zmq.auth.create_certificates(str(keys), "server")
    good_pub_file, good_secret_file = zmq.auth.create_certificates(str(keys), "good")
    (allowed / "good.key").write_bytes(open(good_pub_file, "rb").read())  # only good's public key is allowed
    bad_pub_file, bad_secret_file = zmq.auth.create_certificates(str(keys), "bad")
    srv = ServerProc("--curve-secret-key-file", server_secret, "--curve-allow-dir", str(allowed)).start()
    spub, _ = zmq.auth.load_certificate(server_pub)
    try:

        def client(pub_file: str, secret_file: str, name: str) -> DraftClient:
            pub, sec = zmq.auth.load_certificate(secret_file)
            return DraftClient(
                ClientConfig(
                    endpoint=srv.endpoint,
                    budget_ms=2000.0,
                    name=name,
                    connect_timeout_s=2.0,
                    curve_server_key=spub,
                    curve_public_key=pub,
                    curve_secret_key=sec,
                )
            )

        good = client(good_pub_file, good_secret_file, "good")
        assert good.connect(wait=True) is not None
        taps = random_taps(np.random.default_rng(0), 2)
        r = good.step([StepRequest("s", 0, 2, 1, 3)], taps)
        assert r[0].status == Status.OK and len(r[0].tokens) == 3
        good.close()

        bad = client(bad_pub_file, bad_secret_file, "bad")
        assert bad.connect(wait=False) is None
        r = bad.step([StepRequest("s", 0, 2, 1, 3)], taps, budget_ms=200.0)
        assert r[0].tokens == []  # not allowed: never answered
        bad.close()
    finally:
        srv.kill()
