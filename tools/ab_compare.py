"""Compare operator-benchmark rounds of a base tree and a change (tools/gpu_suite.sh, step ab_op):

    python tools/ab_compare.py OUT/ab_base_r1.json OUT/ab_base_r2.json --new OUT/ab_new_r1.json OUT/ab_new_r2.json

Each argument is a tools/benchmark_op.py JSON. Per row (preset, dtype, backend, direction) the
table shows every round's median in ms, base and change, and the change as the ratio of the best
medians (rounds alternate base and change, so a drift of the GPU's clocks reaches both). Where a
round holds a deterministic row (`backend+det`) beside its fast one, their ratio in that round
follows: the figure the deterministic-backward target reads. Rows missing from either side are
listed, not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

Key = tuple[str, str, str, str]


def medians(path: Path) -> dict[Key, float]:
    """A benchmark JSON's median ms per row; rows that failed or were not timed are left out."""
    rows = json.loads(path.read_text())["results"]
    out = {}
    for r in rows:
        ms = (r.get("timing") or {}).get("median_ms")
        if ms is not None and not r.get("error"):
            out[(r["preset"], r["dtype"], r["backend"], r["direction"])] = float(ms)
    return out


def deterministic_ratios(round_: dict[Key, float]) -> dict[Key, float]:
    """Per fast row with a `+det` twin in the same round: deterministic median over fast median."""
    ratios = {}
    for (preset, dtype, backend, direction), ms in round_.items():
        fast = (preset, dtype, backend.removesuffix("+det"), direction)
        if backend.endswith("+det") and fast in round_:
            ratios[fast] = ms / round_[fast]
    return ratios


def compare(base: list[dict[Key, float]], new: list[dict[Key, float]]) -> list[str]:
    """The Markdown report: the change per row, then the deterministic-over-fast ratios per round."""
    keys = list(dict.fromkeys(k for r in base for k in r))
    lines = ["| row | base ms | change ms | change |", "|---|---|---|---|"]
    missing = []
    for key in keys:
        b = [r[key] for r in base if key in r]
        n = [r[key] for r in new if key in r]
        if len(b) < len(base) or len(n) < len(new):
            missing.append(" ".join(key))
            continue
        label = " ".join(key)
        lines.append(f"| {label} | {' / '.join(f'{x:.4f}' for x in b)} | {' / '.join(f'{x:.4f}' for x in n)} | "
                     f"{100 * (min(n) / min(b) - 1):+.1f} % |")
    missing += [" ".join(k) for k in dict.fromkeys(k for r in new for k in r) if k not in keys]
    if missing:
        lines += ["", "Not compared (missing from a round of either side): " + ", ".join(missing)]
    for side, rounds in (("base", base), ("change", new)):
        per_round = [deterministic_ratios(r) for r in rounds]
        rows = list(dict.fromkeys(k for r in per_round for k in r))
        if rows:
            lines += ["", f"Deterministic over fast, {side} (per round):", ""]
            lines += [f"- {' '.join(k)}: " + " / ".join(f"{r[k]:.3f}x" if k in r else "-" for r in per_round) for k in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", nargs="+", type=Path, help="the base tree's rounds (benchmark_op JSONs)")
    p.add_argument("--new", nargs="+", type=Path, required=True, help="the change's rounds")
    p.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = p.parse_args(argv)
    lines = compare([medians(f) for f in args.base], [medians(f) for f in args.new])
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
