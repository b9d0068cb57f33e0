"""One benchmark at two commits, side by side in one run: before (``--base``) and after (this tree).

Owns the A/B runner the speed claims of a change rest on. It checks ``--base`` out into a git
worktree (``.ab/<sha>``, git-ignored, reused), then runs the benchmark module alternately there
and in this tree, ``--rounds`` times each (the order flips every round, so drift in the machine's
load falls on both sides alike), each run writing its JSON to a file of its own through the
module's ``--out``. The runs of a side are merged: every number is the median over its rounds,
anything else is the first run's. Writes one JSON: the command, the machine, both commits, the
rounds, ``before`` and ``after``, and every run's own JSON (``runs``: the spread behind each median);
and prints each side's runs as they end. The JSON is written after every run, ``complete`` false
until the last: a call cut off by a time limit keeps the runs that finished.

    python -m draft_tools.bench.ab --base HEAD~1 --rounds 4 --out bench/results/x_ab.json -- \\
        draft_tools.bench.rpc --iters 200

A module runs with its tree as the working directory, so ``python -m`` imports that tree's code
(and so do the processes it starts). The module must take ``--out PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from draft_tools.common import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def this_tree(repo: str = ROOT) -> str:
    """The commit this working tree is at, "+ uncommitted changes" when it differs from it (a GPU box's copy
    may carry an older history under newer files: then it says so); ``AB_AFTER`` or a plain word without git."""
    try:
        dirty = bool(git(repo, "status", "--porcelain", "--untracked-files=no"))
        return git(repo, "rev-parse", "HEAD") + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without its history (a GPU box)
        return os.environ.get("AB_AFTER", "this tree (no git history here)")


def worktree(repo: str, rev: str) -> tuple[str, str]:
    """(path, sha) of a worktree of ``rev`` under the repository's .ab/, made once and reused. A
    directory ``rev`` is taken as the base tree itself (a machine with no git history: ``export``
    wrote it, and its commit in ``.ab_sha``)."""
    if os.path.isdir(rev):
        stamp = os.path.join(rev, ".ab_sha")
        return os.path.abspath(rev), open(stamp).read().strip() if os.path.exists(stamp) else rev
    sha = git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    path = os.path.join(repo, ".ab", sha[:12])
    if not os.path.isdir(path):
        git(repo, "worktree", "add", "--detach", path, sha)
    return path, sha


def merge(runs: list[Any]) -> Any:
    """Runs of one side as one: numbers by their median (equal ones as they are: keys such as a
    batch size keep their type), dicts key by key, lists of one length item by item, anything else
    as the first run has it."""
    first = runs[0]
    if any(isinstance(r, bool) for r in runs) or all(r == first for r in runs):  # flags, keys: as they are
        return first
    if all(isinstance(r, int | float) and not isinstance(r, bool) for r in runs):
        m = statistics.median(runs)
        return round(m, 6) if isinstance(m, float) else m
    if all(isinstance(r, dict) for r in runs):
        return {k: merge([r[k] for r in runs if k in r]) for k in first}
    if all(isinstance(r, list) for r in runs) and len({len(r) for r in runs}) == 1:
        return [merge([r[i] for r in runs]) for i in range(len(first))]
    return first


def run_once(tree: str, module: str, args: list[str], out: str, timeout_s: float) -> Any:
    """One run of ``module`` in ``tree``; its JSON."""
    cmd = [sys.executable, "-m", module, *args, "--out", out]
    env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        raise SystemExit(f"{module} failed in {tree} (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        res = json.load(f)
    print(f"  {tree}: {time.monotonic() - t0:.1f} s", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="python -m draft_tools.bench.ab", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--base",
        required=True,
        help="the commit to compare against (any git revision), or a tree written by --export",
    )
    ap.add_argument(
        "--export",
        default="",
        metavar="DIR",
        help="only write --base's tree (bench results left out) into DIR, its commit in DIR/.ab_sha, and exit: "
        "a base for a machine without the git history (carry DIR, then --base DIR there)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="the longest one run may take")
    ap.add_argument("--out", default="", help="the A/B JSON (required but with --export)")
    ap.add_argument("--repo", default=ROOT, help="the repository whose working tree is the after side")
    a = ap.parse_args(argv[:split])
    bench = argv[split + 1 :]
    repo = os.path.abspath(a.repo)
    if a.export:
        sha = git(repo, "rev-parse", "--verify", f"{a.base}^{{commit}}")
        os.makedirs(a.export, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", sha, "--", ".", ":!bench/results"], cwd=repo, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", a.export], input=archive, check=True)
        with open(os.path.join(a.export, ".ab_sha"), "w") as f:
            f.write(sha + "\n")
        print(f"{a.export}: {sha}")
        return 0
    if not bench:
        ap.error("name the benchmark module after --, with its arguments (not --out)")
    if not a.out:
        ap.error("--out is required")
    module, args = bench[0], bench[1:]
    base, base_sha = worktree(repo, a.base)
    after_sha = this_tree(repo)
    sides: dict[str, list[Any]] = {"before": [], "after": []}

    def report(complete: bool) -> dict[str, Any]:
        return {
            "benchmark": f"A/B of {module}",
            "command": "python -m draft_tools.bench.ab " + " ".join(argv),
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "commits": {"before": base_sha, "after": after_sha},
            "rounds": a.rounds,
            # False while runs are still to come: a run cut short (a device call's time limit) keeps what finished
            "complete": complete,
            "method": "the sides run alternately, the order flipping every round; every number is its side's median",
            "before": merge(sides["before"]) if sides["before"] else None,
            "after": merge(sides["after"]) if sides["after"] else None,
            "runs": sides,  # each round's JSON as it came, so the spread behind each median shows
        }

    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        for r in range(a.rounds):
            order = [("before", base), ("after", repo)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                out = os.path.join(tmp, f"{side}-{r}.json")
                sides[side].append(run_once(tree, module, args, out, a.timeout_s))
                write_report(a.out, report(complete=False))
    write_report(a.out, report(complete=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
