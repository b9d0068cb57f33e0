"""Early taps vs the single message at K3 size on one GPU (H200), B = 1..64: the synthetic engine.

Starts `draft-server serve --model random:k3` (full-size K3 DSpark, random weights) on the GPU,
then for each batch size B drives it with ``draft_tools.synthetic.SyntheticTarget`` three times:
with early taps (each step's span sent first, ``--sample-ms`` of target sampling, then a commit),
with early taps and predicted commits (the commit right after the taps, its drafts collected after
sampling: what the vLLM proposer does for greedy requests; the taps carrying the whole verified span,
as the proposer did before, or only the rows up to the predicted end, as it does now), and with the
single message, and
records per step the critical-path wait (end of sampling, or the step, to drafts in hand) and the
server's compute for that reply. The issue's goal: wait - compute at
most 0.5 ms with early taps at every B. ``--transport shm`` runs every mode over ipc with the rows in
a shared-memory ring (spans of any size go early: the 4 MiB rule is for rows in frames). Writes
JSON (command, machine, GPU) and prints a table.

The first step carries every session's prefill (B x 256 rows: 294 MB of K3 taps at B = 16), more
than a 50 ms budget can take in: it misses, and the sessions catch up (``target_client.client.
resend``) until the server has it. Those steps are not measured: the run steps until one is fully
drafted (``catch_up_steps``, ``catch_up_s`` in the JSON), then ``--warmup`` steps, then ``--steps``.
``--forward-ms`` (10) sleeps between steps as a target's forward would. 0 steps back to back: a
catch-up is then many more steps for the same seconds (the server ingests a session's queued
entries in runs, as many per batch as ``max_batch_rows`` holds).
Needs the GPU host; one command:

    python -m draft_tools.bench.early_taps_gpu --out bench/results/early_taps_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from draft_tools.common import free_port, scrape, start_server, stop_server
from draft_tools.synthetic import SyntheticTarget
from protocol import PROTOCOL_VERSION
from target_client import ClientConfig, DraftClient

# (name, early taps, predicted commits, whole spans, hint, one message): the commit after sampling; the
# commit right after the taps, which carry the whole verified span (the proposer before 2026-12-05) or only
# the rows up to the predicted end (now), and say that their commit follows (``Step.commit_follows``: the
# server waits for it rather than ingest the rows alone) or not (before 2026-12-06); the predicted rows and
# drafts as one single message sent before sampling (an experiment: what the proposer does not do yet);
# the single message
MODES = (
    ("early_taps", True, False, True, False, False),
    ("predicted_whole_span", True, True, True, False, False),
    ("predicted_commit", True, True, False, True, False),
    ("predicted_unhinted", True, True, False, False, False),
    ("predicted_one_message", True, True, False, False, True),
    ("single_message", False, False, True, False, False),
)


def commit_waits(before: dict[str, float], mport: int) -> dict[str, float]:
    """The server's waits for commits that follow their taps (``Step.commit_follows``) during one run:
    how many, their mean, and the timeouts (a commit later than the wait's bound)."""
    if not mport:
        return {}
    after = scrape(mport)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n = delta("draft_server_commit_wait_seconds_count")
    return {
        "server_commit_waits": n,
        "server_commit_wait_mean_ms": round(delta("draft_server_commit_wait_seconds_sum") / n * 1000, 4) if n else 0.0,
        "server_commit_wait_timeouts": delta("draft_server_commit_wait_timeouts_total"),
    }


def measure(
    endpoint: str,
    b: int,
    early: bool,
    args: argparse.Namespace,
    predicted: bool = False,
    whole: bool = True,
    encode: str = "",
    hint: bool = False,
    one: bool = False,
) -> dict[str, Any]:
    cfg = ClientConfig(
        endpoint=endpoint,
        budget_ms=args.budget_ms,
        name=f"early-{b}-{int(early)}",
        transport=args.transport,
        shm_ring_mib=args.shm_ring_mib,
        wire_format=args.wire_format,
        projection_id=args.projection_id,
        wait_spin_ms=args.client_spin_ms,
    )
    client = DraftClient(cfg)
    try:
        welcome = client.connect(wait=True)
        assert welcome is not None
        lifetime = args.catch_up_steps + args.warmup + args.steps + 2
        eng = SyntheticTarget(
            client,
            welcome.contract,
            sessions=b,
            k=args.k,
            prefill_rows=(256, 256),
            decode_steps=(lifetime, lifetime),
            stagger_steps=0,
            seed=b,
            early_taps=early,
            sample_ms=args.sample_ms,
            predicted=predicted,
            whole_spans=whole,
            hint=hint,
            one_message=one,
            encode=encode,
            taps_device=args.taps_device,
        )
        t0 = time.perf_counter()
        n = 0
        while n < args.catch_up_steps:  # the prefill step and the catch-up after it
            rec = eng.step(n, t0)
            n += 1
            if rec is not None and rec.drafted == rec.wanted:
                break
            time.sleep(args.forward_ms / 1000.0)
        caught_up = (n, round(time.perf_counter() - t0, 3))
        first = len(eng.records)
        for _ in range(args.warmup + args.steps):
            time.sleep(args.forward_ms / 1000.0)
            eng.step(n, t0)
            n += 1
        client.free([s.sid for s in eng._active])
        recs = [r for r in eng.records[first + args.warmup :] if r.compute_ms >= 0]  # decode steps with a reply
        measured = eng.records[first + args.warmup :]
        wait = np.array([r.wait_ms for r in recs])
        over = np.array([r.wait_ms - r.compute_ms for r in recs])

        def q(v: np.ndarray, p: float) -> float:
            return round(float(np.percentile(v, p)), 3) if len(v) else float("nan")

        return {
            "catch_up_steps": caught_up[0],
            "catch_up_s": caught_up[1],
            "steps": len(recs),
            "early_taps_negotiated": client.early_taps,
            "wait_ms_p50": q(wait, 50),
            "wait_ms_p90": q(wait, 90),
            "compute_ms_p50": q(np.array([r.compute_ms for r in recs]), 50),
            "wait_minus_compute_ms_p50": q(over, 50),
            "wait_minus_compute_ms_p90": q(over, 90),
            "server_minus_compute_ms_p50": q(np.array([r.server_ms - r.compute_ms for r in recs]), 50),
            "queue_ms_p50": q(np.array([r.queue_ms for r in recs]), 50),
            "wait_minus_server_ms_p50": q(np.array([r.wait_ms - r.server_ms for r in recs]), 50),
            "send_ms_p50": q(np.array([r.send_ms for r in recs]), 50),
            # predicted commits: the commit on the socket this long before sampling ended (p10: the late ones)
            "commit_lead_ms_p50": q(lead := np.array([x for r in recs if (x := r.commit_lead_ms) == x]), 50),
            "commit_lead_ms_p10": q(lead, 10),
            "drafted_share": round(sum(r.drafted for r in measured) / max(1, sum(r.wanted for r in measured)), 4),
            "early_mib_per_step": round(float(np.mean([r.early_rows for r in measured])) * eng.width * 2 / 2**20, 3),
            "rows_in_place": client.stats()["rows_in_place"],  # steps whose rows went where the encoder wrote them
        }
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES), help="which of the modes to run")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per run")
    ap.add_argument("--warmup", type=int, default=20, help="decode steps left out of the numbers, after the catch-up")
    ap.add_argument("--catch-up-steps", type=int, default=5000, help="most steps to wait for the prefill to be in")
    ap.add_argument("--forward-ms", type=float, default=10.0, help="sleep between steps (the target forward)")
    ap.add_argument("--sample-ms", type=float, default=1.0, help="target sampling + rejection between taps and commit")
    ap.add_argument("--budget-ms", type=float, default=50.0)
    ap.add_argument(
        "--client-spin-ms",
        type=float,
        default=0.0,
        help="the client's wait_spin_ms (its caller polls unslept from this long before its reply is due)",
    )
    ap.add_argument("--server-args", default="--model random:k3 --device cuda --kv-budget-mib 16384")
    ap.add_argument(
        "--k3-checksum",
        action="store_true",
        help="instead of --server-args: the checksum drafter with K3's contract (K3's tap bytes, no model: a CPU box)",
    )
    ap.add_argument(
        "--k3-noop",
        action="store_true",
        help="as --k3-checksum, with batches that do no drafter work: the hop's and the server's own host work only",
    )
    ap.add_argument(
        "--transport",
        default="frames",
        choices=["frames", "shm"],
        help="frames: rows in the Step's frame over tcp; shm: over ipc, rows in a shared-memory ring (no span limit)",
    )
    ap.add_argument("--shm-ring-mib", type=int, default=256, help="the shm ring (--transport shm)")
    ap.add_argument(
        "--wire-format",
        default="bf16",
        choices=["bf16", "projected"],
        help="the rows' wire format; projected: context rows (the drafter's hidden size), the id the server offers",
    )
    ap.add_argument(
        "--encode",
        default="",
        help="comma list, each a run: '' the pool's rows as they are; 'host' through the proposer's encoder (a fresh "
        "copy; page-locked from a GPU); 'ring' the encoder writing into the client's shm ring (--transport shm)",
    )
    ap.add_argument("--taps-device", default="cpu", help="with --encode: where the taps live (cuda: the target's GPU)")
    ap.add_argument("--server-log", default="", help="the server's log at INFO goes to this file (rings, arena)")
    ap.add_argument("--out", default="bench/results/early_taps_h200.json")
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    gpu = (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
        if os.path.exists("/dev/nvidia0")
        else ""
    )

    def write() -> None:  # after every row: a run cut short keeps what it measured
        report = {
            "command": "python -m draft_tools.bench.early_taps_gpu "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "gpu": gpu, "protocol": PROTOCOL_VERSION},
            "setup": {k: v for k, v in vars(a).items() if k != "out"},
            "rows": rows,
        }
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)

    ipc = f"ipc://{tempfile.mkdtemp(prefix='early-taps-')}/srv.sock"
    if a.k3_checksum or a.k3_noop:
        from draft_tools.bench.rpc import spawn

        endpoint = f"tcp://127.0.0.1:{free_port()}"
        mport = free_port()
        extra = ["--noop"] if a.k3_noop else []
        proc = spawn(
            "serve", f"{endpoint},{ipc}" if a.transport == "shm" else endpoint, "--metrics-port", str(mport), *extra
        )
    else:
        proc, endpoint, mport = start_server(
            a.server_args.split(), also_bind=ipc if a.transport == "shm" else "", log_file=a.server_log
        )
    endpoint = ipc if a.transport == "shm" else endpoint
    a.projection_id = ""
    if a.wire_format == "projected":  # the synthetic rows have no weights behind them: take the server's id
        probe = DraftClient(ClientConfig(endpoint=endpoint, name="early-probe"))
        welcome = probe.connect(wait=True)
        probe.close()
        assert welcome is not None and "projected" in welcome.wire.formats, "the server offers no projected rows"
        a.projection_id = welcome.wire.projection_id
    try:
        for b in (int(x) for x in a.batches.split(",")):
            for mode, early, predicted, whole, hint, one in (m for m in MODES if m[0] in a.modes.split(",")):
                for enc in a.encode.split(","):
                    before = scrape(mport) if mport else {}
                    got = measure(endpoint, b, early, a, predicted, whole, enc, hint, one)
                    r = {"B": b, "mode": mode, "encode": enc, **got, **commit_waits(before, mport)}
                    rows.append(r)
                    write()
                    print(
                        f"B={b:3d} {r['mode']:20s} {enc or '-':4s} early {r['early_mib_per_step']:6.2f} MiB  "
                        f"caught up in {r['catch_up_steps']} steps ({r['catch_up_s']:.2f} s)  "
                        f"wait p50 {r['wait_ms_p50']:7.3f} ms  compute p50 "
                        f"{r['compute_ms_p50']:7.3f} ms  wait-compute p50 {r['wait_minus_compute_ms_p50']:6.3f} "
                        f"p90 {r['wait_minus_compute_ms_p90']:6.3f} ms  "
                        f"(server-compute {r['server_minus_compute_ms_p50']:.3f}, "
                        f"queue {r['queue_ms_p50']:.3f}, wait-server {r['wait_minus_server_ms_p50']:.3f}, "
                        f"send {r['send_ms_p50']:.3f}, commit lead {r['commit_lead_ms_p50']:.3f} / p10 "
                        f"{r['commit_lead_ms_p10']:.3f})  drafted {r['drafted_share']:.3f}"
                        + (
                            f"  commit waits {r['server_commit_waits']:.0f} (mean "
                            f"{r['server_commit_wait_mean_ms']:.3f} ms, "
                            f"{r['server_commit_wait_timeouts']:.0f} timed out)"
                            if "server_commit_waits" in r
                            else ""
                        ),
                        flush=True,
                    )
    finally:
        stop_server(proc)
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
