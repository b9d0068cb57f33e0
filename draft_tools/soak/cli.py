"""`draft-soak`: drive a draft server with synthetic target engines while injecting faults.

Owns the soak command: it starts and supervises a draft server (or ``--servers N`` of them side
by side, or attaches to a running one), starts several synthetic target engines (``soak_engine``,
one process and one client each: a DraftClient, or a FleetClient over the N servers), optionally
a fault-injecting proxy between them and the servers (``chaos_proxy``) and
rogue clients (``chaos_rogue``), runs the chaos schedule, samples the server (RSS, GPU memory,
live sessions), and then writes a JSON report, PNG plots and a one-screen summary. The exit
code is 1 when an invariant breaks, 2 when the soak itself could not run.

Chaos modes (``--chaos``, each with its own rate flags):

  kill    SIGKILL the server, restart it on the same port        (--kill-every-s, --down-ms)
  pause   SIGSTOP, then SIGCONT                                    (--pause-every-s, --pause-ms)
  drop    the proxy drops a fraction of requests and of replies   (--drop-request-p, --drop-reply-p)
  delay   the proxy holds back a fraction of engine steps          (--delay-p, --delay-ms)
  slow    the drafter sleeps before a fraction of draft batches    (--slow-p, --slow-ms)
  rogue   bursts of malformed and oversized frames                  (--rogue-every-s, --rogue-messages)
  vanish  a client opens sessions and disconnects without Free     (--vanish-every-s, --vanish-sessions)
  flood   one Step with more sessions than the server's capacity   (--flood-every-s, --flood-sessions)
  fuzz    a steady stream of hostile messages (the decoder fuzz)   (--fuzz-messages)
  sflood  a client opens twice the session capacity                  (--neighbour-every-s)
  rflood  a client queues more rows than the whole queue, unawaited  (--neighbour-every-s, --rflood-rows)
  nan     a client's taps hold NaN and Inf                           (--neighbour-every-s)
  hijack  a second connection presents an engine's routing id        (--neighbour-every-s)
  stale   a client's steps say they were sent 10 s ago               (--neighbour-every-s)
  taps    engines send early taps then commits (protocol.Phase); the proxy drops a fraction of
          both (lost taps: MISSING_ROWS, then resent; lost commit: that step's drafts)   (--taps-drop-p)
          only when named (not in "all"), with one server

Invariants (all must hold for exit code 0):

  wait_within_budget     every step() returned within its budget + 5 ms, net of the time the
                         host did not run the engine (run-queue wait, steal); every call over the
                         bound that this does not explain gets forensics (GC, page faults, the
                         other threads' CPU, the canary, and every thread's stack at the bound)
  drafts_valid           every reply carried k valid token ids when OK, none otherwise
  drafts_match_context   (checksum) every draft is the checksum of exactly the context its reply
                         names ([start, end)), faults or not
  resume_after_restart   after each restart, drafting is back within --resume-steps engine
                         steps counted from the first step that started after READY
  moved_sessions_resume  (--servers > 1) every session that moved to another server went at
                         most --resume-steps steps without drafts around the move (a failed
                         server costs its sessions at most that many steps)
  zero_sessions_at_end   no server holds a session once the engines finished (Free, TTL)
  memory_flat            server RSS grows less than --rss-tolerance-mib and GPU memory (nvidia-smi,
                         and bytes held by tensors) less than --gpu-tolerance-mib after warm-up,
                         within each server process
  untouched_equal_reference  sessions no fault touched drafted exactly what a fault-free run
                         drafts (checksum: computed in process; a model: a second fault-free pass;
                         --reference-min-agreement below 1 for drafters that are not batch-invariant)
  server_healthy         no unexpected server exit, no engine/I/O errors in its metrics
  engines_completed      every engine process ran to the end
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

from draft_tools.soak.report import analyze, make_plots, summary_text
from draft_tools.soak.run import ALL_MODES, EXTRA_MODES, ChaosEvent, RunResult, run_pass

# ------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="draft-soak",
        description="Soak a draft server with synthetic target engines under fault injection.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("run")
    g.add_argument("--duration-s", type=float, default=60.0, help="length of the chaos pass")
    g.add_argument("--engines", type=int, default=2, help="synthetic target engines (one process and client each)")
    g.add_argument("--sessions", type=int, default=16, help="concurrent sessions per engine")
    g.add_argument("--budget-ms", type=float, default=20.0, help="draft budget per step")
    g.add_argument("--step-ms", type=float, default=25.0, help="the target's own time per step (sleep between calls)")
    g.add_argument("--k", type=int, default=4, help="drafts per step")
    g.add_argument("--long-prefill-rows", type=int, default=2048, help="rows of the occasional long prompt")
    g.add_argument("--prefill-rows", default="16,128", help="LO,HI rows of an ordinary prompt")
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice (prompts, chaos timing)")
    g.add_argument("--out", default="soak-out", help="directory for the JSON report and the PNG plots")
    g.add_argument("--report-name", default="soak.json", help="file name of the JSON report in --out")
    g.add_argument("--raw-dir", default="", help="keep the raw records of the run here (default: a temp dir)")
    g.add_argument("--from-raw", default="", help="analyse the raw records a run kept in --raw-dir again")
    g.add_argument("--warmup-s", type=float, default=3.0, help="no chaos before this")
    g.add_argument("--cooldown-s", type=float, default=3.0, help="no chaos in the last seconds")
    g.add_argument("--chaos-gap-s", type=float, default=1.0, help="least time between two discrete chaos events")
    g.add_argument("--sample-s", type=float, default=0.5, help="server sampling period (RSS, GPU, /metrics)")
    g.add_argument("--end-grace-s", type=float, default=10.0, help="extra wait beyond the TTL for zero sessions")
    g.add_argument("--reconnect-ivl-ms", type=int, default=10, help="engines' ZeroMQ reconnect interval")
    g.add_argument(
        "--transport",
        choices=("frames", "shm"),
        default="frames",
        help="where the engines' rows travel: in the messages, or through each engine's shared-memory rings, "
        "written in place into regions it claims (DraftClient.claim_rows) as the vLLM proposer does (one "
        "server), copied in when none is free (or with --servers above 1: one ring per server)",
    )
    g.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a second fault-free pass and compare drafts (default: on for models, off for checksum)",
    )
    g.add_argument(
        "--reference-min-agreement",
        type=float,
        default=1.0,
        help="1.0: untouched sessions must draft exactly what the reference pass drafted. Below 1: the share "
        "of each one's draft tokens that must agree, for drafters that are not batch-invariant (bf16 on a GPU)",
    )
    s = ap.add_argument_group("server (started and supervised by the soak)")
    s.add_argument(
        "--servers",
        type=int,
        default=1,
        help="draft servers side by side; above 1 every engine drafts through a FleetClient over all of them, "
        "each discrete chaos event hits one of them, and sessions moved off a killed or paused server must "
        "draft again within --resume-steps steps (invariant moved_sessions_resume)",
    )
    s.add_argument("--drafter", default="checksum", choices=["checksum", "dspark"], help="server --drafter")
    s.add_argument("--model", default="", help="DSpark draft checkpoint (with --drafter dspark)")
    s.add_argument("--target-model", default="", help="target head checkpoint")
    s.add_argument("--device", default="", help="server --device")
    s.add_argument("--session-ttl-s", type=float, default=5.0, help="server --session-ttl-s (vanished sessions go)")
    s.add_argument("--max-sessions", type=int, default=256, help="server --max-sessions")
    s.add_argument("--max-message-mib", type=int, default=8, help="server --max-message-mib")
    s.add_argument("--server-arg", action="append", default=[], help="extra `draft-server serve` flag (repeatable)")
    at = ap.add_argument_group("attach to a running server instead")
    at.add_argument("--endpoint", default="", help="the server's endpoint; the soak starts no server")
    at.add_argument("--metrics-port", type=int, default=0, help="its /metrics port (0: no sampling of sessions)")
    at.add_argument("--server-pid", type=int, default=None, help="its pid: enables pause and RSS sampling")
    c = ap.add_argument_group("chaos")
    c.add_argument("--chaos", default="all", help=f"comma list of modes, 'all' or 'none': {','.join(ALL_MODES)}")
    c.add_argument("--kill-every-s", type=float, default=20.0, help="period of SIGKILL + restart (kill)")
    c.add_argument("--down-ms", type=float, default=200.0, help="time between SIGKILL and the restart")
    c.add_argument("--pause-every-s", type=float, default=15.0, help="period of SIGSTOP/SIGCONT (pause)")
    c.add_argument("--pause-ms", type=float, default=700.0, help="how long a pause lasts")
    c.add_argument("--drop-request-p", type=float, default=0.005, help="share of requests the proxy drops (drop)")
    c.add_argument("--drop-reply-p", type=float, default=0.005, help="share of replies the proxy drops (drop)")
    c.add_argument(
        "--taps-drop-p", type=float, default=0.02, help="share of early Taps and of Commits the proxy drops (taps)"
    )
    c.add_argument("--delay-p", type=float, default=0.005, help="share of Step requests the proxy holds back (delay)")
    c.add_argument("--delay-ms", type=float, default=60.0, help="how long a held-back request waits")
    c.add_argument("--slow-p", type=float, default=0.003, help="share of draft batches slowed in the server (slow)")
    c.add_argument("--slow-ms", type=float, default=60.0, help="extra time of a slowed draft batch")
    c.add_argument("--rogue-every-s", type=float, default=10.0, help="period of a malformed-message burst (rogue)")
    c.add_argument("--rogue-messages", type=int, default=300, help="messages in one malformed burst")
    c.add_argument(
        "--vanish-every-s", type=float, default=10.0, help="period of a client that leaves without Free (vanish)"
    )
    c.add_argument("--vanish-sessions", type=int, default=8, help="sessions a vanishing client leaves behind")
    c.add_argument("--flood-every-s", type=float, default=25.0, help="period of a flood past --max-sessions (flood)")
    c.add_argument("--flood-sessions", type=int, default=0, help="0: --max-sessions + 64")
    c.add_argument("--fuzz-messages", type=int, default=5000, help="decoder fuzz messages over the run")
    c.add_argument(
        "--neighbour-every-s",
        type=float,
        default=20.0,
        help="period of each noisy-neighbour mode: sflood (2 x max-sessions new sessions), rflood (16 "
        "ingest-only steps of --rflood-rows rows, unawaited), nan (NaN/Inf taps), hijack (an engine's "
        "routing id from a second connection), stale (steps stamped 10 s old)",
    )
    c.add_argument("--rflood-rows", type=int, default=2048, help="rows per step of the row flood")
    i = ap.add_argument_group("invariants")
    i.add_argument("--resume-steps", type=int, default=2, help="drafting must be back within this many steps")
    i.add_argument("--rss-tolerance-mib", type=float, default=48.0, help="server RSS growth allowed after warm-up")
    i.add_argument("--gpu-tolerance-mib", type=float, default=256.0, help="server GPU memory growth allowed")
    i.add_argument("--mem-warmup-s", type=float, default=5.0, help="per server process, before the baseline")
    i.add_argument("--mem-window", type=int, default=5, help="samples averaged for the baseline and the end")
    return ap


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(Exception):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(Exception):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            info["gpus"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                .stdout.strip()
                .splitlines()
            )
    return info


def _save_result(res: RunResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(res), f, default=str)


def _load_result(path: str) -> RunResult:
    with open(path) as f:
        d = json.load(f)
    d["events"] = [ChaosEvent(**e) for e in d["events"]]
    d["last_metrics"] = {int(k): v for k, v in d["last_metrics"].items()}
    d["host_stalls"] = [tuple(x) for x in d["host_stalls"]]
    return RunResult(**d)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    modes = [] if args.chaos == "none" else list(ALL_MODES) if args.chaos == "all" else args.chaos.split(",")
    unknown = [m for m in modes if m not in ALL_MODES + EXTRA_MODES]
    if unknown:
        known = ", ".join(ALL_MODES + EXTRA_MODES)
        print(f"draft-soak: unknown chaos modes {unknown} (known: {known})", file=sys.stderr)
        return 2
    if args.servers < 1:
        print("draft-soak: --servers must be >= 1", file=sys.stderr)
        return 2
    if args.endpoint and args.servers > 1:
        print("draft-soak: --servers supervises its own servers; it does not go with --endpoint", file=sys.stderr)
        return 2
    if args.endpoint:
        dropped = [m for m in modes if m in ("kill", "slow") or (m == "pause" and args.server_pid is None)]
        if dropped:
            print(f"draft-soak: attached to {args.endpoint}: chaos {dropped} disabled (needs a supervised server)")
            modes = [m for m in modes if m not in dropped]
    if args.drafter == "dspark" and not args.model and not args.endpoint:
        print("draft-soak: --drafter dspark needs --model", file=sys.stderr)
        return 2
    args.modes = modes

    def _terminate(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_pass's cleanup (engines, proxy, server)

    signal.signal(signal.SIGTERM, _terminate)
    reference = args.reference if args.reference is not None else args.drafter != "checksum"
    os.makedirs(args.out, exist_ok=True)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    machine = _machine()  # before the run: the git commit the run started from
    with contextlib.ExitStack() as stack:
        work = args.raw_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="draft-soak-"))
        os.makedirs(work, exist_ok=True)
        try:
            if args.from_raw:  # analyse a kept run again (report and plots only)
                kept = os.path.join(args.from_raw, "run.json")
                if os.path.exists(kept):  # when, where and from which commit the run was made
                    with open(kept) as f:
                        run = json.load(f)
                    machine, started = run["machine"], run["started_utc"]
                res = _load_result(os.path.join(args.from_raw, "result-1.json"))
                ref_path = os.path.join(args.from_raw, "result-0.json")
                ref = _load_result(ref_path) if os.path.exists(ref_path) else None
            else:
                with open(os.path.join(work, "argv.json"), "w") as f:
                    json.dump(argv, f)
                with open(os.path.join(work, "run.json"), "w") as f:
                    json.dump({"machine": machine, "started_utc": started}, f)
                res = run_pass(args, work, chaos=True)
                _save_result(res, os.path.join(work, "result-1.json"))
                ref = None
                if reference:
                    steps = [int(e.get("steps") or 0) for e in res.engines]
                    ref = run_pass(args, work, chaos=False, max_steps=steps)
                    _save_result(ref, os.path.join(work, "result-0.json"))
        except (RuntimeError, OSError) as e:
            print(f"draft-soak: could not run: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("draft-soak: interrupted; everything it started is stopped", file=sys.stderr)
            return 130
    report = analyze(args, res, ref)
    report_path = os.path.join(args.out, args.report_name)
    cfg = {k: v for k, v in vars(args).items()}
    command = "draft-soak " + " ".join(argv)
    original = os.path.join(args.from_raw, "argv.json") if args.from_raw else ""
    if original and os.path.exists(original):
        with open(original) as f:
            command = "draft-soak " + " ".join(json.load(f))
    report = {
        "tool": "draft-soak",
        "command": command,
        "analysed_with": ("draft-soak " + " ".join(argv)) if args.from_raw else None,
        "started_utc": started,
        "duration_s": round(res.t_end - res.t_start, 2),
        "machine": machine,
        "config": cfg,
        "report_path": report_path,
        **report,
    }
    report["plots"] = [
        os.path.basename(p) for p in make_plots(args, res, args.out, os.path.splitext(args.report_name)[0])
    ]
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(summary_text(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
