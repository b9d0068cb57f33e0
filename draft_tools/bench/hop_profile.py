"""Where a remote K3 step's time goes: client wait, server compute and each thread's Python.

The remote half of ``draft_step_gpu`` alone (``server_vs_inprocess``: ``draft-server`` on
``random:k3`` on this GPU, one ``DraftClient`` at 1 and 64 sessions, 256 context rows, 3 new rows
+ 7 drafts per session, bf16 taps over tcp), writing the medians. Run it under ``py-spy record
--subprocesses -f raw`` to see which thread holds the GIL when:

    py-spy record --subprocesses -r 1000 -f raw -o OUT.txt -- \\
        python3 -m draft_tools.bench.hop_profile --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from draft_tools.bench.draft_step_gpu import server_vs_inprocess


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.update(server_vs_inprocess({}, steps=args.steps))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
