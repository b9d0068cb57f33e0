"""Summarise a ``py-spy record -f raw --threads --subprocesses`` file: per process and thread,
the samples, the functions with the most own samples and the deepest shared callers.

    python3 -m draft_tools.bench.pyspy_summary RAW.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: collections.Counter[str] = collections.Counter()
    with open(args.raw) as f:
        for line in f:
            stack, _, cnt = line.rstrip("\n").rpartition(" ")
            if not stack or not cnt.isdigit():  # a multi-line command line's continuation
                continue
            frames = stack.split(";")
            head = [fr for fr in frames[:3] if fr.startswith(("process", "thread"))]
            key = " | ".join(h[:90] for h in head)
            body = frames[len(head) :]
            n = int(cnt)
            total[key] += n
            if body:
                per[key][body[-1]] += n
                for fr in set(body):
                    incl[key][fr] += n
    for key, n in total.most_common():
        if n < 20:
            continue
        print(f"\n== {key}: {n} samples")
        print("  own:")
        for fr, c in per[key].most_common(args.top):
            print(f"    {c:7d} {fr[:150]}")
        print("  inclusive:")
        for fr, c in incl[key].most_common(args.top):
            print(f"    {c:7d} {fr[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
