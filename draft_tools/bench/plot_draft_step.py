"""Plot a ``draft_step_gpu`` report: step time against batch size, dense vs fast vs the floors.

python -m draft_tools.bench.plot_draft_step bench/results/draft_step_h200_v2.json OUT.png
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, out = (argv if argv is not None else sys.argv[1:])[:2]
    rep = json.load(open(src))
    presets = [p for p in ("k3", "qwen3-8b") if isinstance(rep.get(p), dict) and "steps" in rep[p]]
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.2), squeeze=False)
    for ax, name in zip(axes[0], presets, strict=True):
        rows = rep[name]["steps"]
        b = [r["sessions"] for r in rows]
        ax.plot(b, [r["dense_ms"] for r in rows], "o-", label="dense eager (before)")
        ax.plot(b, [r["fast_ms"] for r in rows], "o-", label="paged kernels + CUDA graphs")
        ax.plot(b, [r["floor_ms"] for r in rows], "k--", label="floor (same run)")
        ax.plot(b, [1.3 * r["floor_ms"] for r in rows], "k:", label="1.3 x floor")
        if all("serial_floor_ms" in r for r in rows):  # runs since the serial floor (``step_floor``)
            ax.plot(b, [r["serial_floor_ms"] for r in rows], "-", c="0.5", lw=1, label="serial floor (same run)")
        mixed = rep[name].get("mixed_32k_plus_63x1k")
        if mixed:
            ax.scatter([64], [mixed["fast_ms"]], marker="*", s=120, c="C1", label="1x32K + 63x1K, fast")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sessions in the step (1,024 context rows, 3 new rows, 7 drafts)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"random:{name}, bf16, {rep['machine']['gpu']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
