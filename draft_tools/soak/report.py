"""The soak report: invariants and forensics from a ``RunResult`` (``analyze``), plots and the summary."""

import argparse
import math
import os
from typing import Any

import numpy as np

from draft_tools.soak.run import SLACK_MS, TOUCHING, RunResult

# ------------------------------------------------------------------------------------ analysis


def _calls(engine: dict[str, Any]) -> np.ndarray:
    cols = engine.get("call_columns") or []
    arr = np.array(engine.get("calls") or [], dtype=np.float64)
    return arr.reshape(-1, len(cols)) if cols else np.zeros((0, 1))


def _col(engine: dict[str, Any], name: str) -> int:
    return engine["call_columns"].index(name)


def _sessions(engine: dict[str, Any]) -> list[dict[str, Any]]:
    cols = engine.get("session_columns") or []
    return [dict(zip(cols, row, strict=True)) for row in engine.get("sessions") or []]


def _overlaps(a0: float, a1: float, windows: list[tuple[float, float]]) -> bool:
    return any(a0 <= w1 and w0 <= a1 for w0, w1 in windows)


def _pct(x: np.ndarray, q: float) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def _nearest(res: RunResult, idx: int, t0s: Any) -> str:
    """The proxy's fault on engine ``idx``'s traffic nearest to one of its unwaited Taps steps ``t0s``
    (what an untouched session's restart would be looked up by)."""
    ident = f"soak-e{idx}"
    best = min(
        ((abs(t - t0), t - t0, kind) for t, kind, who, *_ in (res.proxy or {}).get("events", []) if who == ident
         for t0 in t0s),
        default=None,
    )  # fmt: skip
    if best is None:
        return f"{len(t0s)} unwaited Taps steps, no proxy fault near one"
    return f"{len(t0s)} unwaited Taps steps, the nearest proxy fault {best[2]} at {best[1] * 1000:+.1f} ms"


def _touching_windows(res: RunResult, margin_s: float) -> list[tuple[float, float]]:
    out = []
    for e in res.events:
        if e.kind in TOUCHING:
            out.append((e.t0 - margin_s, e.t1 + margin_s))
    return out


def _resume(args: argparse.Namespace, res: RunResult, kind: str = "kill") -> list[dict[str, Any]]:
    """Steps until drafting was back, per engine, after each restart's READY (kind "kill") or
    after each SIGCONT (kind "pause"), with the reason when a measurement is excluded."""
    budget_s = args.budget_ms / 1000.0
    proxy_events = [(t, kind, ident) for t, kind, ident, *_server in (res.proxy or {}).get("events", [])]
    out = []
    if kind == "kill":
        marks = [(e, e.detail["ready"]) for e in res.events if e.kind == "kill" and e.detail.get("ready")]
    else:
        marks = [(e, e.t1) for e in res.events if e.kind == kind]
    for ev, ready in marks:
        others = [(e.t0, e.t1) for e in res.events if e.kind in ("kill", "pause", "flood") and e is not ev]
        row: dict[str, Any] = {"t_ready": round(ready - res.t_start, 3), "engines": []}
        for eng in res.engines:
            idx = eng["spec"]["index"]
            calls = _calls(eng)
            if not len(calls):
                continue
            t0c, waitc, dr = _col(eng, "t0"), _col(eng, "wait_ms"), _col(eng, "drafted")
            after = calls[calls[:, t0c] >= ready]
            got = np.nonzero(after[:, dr] > 0)[0]
            if not len(after) or not len(got):
                row["engines"].append({"engine": idx, "steps": None, "excluded": "run ended before drafting"})
                continue
            n = int(got[0])
            t_back = after[n, t0c] + after[n, waitc] / 1000.0
            reason = None
            ident = f"soak-e{idx}"
            if any(ready - budget_s - 0.05 <= t <= t_back and i == ident for t, _, i in proxy_events):
                reason = "proxy dropped or delayed this engine's message meanwhile"
            elif any(ready <= t <= t_back for t in res.slow_events):
                reason = "an injected slow server iteration meanwhile"
            elif _overlaps(ready, t_back, others):
                reason = "another chaos event meanwhile"
            elif any(due <= t_back and due + late >= ready and late >= 0.010 for due, late in res.host_stalls):
                reason = "the host stalled a process for >= 10 ms meanwhile (canary)"
            entry: dict[str, Any] = {"engine": idx, "steps": n, "seconds": round(t_back - ready, 4), "excluded": reason}
            if n:  # the steps without drafts: when they started, how long they waited, what they got
                entry["steps_without_drafts"] = [
                    {
                        "t_ms": round((c[t0c] - ready) * 1000.0, 1),
                        "wait_ms": round(float(c[waitc]), 1),
                        **{k: int(c[_col(eng, k)]) for k in ("ok", "none", "expired", "overloaded") if c[_col(eng, k)]},
                    }
                    for c in after[: min(n, 8)]
                ]
            row["engines"].append(entry)
        out.append(row)
    return out


