"""`python -m draft_tools.demo` (what `make demo` runs): part 1, then part 2; exit 0 when both are OK."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="remote DSpark drafts inside vLLM, then many engines against one server")
    ap.add_argument("--engines", type=int, default=2, help="synthetic target engines (one DraftClient each)")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions per engine")
    ap.add_argument("--total-sessions", type=int, default=96, help="sessions per engine over the run")
    ap.add_argument("--budget-ms", type=float, default=50.0, help="per-step draft budget")
    ap.add_argument("--duration-s", type=float, default=8.0, help="stop after this long")
    ap.add_argument("--server-arg", action="append", default=[], help="extra draft-server serve flag (repeatable)")
    ap.add_argument(
        "--part",
        choices=["all", "vllm", "load"],
        default="all",
        help="vllm: remote drafts inside vLLM; load: many synthetic engines; all: both",
    )
    args = ap.parse_args(argv)
    ok = True
    if args.part in ("all", "vllm"):
        from draft_tools.demo.part_vllm import run as run_vllm

        print("#### part 1: a real vLLM engine (CPU) with remote DSpark drafts")
        ok = run_vllm()
    if args.part in ("all", "load"):
        from draft_tools.demo.part_load import run as run_load

        print("#### part 2: concurrency — synthetic target engines against one draft server")
        ok = (
            run_load(args.engines, args.sessions, args.total_sessions, args.budget_ms, args.duration_s, args.server_arg)
            and ok
        )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
