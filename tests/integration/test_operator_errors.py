"""Every bad input an operator can type is ONE line on stderr naming the culprit, and exit code 2.

Each case runs the real `python -m draft_server` in a subprocess (what an operator sees,
import-time failures included) with the checksum drafter where no model is needed.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SERVE = [sys.executable, "-m", "draft_server", "serve"]


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def one_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    """The single stderr line of a refused start; it names every needle."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def taken_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def checksum(*extra: str) -> list[str]:
    return [*SERVE, "--drafter", "checksum", *extra]


# ----------------------------------------------------------------------------- ports and addresses


def test_rpc_port_in_use(taken_port: int) -> None:
    bind = f"tcp://127.0.0.1:{taken_port}"
    one_line(run(checksum("--bind", bind, "--metrics-port", "-1")), bind, "in use")


def test_metrics_port_in_use(taken_port: int) -> None:
    res = run(checksum("--bind", "tcp://127.0.0.1:*", "--metrics-port", str(taken_port)))
    one_line(res, f"--metrics-port {taken_port}", "in use")


def test_bind_without_scheme() -> None:
    one_line(run(checksum("--bind", "127.0.0.1:5557")), "'127.0.0.1:5557'", "tcp://")


def test_bind_to_an_address_this_host_lacks() -> None:
    one_line(run(checksum("--bind", "tcp://nosuchif0:5557", "--metrics-port", "-1")), "nosuchif0", "no such address")


def test_bad_metrics_host() -> None:
    res = run(checksum("--bind", "tcp://127.0.0.1:*", "--metrics-host", "::2", "--metrics-port", "0"))
    one_line(res, "--metrics-host ::2")


# ----------------------------------------------------------------------------- device and torch


def test_device_cuda_without_a_gpu() -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU host too
    res = run([*SERVE, "--model", "random:k3", "--device", "cuda"], env={"CUDA_VISIBLE_DEVICES": ""})
    one_line(res, "--device cuda", "no CUDA GPU", "torch ")


def test_device_gpu_is_not_a_device() -> None:
    one_line(run([*SERVE, "--model", "random:k3", "--device", "gpu"]), "'gpu'", "cuda:N")


def test_base_install_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; from draft_server.cli import main; "
        "sys.exit(main(['serve', '--model', 'random:k3', '--metrics-port', '-1']))"
    )
    one_line(run([sys.executable, "-c", code]), "torch", "pip install 'draft-service[server]'")


# ----------------------------------------------------------------------------- config values and files


def test_unknown_log_level() -> None:
    one_line(run(checksum("--log-level", "LOUD")), "log_level 'LOUD'", "DEBUG")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('watchdog_exit = "no"\n', ("watchdog_exit = 'no'", "true or false")),
        ('max_sessions = "12"\n', ("max_sessions = '12'", "integer")),
        ("[server]\nsession_ttl_s = true\n", ("session_ttl_s = True", "number")),
        ("max_sessions = \n", ("not valid TOML", "line 1")),
    ],
    ids=["bool-as-string", "int-as-string", "float-as-bool", "syntax"],
)
def test_bad_toml_names_the_file_and_key(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    conf = tmp_path / "draft-server.toml"
    conf.write_text(text)
    one_line(run(checksum("--config", str(conf))), str(conf), *needles)


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    one_line(run(checksum("--config", str(missing))), str(missing), "No such file")


def test_toml_numbers_and_booleans_still_load(tmp_path: Path) -> None:
    from draft_server.config import ServerConfig

    conf = tmp_path / "ok.toml"
    conf.write_text("[server]\nwatchdog_exit = true\nsession_ttl_s = 30\nmax_sessions = 12\n")
    cfg = ServerConfig.from_toml(str(conf))
    assert cfg.watchdog_exit is True and cfg.session_ttl_s == 30.0 and isinstance(cfg.session_ttl_s, float)


# ----------------------------------------------------------------------------- keygen


def test_keygen_creates_the_directory_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    keys = tmp_path / "a" / "keys"
    keygen = [sys.executable, "-m", "draft_server", "keygen", "--dir", str(keys), "--name", "server"]
    first = run(keygen)
    assert first.returncode == 0, first.stderr
    public, secret = keys / "server.key", keys / "server.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    before = secret.read_bytes()

    one_line(run(keygen), str(keys), "exists", "--force")
    assert secret.read_bytes() == before  # untouched

    forced = run([*keygen, "--force"])
    assert forced.returncode == 0, forced.stderr
    assert secret.read_bytes() != before and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_keygen_into_an_unwritable_place(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run([sys.executable, "-m", "draft_server", "keygen", "--dir", str(blocker / "keys")])
    one_line(res, str(blocker / "keys"))