def _moves(args: argparse.Namespace, res: RunResult) -> dict[str, Any]:
    """Fleet soaks: how many steps each session that moved to another server went without drafts
    around the move. A move over ``--resume-steps`` breaks the invariant unless another fault of
    the server it left or the one it went to excuses it (as ``_resume`` excludes): a proxy drop or
    delay of this engine's message, an injected slow iteration, a second kill/pause/flood; or the
    host: a canary stall, or the engine's threads on the run queue (plus steal) for half a budget
    or more during one of the missed steps (then the steps were missed on this side)."""
    budget_s = args.budget_ms / 1000.0
    # (t, routing id, server) of every proxy drop or delay; server -1: not known
    proxy_events = [(e[0], e[2], e[3] if len(e) > 3 else -1) for e in (res.proxy or {}).get("events", [])]
    slow = [(t, i) for i, ts in enumerate(res.slow_events_by_server) for t in ts] or [(t, -1) for t in res.slow_events]
    windows = [(e.t0, e.t1, e.detail.get("server", -1)) for e in res.events if e.kind in ("kill", "pause", "flood")]
    measured: list[dict[str, Any]] = []
    excused: dict[str, int] = {}
    unrecovered = 0
    for eng in res.engines:
        cols = eng.get("move_columns") or []
        ident = f"soak-e{eng['spec']['index']}"
        calls = _calls(eng)
        if len(calls):  # per call: when it started, and how long the host kept the engine off the CPU
            cc = eng["call_columns"]
            starts = calls[:, cc.index("t0")]
            off_cpu = np.maximum(calls[:, cc.index("run_delay_ms")], calls[:, cc.index("proc_run_delay_ms")])
            off_cpu = off_cpu + calls[:, cc.index("steal_ms")] / float(eng.get("cpus") or os.cpu_count() or 1)
        else:
            starts = off_cpu = np.zeros(0)
        for row in eng.get("moves") or []:
            m = dict(zip(cols, row, strict=True))
            if m["t_back"] < 0:
                unrecovered += 1  # the session ended before drafting again
                continue
            t0, t1 = m["t_first_miss"], m["t_back"]
            steps = int(m["steps_without"])
            measured.append({"engine": eng["spec"]["index"], "session": int(m["number"]), "steps_without": steps})
            if steps <= args.resume_steps:
                continue
            # over the bound: excused only by a fault of the server it left or the one it went to
            measured[-1]["t_s"] = round(t0 - res.t_start, 3)
            mine = {int(m.get("from_server", -1)), int(m.get("to_server", -1))}

            def touches(server: int, mine: set[int] = mine) -> bool:
                return server < 0 or -1 in mine or server in mine

            reason = None
            if any(t0 - budget_s - 0.05 <= t <= t1 and i == ident and touches(srv) for t, i, srv in proxy_events):
                reason = "proxy dropped or delayed this engine's message to one of its servers meanwhile"
            elif any(t0 <= t <= t1 and touches(srv) for t, srv in slow):
                reason = "an injected slow iteration of one of its servers meanwhile"
            elif sum(1 for w0, w1, srv in windows if w0 - budget_s <= t1 and t0 <= w1 and touches(srv)) > 1:
                reason = "several chaos events on its servers meanwhile"
            elif any(due <= t1 and due + late >= t0 and late >= 0.010 for due, late in res.host_stalls):
                reason = "the host stalled a process for >= 10 ms meanwhile (canary)"
            elif (off_cpu[(starts >= t0) & (starts < t1)] >= args.budget_ms / 2).any():
                reason = "the host kept the engine off the CPU for half a budget or more in a missed step"
            measured[-1]["excused"] = reason
            if reason is not None:
                excused[reason] = excused.get(reason, 0) + 1
    late = [c for c in measured if c["steps_without"] > args.resume_steps and c.get("excused") is None]
    steps = [c["steps_without"] for c in measured]
    return {
        "ok": not late,
        "moves_measured": len(measured),
        "moves_over_excused": excused,
        "moves_over_not_excused": len(late),
        "moves_unrecovered_session_ended": unrecovered,
        "max_steps_without_drafts": max(steps, default=None),
        "steps_without_drafts_histogram": {str(k): steps.count(k) for k in sorted(set(steps))},
        "rule": f"at most {args.resume_steps} steps wanting drafts without them around a move to another server",
        "late": late[:10],
    }


def _memory(args: argparse.Namespace, res: RunResult) -> dict[str, Any]:
    per_inc = []
    samples = res.samples
    for i, inc in enumerate(res.incarnations):
        start = inc.get("ready") or inc["start"]
        rows = [s for s in samples if s[1] == i and s[0] >= start + args.mem_warmup_s]
        out: dict[str, Any] = {"incarnation": i, "samples": len(rows), "checked": False}
        w = max(2, args.mem_window)
        for key, col in (("rss", 2), ("gpu", 3), ("gpu_allocated", 6), ("gpu_reserved", 7)):
            vals = [s[col] for s in rows if len(s) > col and s[col] is not None]
            if len(vals) >= 2 * w:
                base, last = float(np.median(vals[:w])), float(np.median(vals[-w:]))
                out[f"{key}_base_mib"] = round(base, 2)
                out[f"{key}_end_mib"] = round(last, 2)
                out[f"{key}_growth_mib"] = round(last - base, 2)
                out[f"{key}_max_mib"] = round(max(vals), 2)
                out["checked"] = True
        per_inc.append(out)
    growths = [v for inc in per_inc for k, v in inc.items() if k.endswith("_growth_mib")]
    return {
        "tolerance_mib": args.rss_tolerance_mib,
        "warmup_s": args.mem_warmup_s,
        "incarnations": per_inc,
        "max_growth_mib": max(growths) if growths else None,
        "checked": any(inc["checked"] for inc in per_inc),
    }


