"""``python -m draft_tools.chaos.serve serve [draft-server serve flags] --slow-p P --slow-ms MS
[--ingest-us-per-row US]``: the real draft server, its drafter wrapped in ``SlowDrafter`` (a
fraction of draft batches delayed; every ingest slowed per row, so that a burst of prefill rows
takes longer than a budget to get in)."""

from __future__ import annotations

import argparse
import sys

from draft_server.app import serve
from draft_server.cli import parse_serve_config, serve_parser
from draft_tools.chaos.slow_drafter import SlowDrafter


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = serve_parser("python -m draft_tools.chaos.serve serve")
    parser.add_argument("--slow-p", type=float, default=0.0, help="fraction of draft batches delayed")
    parser.add_argument("--slow-ms", type=float, default=0.0, help="how long a delayed batch sleeps first")
    parser.add_argument(
        "--ingest-us-per-row", type=float, default=0.0, help="every ingest also sleeps this long per row (a slow burst)"
    )
    args: argparse.Namespace = parser.parse_args(argv)
    cfg = parse_serve_config(args)
    if cfg is None:
        return 2
    per_row = args.ingest_us_per_row / 1e6
    return serve(cfg, wrap=lambda d: SlowDrafter(d, args.slow_p, args.slow_ms / 1000.0, ingest_s_per_row=per_row))


if __name__ == "__main__":
    sys.exit(main())
