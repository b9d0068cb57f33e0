"""draft_tools.bench.ab: one benchmark module at two commits of a repository, alternately, merged
by median; each side runs its own tree's code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from draft_tools.bench.ab import main, merge

BENCH = """
import argparse, json, sys
SPEED = {speed}
ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--scale", type=int, default=1)
a = ap.parse_args()
calls = int(open("calls.txt").read()) + 1 if __import__("os").path.exists("calls.txt") else 1
open("calls.txt", "w").write(str(calls))
row = {{"B": 1, "ms": SPEED * a.scale + calls % 2, "mode": "x", "ok": True}}
json.dump({{"rows": [row], "tree": SPEED}}, open(a.out, "w"))
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _repo(tmp_path: Path, after: str = BENCH.format(speed=4)) -> Path:
    """A repository whose last commit is a slow benchmark and whose tree holds ``after``, committed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    (repo / ".gitignore").write_text(".ab/\ncalls.txt\n")
    (repo / "benchmod.py").write_text(BENCH.format(speed=10))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "slow")
    (repo / "benchmod.py").write_text(after)
    _git(repo, "commit", "-q", "-am", "fast")
    return repo


def test_each_side_runs_its_own_commit_and_numbers_are_medians(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    out = tmp_path / "ab.json"
    args = ["--repo", str(repo), "--base", "HEAD~1", "--rounds", "3", "--out", str(out), "--", "benchmod"]
    assert main([*args, "--scale", "2"]) == 0
    rep = json.loads(out.read_text())
    assert rep["before"]["tree"] == 10 and rep["after"]["tree"] == 4  # each side imported its own commit
    # per tree, runs alternate +1/+0 (a counter file in each tree): the median of 3 runs
    assert rep["before"]["rows"][0]["ms"] in (20, 21) and rep["after"]["rows"][0]["ms"] in (8, 9)
    assert rep["before"]["rows"][0]["mode"] == "x" and rep["before"]["rows"][0]["ok"] is True
    assert rep["commits"]["after"].startswith(
        subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=repo, text=True).strip()
    )
    assert rep["rounds"] == 3 and "--scale 2" in rep["command"]
    # every run kept as it came: the spread behind each median
    assert sorted(r["rows"][0]["ms"] for r in rep["runs"]["after"]) in ([8, 8, 9], [8, 9, 9])
    assert [r["tree"] for r in rep["runs"]["before"]] == [10, 10, 10]
    assert rep["complete"] is True


def test_a_run_cut_short_leaves_the_runs_that_finished_on_disk(tmp_path: Path) -> None:
    # the after side's benchmark fails on its second call: rounds go before, after | after (fails)
    fails = BENCH.format(speed=4).replace("row = {", "sys.exit(3) if calls == 2 else None\nrow = {")
    repo = _repo(tmp_path, after=fails)
    out = tmp_path / "ab.json"
    with pytest.raises(SystemExit, match="benchmod failed"):
        main(["--repo", str(repo), "--base", "HEAD~1", "--rounds", "2", "--out", str(out), "--", "benchmod"])
    rep = json.loads(out.read_text())
    assert rep["complete"] is False
    assert [r["tree"] for r in rep["runs"]["before"]] == [10] and [r["tree"] for r in rep["runs"]["after"]] == [4]
    assert rep["before"]["tree"] == 10 and rep["after"]["rows"][0]["ms"] == 5  # its one run: 4 + calls % 2


def test_merge() -> None:
    assert merge([3, 1, 2]) == 2
    assert merge([1, 1]) == 1 and isinstance(merge([1, 1]), int)  # a key, not a float median
    assert merge([{"a": 1.0, "s": "x"}, {"a": 3.0, "s": "y"}]) == {"a": 2.0, "s": "x"}
    assert merge([[1, 5], [3, 7]]) == [2, 6]
    assert merge([[1], [3, 7]]) == [1]  # lists of other lengths: the first run's
    assert merge([True, False]) is True