def _first_restart(r: tuple[float, ...]) -> str:
    """An untouched session's first restarted reply (``SessionState.first_restart``), in words."""
    step, t0, start, end, pos, rows, k, early, lost_end = r
    how = "early taps" if early else "single message"
    # read after the reply: a restart mark that reply resynced (a start at or past the rows given up) is gone
    mark = "no client mark left"
    if lost_end >= 0:
        mark = f"the client marks it restart (rows given up below {lost_end:.0f})"
    return (
        f"step {step:.0f} at t0 {t0:.3f} ({how}): start {start:.0f} named for context end {end:.0f}, "
        f"entry pos {pos:.0f} rows {rows:.0f} k {k:.0f}; {mark}"
    )


def _reference(args: argparse.Namespace, res: RunResult, ref: RunResult | None) -> dict[str, Any]:
    windows = _touching_windows(res, args.budget_ms / 1000.0 + 0.05)
    untouched = touched = mism = checked = compared = differ = 0
    examples: list[str] = []
    ref_crc: dict[tuple[int, int], tuple[int, int, list[int]]] = {}
    same_tokens = total_tokens = 0
    min_agree: float | None = None
    if ref is not None:
        for eng in ref.engines:
            for s in _sessions(eng):
                if s["finished"] and s["all_ok"]:
                    ref_crc[(eng["spec"]["index"], s["number"])] = (s["steps"], s["draft_crc"], s.get("tokens") or [])
    lost_taps = lost_taps_restarted = 0
    # this engine's requests the proxy dropped or held back, and replies it dropped: an unwaited
    # ingest-only early Taps among them (``unwaited_t0``: nobody waited for its reply) touched its
    # session. A lost reply too: its rows then count as unacknowledged, a long prompt's more than a
    # step may resend, and the client gives them up and restarts the session (``resend``)
    lost: dict[str, list[float]] = {}
    lost_replies: dict[str, list[float]] = {}
    for ev in (res.proxy or {}).get("events", []):
        if ev[1] in ("drop_taps", "drop_request", "delay_request"):
            lost.setdefault(ev[2], []).append(ev[0])
        elif ev[1] == "drop_reply":
            lost_replies.setdefault(ev[2], []).append(ev[0])
    reply_s = args.budget_ms / 1000.0 + 0.05  # a Taps call's reply comes back within its budget
    for eng in res.engines:
        idx = eng["spec"]["index"]
        mine = lost.get(f"soak-e{idx}", [])
        replies = lost_replies.get(f"soak-e{idx}", [])
        for s in _sessions(eng):
            # the Taps leaves just before the step's t0; 20 ms for the proxy to see it on a loaded host
            t0s = s.get("unwaited_t0", ())
            dropped = any(t0 - 0.01 <= t <= t0 + 0.02 for t0 in t0s for t in mine) or any(
                t0 - 0.01 <= t <= t0 + reply_s for t0 in t0s for t in replies
            )
            lost_taps += dropped
            lost_taps_restarted += dropped and bool(s.get("restarted"))
            t = dropped or (not s["all_ok"]) or s["epochs"] > 1 or _overlaps(s["first_t0"], s["last_t1"], windows)
            if t:
                touched += 1
                continue
            untouched += 1
            checked += s["checked"]
            if s["mismatched"] or s.get("restarted"):  # an untouched session must keep all its context
                mism += 1
                if len(examples) < 5:
                    examples.append(
                        f"engine {idx} session {s['number']}: {s['mismatched']}/{s['checked']} differ, "
                        f"{s.get('restarted') or 0} restarted; {_nearest(res, idx, t0s)}"
                        + (f"; first restart {_first_restart(s['first_restart'])}" if s.get("first_restart") else "")
                    )
            if ref is not None and s["finished"]:
                r = ref_crc.get((idx, s["number"]))
                if r is not None and r[0] == s["steps"]:
                    compared += 1
                    mine = s.get("tokens") or []
                    if len(mine) == len(r[2]) and mine:
                        same = sum(a == b for a, b in zip(mine, r[2], strict=True))
                        same_tokens += same
                        total_tokens += len(mine)
                        min_agree = min(same / len(mine), 1.0 if min_agree is None else min_agree)
                    if r[1] != s["draft_crc"]:
                        differ += 1
                        if len(examples) < 5:
                            examples.append(f"engine {idx} session {s['number']}: drafts differ from the reference")
    how = "in-process checksum expectation" if args.drafter == "checksum" else "second fault-free pass"
    return {
        "method": how,
        "sessions_touched": touched,
        "sessions_untouched": untouched,
        "sessions_touched_by_a_lost_unwaited_taps": lost_taps,
        "of_them_restarted_by_the_server": lost_taps_restarted,
        "untouched_entries_checked": checked,
        "untouched_sessions_mismatched": mism,
        "reference_sessions_compared": compared,
        "reference_sessions_differing": differ,
        "reference_token_agreement": round(same_tokens / total_tokens, 5) if total_tokens else None,
        "reference_min_session_agreement": None if min_agree is None else round(min_agree, 5),
        "reference_min_agreement": args.reference_min_agreement,
        "examples": examples,
    }


