"""``python -m draft_tools.chaos.serve serve [draft-server serve flags] --slow-p P --slow-ms MS``:
the real draft server, its drafter wrapped in ``SlowDrafter``."""

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
    args: argparse.Namespace = parser.parse_args(argv)
    cfg = parse_serve_config(args)
    if cfg is None:
        return 2
    return serve(cfg, wrap=lambda d: SlowDrafter(d, args.slow_p, args.slow_ms / 1000.0))


if __name__ == "__main__":
    sys.exit(main())
