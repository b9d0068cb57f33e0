"""Every flag an operator can pass to draft-server serve, draft-soak and draft-bench says what it
does in --help, and the extras make those commands work after `pip install .[server]`."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from draft_server.cli import serve_parser
from draft_tools.soak.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()
    ]


def test_serve_and_soak_flags_have_help() -> None:
    assert undocumented(serve_parser()) == []
    assert undocumented(build_parser()) == []


def test_bench_flags_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    from draft_tools.bench.rpc import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: draft-bench")
    for flag, words in (("--iters", "timed calls"), ("--out", "JSON file")):
        assert flag in out and words in out


def test_server_extra_brings_the_tools() -> None:
    """draft-soak needs psutil and matplotlib at the end of a run (report and plots): they must
    come with `pip install .[server]`, not only with the test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for r in reqs:
            name = r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
            if name == project["name"]:  # a self-reference: draft-service[tools]
                out |= names(extras[r.split("[", 1)[1].split("]")[0]])
            else:
                out.add(name)
        return out

    assert {"torch", "safetensors", "psutil", "matplotlib"} <= names(extras["server"])
    assert extras["vllm"] == ["vllm==0.32.0"]
    assert {"draft-soak", "draft-bench", "draft-server"} <= set(project["scripts"])