def _overrun_forensics(
    res: RunResult, all_calls: list[tuple[dict[str, Any], np.ndarray]], delays: np.ndarray
) -> dict[str, Any]:
    """Where the time of each call over the bound that run-queue wait and steal do not explain went.

    Per call the engine records its own on-CPU time, the on-CPU time of all its threads, its
    time in the cyclic GC, host-wide steal time and major page faults; the canary adds host
    stalls. The likely cause is the first of these that covers the unexplained part: steal (the
    hypervisor ran another guest), gc (the engine's own collector held the GIL), page faults,
    another thread of the engine on the CPU (held the GIL), a host stall the canary saw, or
    unknown. A cause here is evidence, not proof; the invariant itself subtracts only run-queue
    wait and the per-vCPU share of steal time.
    """
    rows: list[dict[str, Any]] = []
    off = 0
    for e, c in all_calls:
        if not len(c):  # an engine without calls (one that died has no result file: engines_completed)
            continue
        cols = e["call_columns"]
        n = len(c)
        d = delays[off : off + n]
        off += n

        def col(name: str, c: np.ndarray = c, cols: list[str] = cols) -> np.ndarray:
            return c[:, cols.index(name)] if name in cols else np.full(len(c), np.nan)

        stacks = {float(t): text for t, text in e.get("late_stacks") or []}
        wait, budget = col("wait_ms"), col("budget_ms")
        rest = wait - budget - d
        for i in np.nonzero((wait - budget > SLACK_MS) & (rest > SLACK_MS))[0]:
            t0, w = float(col("t0")[i]), float(wait[i]) / 1000.0
            # the canary's stalls are [due, due + late]: the longest part of one inside the call
            stall = max([0.0, *(min(t0 + w, due + late) - max(t0, due) for due, late in res.host_stalls)])
            r = {
                "engine": e["spec"]["index"],
                "t_s": round(t0 - res.t_start, 3),
                "wait_ms": round(float(wait[i]), 2),
                "unexplained_ms": round(float(rest[i]), 2),
                "run_queue_and_steal_ms": round(float(d[i]), 2),
                "statuses": {k: int(col(k)[i]) for k in ("ok", "none", "expired", "overloaded") if col(k)[i] > 0},
                "cpu_ms": round(float(col("cpu_ms")[i]), 2),
                # threads that exit during a call take their counters along: clamp at 0
                "other_threads_cpu_ms": round(max(0.0, float(col("proc_cpu_ms")[i] - col("cpu_ms")[i])), 2),
                "gc_ms": round(float(col("gc_ms")[i]), 2),
                "steal_ms": round(float(col("steal_ms")[i]), 2),
                "majflt": float(col("majflt")[i]),
                "canary_stall_ms": round(stall * 1000.0, 2),
            }
            if (st := stacks.get(t0)) is not None:
                r["stacks_at_budget_plus_5ms"] = st
            need = float(rest[i])
            cause = "unknown"
            for name, v in (
                ("steal", r["steal_ms"]),
                ("gc", r["gc_ms"]),
                ("page faults", 1e9 if r["majflt"] > 0 else 0.0),
                ("another engine thread held the GIL", r["other_threads_cpu_ms"]),
                ("host stall (canary)", r["canary_stall_ms"]),
            ):
                if np.isfinite(v) and v >= need - SLACK_MS:
                    cause = name
                    break
            r["likely_cause"] = cause
            rows.append(r)
    by: dict[str, int] = {}
    for r in rows:
        by[r["likely_cause"]] = by.get(r["likely_cause"], 0) + 1
    rows.sort(key=lambda r: -r["unexplained_ms"])
    return {"by_cause": by, "calls": rows[:50]}


def analyze(args: argparse.Namespace, res: RunResult, ref: RunResult | None) -> dict[str, Any]:
    inv: dict[str, dict[str, Any]] = {}
    all_calls = [(e, _calls(e)) for e in res.engines]
    waits = np.concatenate([c[:, _col(e, "wait_ms")] for e, c in all_calls if len(c)] or [np.zeros(0)])
    budgets = np.concatenate([c[:, _col(e, "budget_ms")] for e, c in all_calls if len(c)] or [np.zeros(0)])
    over = waits - budgets
    worst = float(over.max()) if len(over) else 0.0

    # The client controls a call's wait except the time the host did not run the engine process:
    # (1) its threads sat runnable on the run queue (other processes had the CPUs; a preempted
    # GIL holder keeps the caller waiting too), read per call from /proc/self/task/*/schedstat;
    # (2) steal time, when the hypervisor ran another guest on our vCPUs (a thread that is
    # "running" in the guest then runs nowhere; schedstat cannot see it). Steal is read
    # host-wide from /proc/stat and summed over vCPUs, so the share counted for one call is the
    # mean over vCPUs: what any one vCPU lost. Both are the host's doing, not the client's.
    def _delay_col(e: dict[str, Any], c: np.ndarray) -> np.ndarray:
        cols = e["call_columns"]
        if "proc_run_delay_ms" in cols:  # every thread of the engine process (GIL holder included)
            return np.maximum(c[:, cols.index("proc_run_delay_ms")], c[:, cols.index("run_delay_ms")])
        return c[:, cols.index("run_delay_ms")] if "run_delay_ms" in cols else np.zeros(len(c))

    def _steal_col(e: dict[str, Any], c: np.ndarray) -> np.ndarray:
        cols = e["call_columns"]
        if "steal_ms" not in cols:
            return np.zeros(len(c))
        return c[:, cols.index("steal_ms")] / float(e.get("cpus") or os.cpu_count() or 1)

    delays = np.concatenate([_delay_col(e, c) for e, c in all_calls if len(c)] or [np.zeros(0)])
    steal = np.concatenate([_steal_col(e, c) for e, c in all_calls if len(c)] or [np.zeros(0)])
    if len(delays) != len(waits):
        delays = np.zeros(len(waits))
    if len(steal) != len(waits):
        steal = np.zeros(len(waits))
    stalls = res.host_stalls
    by_queue = by_steal = unexplained = 0
    worst_unexplained = 0.0
    for i in np.nonzero(over > SLACK_MS)[0]:
        if over[i] - delays[i] <= SLACK_MS:
            by_queue += 1
        elif over[i] - delays[i] - steal[i] <= SLACK_MS:
            by_steal += 1
        else:
            unexplained += 1
            worst_unexplained = max(worst_unexplained, float(over[i] - delays[i] - steal[i]))
    forensics = _overrun_forensics(res, all_calls, delays + steal)
    inv["wait_within_budget"] = {
        "ok": bool(len(waits) > 0 and unexplained == 0),
        "calls": len(waits),
        "calls_over": int((over > SLACK_MS).sum()),
        "calls_over_explained_by_run_queue_wait": by_queue,
        "calls_over_explained_by_steal": by_steal,
        "worst_over_budget_ms": round(worst, 3),
        "worst_unexplained_over_ms": round(worst_unexplained, 3),
        "max_wait_ms": round(float(waits.max()), 3) if len(waits) else None,
        "host_stalls_seen": len(stalls),
        "host_stall_max_ms": round(max((x[1] for x in stalls), default=0.0) * 1000, 2),
        "max_run_queue_wait_ms": round(float(delays.max()), 3) if len(delays) else None,
        "max_steal_share_ms": round(float(steal.max()), 3) if len(steal) else None,
        "rule": "wait - (run-queue wait of the engine process's threads + host steal time per vCPU, "
        "during the call) <= budget + 5 ms",
        "unexplained_by_likely_cause": forensics["by_cause"],
        "unexplained_calls": forensics["calls"],
    }

    def total(name: str) -> int:
        return int(sum(c[:, _col(e, name)].sum() for e, c in all_calls if len(c)))

    bad = total("bad_drafts")
    inv["drafts_valid"] = {"ok": bad == 0 and total("drafted") > 0, "invalid_replies": bad, "drafted": total("drafted")}
    if args.drafter == "checksum":
        wrong = total("mismatch")
        inv["drafts_match_context"] = {
            "ok": wrong == 0,
            "mismatched_entries": wrong,
            "entries_restarted_by_the_server": total("restarted"),
        }
    resume = _resume(args, res)
    counted = [e for r in resume for e in r["engines"] if e["excluded"] is None]
    late = [e for e in counted if e["steps"] >= args.resume_steps]
    inv["resume_after_restart"] = {
        "ok": not late,
        "restarts": len(resume),
        "engine_restarts_counted": len(counted),
        "engine_restarts_excluded": sum(1 for r in resume for e in r["engines"] if e["excluded"] is not None),
        "max_steps_to_resume": max((e["steps"] for e in counted), default=None),
        "rule": f"drafts on one of the first {args.resume_steps} steps that start after READY",
        "late": late[:10],
    }
    if getattr(args, "servers", 1) > 1:
        inv["moved_sessions_resume"] = _moves(args, res)
    if getattr(args, "transport", "frames") == "shm":
        in_place = [int(e.get("client_stats", {}).get("rows_in_place") or 0) for e in res.engines]
        fleet = getattr(args, "servers", 1) > 1  # a fleet's rows are copied into each server's ring
        inv["shm_rows_in_place"] = {
            "ok": bool(in_place) and (fleet or all(n > 0 for n in in_place)) and not res.ring_names_left,
            "rule": "every engine sent rows in place in its ring (one server; a fleet copies them into each "
            "server's ring); no ring name left in /dev/shm after the engines",
            "steps_in_place_by_engine": in_place,
            "ring_names_left": res.ring_names_left,
        }
    live = res.end_sessions.get("live_at_end")
    inv["zero_sessions_at_end"] = {"ok": live == 0, **res.end_sessions}
    mem = _memory(args, res)
    rss_g = [i["rss_growth_mib"] for i in mem["incarnations"] if "rss_growth_mib" in i]
    gpu_g = [i["gpu_growth_mib"] for i in mem["incarnations"] if "gpu_growth_mib" in i]
    alloc_g = [i["gpu_allocated_growth_mib"] for i in mem["incarnations"] if "gpu_allocated_growth_mib" in i]
    inv["memory_flat"] = {
        "ok": all(g <= args.rss_tolerance_mib for g in rss_g)
        and all(g <= args.gpu_tolerance_mib for g in gpu_g + alloc_g),
        "checked": mem["checked"],
        "max_rss_growth_mib": max(rss_g, default=None),
        "rss_tolerance_mib": args.rss_tolerance_mib,
        "max_gpu_growth_mib": max(gpu_g, default=None),
        "max_gpu_allocated_growth_mib": max(alloc_g, default=None),
        "gpu_tolerance_mib": args.gpu_tolerance_mib,
    }
    refd = _reference(args, res, ref)
    ref_ok = refd["untouched_sessions_mismatched"] == 0 and refd["sessions_untouched"] > 0
    if args.drafter == "checksum":
        ref_ok = ref_ok and refd["untouched_entries_checked"] > 0
    if ref is not None:
        ref_ok = ref_ok and refd["reference_sessions_compared"] > 0
        if args.reference_min_agreement >= 1.0:  # exact: every compared session drafted the same tokens
            ref_ok = ref_ok and refd["reference_sessions_differing"] == 0
        else:  # a drafter whose numerics depend on the batch (bf16 on a GPU): token agreement floor
            agree = refd["reference_min_session_agreement"]
            ref_ok = ref_ok and agree is not None and agree >= args.reference_min_agreement
    inv["untouched_equal_reference"] = {"ok": ref_ok, **refd}
    errs = {}
    for i, m in res.last_metrics.items():
        e = m.get("draft_server_engine_errors_total", 0.0) + m.get("draft_server_io_errors_total", 0.0)
        if e:
            errs[str(i)] = e
    inv["server_healthy"] = {
        "ok": res.unexpected_exits == 0 and not errs,
        "unexpected_exits": res.unexpected_exits,
        "engine_or_io_errors_by_incarnation": errs,
    }
    broken = [e["spec"]["index"] for e in res.engines if e.get("error")]
    inv["engines_completed"] = {
        "ok": not broken and len(res.engines) == args.engines,
        "broken": broken,
        "errors": [e["error"][-2000:] for e in res.engines if e.get("error")],
    }
    counts: dict[str, int] = {}
    for ev in res.events:
        counts[ev.kind] = counts.get(ev.kind, 0) + 1
    if res.proxy:
        counts["drop"] = res.proxy.get("dropped_requests", 0) + res.proxy.get("dropped_replies", 0)
        counts["delay"] = res.proxy.get("delayed_requests", 0)
    if "slow" in args.modes:
        counts["slow"] = len(res.slow_events)
    if res.fuzz:
        counts["fuzz"] = res.fuzz.get("sent", 0)
    server_bad = held = 0.0
    for m in res.last_metrics.values():
        server_bad += sum(v for k, v in m.items() if k.startswith("draft_server_bad_messages_total{"))
        server_bad += m.get("draft_server_dropped_messages_total", 0.0)
        held += m.get("draft_server_batch_hold_seconds_count", 0.0)

    per_engine = []
    for e, c in all_calls:
        if not len(c):
            per_engine.append({"engine": e["spec"]["index"], "calls": 0, "error": bool(e.get("error"))})
            continue
        w = c[:, _col(e, "wait_ms")]
        per_engine.append(
            {
                "engine": e["spec"]["index"],
                "calls": len(c),
                "entries": int(c[:, _col(e, "entries")].sum()),
                "drafted_entries": int(c[:, _col(e, "drafted")].sum()),
                "fallback_entries": int((c[:, _col(e, "want")] - c[:, _col(e, "drafted")]).clip(0).sum()),
                "wait_ms_p50": round(_pct(w, 50) or 0, 3),
                "wait_ms_p99": round(_pct(w, 99) or 0, 3),
                "wait_ms_max": round(float(w.max()), 3),
                "epochs_seen": int(c[:, _col(e, "epoch_idx")].max()) + 1,
                "sessions": len(e.get("sessions") or []),
                "sessions_by_first_server": _first_servers(e),
                "client": e.get("client_stats", {}),
            }
        )
    statuses = {k: total(k) for k in ("ok", "none", "expired", "overloaded", "bad_entry", "internal")}
    sess = [s for e in res.engines for s in _sessions(e)]
    return {
        "ok": all(v["ok"] for v in inv.values()),
        "invariants": inv,
        "totals": {
            "calls": len(waits),
            "entries": total("entries"),
            "drafted_entries": total("drafted"),
            "wanted_entries": total("want"),
            "statuses": statuses,
            "wait_ms_p50": _pct(waits, 50),
            "wait_ms_p99": _pct(waits, 99),
            "wait_ms_p999": _pct(waits, 99.9),
            "wait_ms_max": float(waits.max()) if len(waits) else None,
            "sessions": len(sess),
            "long_prefill_sessions": sum(s["long_prefill"] for s in sess),
            "k0_then_draft_checked": sum(s["k0_then_draft"] for s in sess),
            "server_incarnations": len(res.incarnations),
            "server_rejected_messages": server_bad,
            "server_held_batches": held,  # decode batches held for clients due back (last scrapes)
        },
        "engines": per_engine,
        "chaos": {
            "modes": sorted(args.modes),
            "counts": counts,
            "events": [
                {
                    "kind": e.kind,
                    "t0": round(e.t0 - res.t_start, 3),
                    "t1": round(e.t1 - res.t_start, 3),
                    **_jsonable(e.detail),
                }
                for e in res.events
            ],
            "errors": res.chaos_errors,
            "proxy": {k: v for k, v in (res.proxy or {}).items() if k != "events"} or None,
            "fuzz": res.fuzz,
            "slow_iterations": len(res.slow_events),
        },
        "restarts": resume,
        "pauses": _resume(args, res, "pause"),
        "memory": mem,
        "server_tail": res.server_tail[-20:],
    }


def _first_servers(engine: dict[str, Any]) -> dict[str, int] | None:
    """Fleet soaks: how many of the engine's sessions each server took first (None with one server)."""
    out: dict[str, int] = {}
    for s in _sessions(engine):
        if s.get("first_server"):
            out[s["first_server"]] = out.get(s["first_server"], 0) + 1
    return out or None


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if k != "ready"}


# ------------------------------------------------------------------------------------ plots


def make_plots(args: argparse.Namespace, res: RunResult, out_dir: str, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = res.t_start
    span = max(1.0, res.t_end - t0)
    bin_s = max(1.0, math.ceil(span / 400))
    edges = np.arange(0.0, span + bin_s, bin_s)
    rows = [(e, _calls(e)) for e in res.engines]
    rows = [(e, c) for e, c in rows if len(c)]
    files = []

    def shade(ax: Any) -> None:
        colors = {"kill": "red", "pause": "orange", "flood": "purple", "rogue": "gray", "vanish": "green"}
        for ev in res.events:
            ax.axvspan(
                ev.t0 - t0, max(ev.t1 - t0, ev.t0 - t0 + bin_s / 4), color=colors.get(ev.kind, "k"), alpha=0.2, lw=0
            )

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=72)
        plt.close(fig)
        files.append(path)

    def binned(values: np.ndarray, ts: np.ndarray, fn: Any) -> np.ndarray:
        idx = np.digitize(ts, edges) - 1
        out = np.full(len(edges) - 1, np.nan)
        for b in range(len(out)):
            v = values[idx == b]
            if len(v):
                out[b] = fn(v)
        return out

    mid = (edges[:-1] + edges[1:]) / 2
    if rows:
        ts = np.concatenate([c[:, _col(e, "t0")] for e, c in rows]) - t0
        waits = np.concatenate([c[:, _col(e, "wait_ms")] for e, c in rows])
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for q, style in ((50, "-"), (99, "-"), (100, ":")):
            ax.plot(
                mid,
                binned(waits, ts, lambda v, q=q: np.percentile(v, q)),
                style,
                lw=1,
                label=f"p{q}" if q < 100 else "max",
            )
        ax.axhline(args.budget_ms + SLACK_MS, color="r", lw=0.8, ls="--", label="budget + 5 ms")
        shade(ax)
        ax.set(xlabel="s", ylabel="step() wait, ms", title=f"wait per {bin_s:.0f} s bin (all engines)")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_wait.png")

        drafted = np.concatenate([c[:, _col(e, "drafted")] for e, c in rows])
        fallback = np.concatenate([(c[:, _col(e, "want")] - c[:, _col(e, "drafted")]).clip(0) for e, c in rows])
        fig, ax = plt.subplots(figsize=(9, 3.2))
        ax.plot(mid, binned(drafted, ts, np.sum) / bin_s, lw=1, label="entries with drafts /s")
        ax.plot(mid, binned(fallback, ts, np.sum) / bin_s, lw=1, label="fallbacks (no drafts) /s")
        shade(ax)
        ax.set(xlabel="s", ylabel="entries / s", title="drafts vs fallbacks")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_drafts.png")

        fig, ax = plt.subplots(figsize=(9, 2.8))
        for e, c in rows:
            ax.step(
                c[:, _col(e, "t0")] - t0,
                c[:, _col(e, "epoch_idx")],
                where="post",
                lw=1,
                label=f"engine {e['spec']['index']}",
            )
        for inc in res.incarnations[1:]:
            if inc.get("ready"):
                ax.axvline(inc["ready"] - t0, color="r", lw=0.5, alpha=0.5)
        ax.set(xlabel="s", ylabel="server epoch #", title="epochs seen by each engine (red: READY after a restart)")
        ax.legend(fontsize=7, loc="upper left")
        save(fig, f"{prefix}_epochs.png")

    s = res.samples
    if s:
        st = np.array([x[0] - t0 for x in s])
        fig, ax = plt.subplots(figsize=(9, 2.8))
        by_server = sorted({x[8] for x in s if len(x) > 8})
        if len(by_server) > 1:  # a fleet: one line per server
            for i in by_server:
                rows = [x for x in s if x[8] == i]
                live = [np.nan if x[4] is None else x[4] for x in rows]
                ax.plot([x[0] - t0 for x in rows], live, lw=1, label=f"server {i}")
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.plot(st, [np.nan if x[4] is None else x[4] for x in s], lw=1, color="C0", label="live sessions")
        ax.set_ylabel("live sessions", color="C0")
        ax2 = ax.twinx()
        ax2.plot(st, [np.nan if x[5] is None else x[5] for x in s], lw=0.6, color="C1", alpha=0.7)
        ax2.set_ylabel("queued rows", color="C1")
        shade(ax)
        ax.set(xlabel="s", title="server live sessions and queued rows (/metrics; gaps: paused or down)")
        save(fig, f"{prefix}_sessions.png")

        fig, ax = plt.subplots(figsize=(9, 2.8))
        ax.plot(st, [np.nan if x[2] is None else x[2] for x in s], lw=1, label="server RSS MiB")
        for col, label in ((3, "server GPU MiB (nvidia-smi)"), (6, "GPU allocated by tensors MiB")):
            if any(len(x) > col and x[col] is not None for x in s):
                ax.plot(st, [np.nan if len(x) <= col or x[col] is None else x[col] for x in s], lw=1, label=label)
        shade(ax)
        ax.set(xlabel="s", ylabel="MiB", title="server memory (per process; restarts reset it)")
        ax.legend(fontsize=7, loc="upper right")
        save(fig, f"{prefix}_memory.png")
    return files


# ------------------------------------------------------------------------------------ summary


def summary_text(report: dict[str, Any]) -> str:
    t = report["totals"]
    lines = [
        f"draft-soak: {report['config']['engines']} engines x {report['config']['sessions']} sessions"
        + (f" over {report['config']['servers']} servers" if report["config"].get("servers", 1) > 1 else "")
        + ", "
        f"{report['duration_s']:.0f} s, drafter {report['config']['drafter']}, "
        f"chaos {','.join(report['chaos']['modes']) or 'none'}",
        f"  calls {t['calls']}  entries {t['entries']}  drafted {t['drafted_entries']}/{t['wanted_entries']}  "
        f"sessions {t['sessions']}  server processes {t['server_incarnations']}",
        f"  wait ms p50 {t['wait_ms_p50'] or 0:.2f}  p99 {t['wait_ms_p99'] or 0:.2f}  "
        f"p99.9 {t['wait_ms_p999'] or 0:.2f}  max {t['wait_ms_max'] or 0:.2f}  "
        f"(budget {report['config']['budget_ms']} ms)",
        f"  statuses {t['statuses']}",
        f"  chaos {report['chaos']['counts']}",
    ]
    mv = report["invariants"].get("moved_sessions_resume")
    if mv is not None:
        lines.append(
            f"  sessions moved to another server: {mv['moves_measured']} measured, steps without drafts "
            f"{mv['steps_without_drafts_histogram']} (over {report['config']['resume_steps']}: "
            f"{sum(mv['moves_over_excused'].values())} excused by another fault, {mv['moves_over_not_excused']} not)"
        )
    for key, what in (("restarts", "after READY"), ("pauses", "after SIGCONT")):
        ms = [e for r in report.get(key, []) for e in r["engines"] if e.get("steps") is not None]
        steps = [e["steps"] for e in ms if e["excluded"] is None]
        if steps:
            lines.append(
                f"  drafting back {what}: {len(steps)} measured ({len(ms) - len(steps)} excluded), "
                f"steps without drafts max {max(steps)}, median {float(np.median(steps)):.0f}"
            )
    w = report["invariants"]["wait_within_budget"]
    if w.get("unexplained_by_likely_cause"):
        causes = w["unexplained_by_likely_cause"]
        lines.append(f"  over budget + 5 ms, not run-queue wait or steal, by likely cause: {causes}")
    if report["chaos"]["errors"]:
        lines.append(f"  chaos errors: {report['chaos']['errors'][:3]}")
    lines.append("  invariants:")
    for name, v in report["invariants"].items():
        detail = {k: v[k] for k in list(v)[1:6] if not isinstance(v[k], list | dict)}
        lines.append(f"    {'PASS' if v['ok'] else 'FAIL'}  {name:28s} {detail}")
    lines.append(f"  result: {'OK' if report['ok'] else 'INVARIANT BROKEN'}; report {report['report_path']}")
    return "\n".join(lines)
