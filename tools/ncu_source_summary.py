"""Summarise Nsight Compute's per-instruction (SASS) source counters of one kernel.

    ncu --section SourceCounters -k regex:forward_lean --launch-skip 2 --launch-count 1 -o rep \\
        python tools/profile_call.py --presets detr_enc_bs2 --backends tma_ws --dtypes float16
    ncu -i rep.ncu-rep --page source --csv --print-source sass > fwd.csv
    python tools/ncu_source_summary.py fwd.csv                      # top rows by shared wavefronts
    python tools/ncu_source_summary.py fwd.csv --by stalls --top 30

Prints the kernel's totals (instructions, L1 shared wavefronts, L1 global tag requests, stall
samples), then the top instructions by the chosen counter, and the totals per execution count:
instructions that run equally often form one code region (a loop body, the producer's stage),
which is how the per-iteration figures of docs/perf_notes.md are read off.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

COLUMNS = {
    "instructions": "Instructions Executed",
    "shared": "L1 Wavefronts Shared",
    "global": "L1 Tag Requests Global",
    "stalls": "Warp Stall Sampling (All Samples)",
}


def number(text: str) -> float:
    """A counter cell as a number: ncu writes thousands separators and leaves some cells empty."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: Path) -> tuple[str, list[dict]]:
    """The kernel name and one dict per SASS instruction. The CSV's first line names the kernel,
    the second holds the column names."""
    lines = list(csv.reader(path.open(newline="")))
    if len(lines) < 2 or not lines[0] or lines[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an `ncu --page source --csv` export (first cell: {lines[0][:1] if lines else None})")
    header = lines[1]
    missing = [name for name in COLUMNS.values() if name not in header]
    if missing:
        raise ValueError(f"{path}: columns missing (profile with --section SourceCounters): {missing}")
    rows = [dict(zip(header, line)) for line in lines[2:] if len(line) == len(header)]
    return lines[0][1], rows


def totals(rows: list[dict]) -> dict[str, float]:
    return {key: sum(number(row[column]) for row in rows) for key, column in COLUMNS.items()}


def top(rows: list[dict], by: str, count: int) -> list[dict]:
    return sorted(rows, key=lambda row: -number(row[COLUMNS[by]]))[:count]


def regions(rows: list[dict]) -> list[tuple[int, dict[str, float]]]:
    """Counters summed per execution count, largest instruction total first."""
    grouped: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.Counter())
    for row in rows:
        executions = int(number(row[COLUMNS["instructions"]]))
        for key, column in COLUMNS.items():
            grouped[executions][key] += number(row[column])
    return sorted(grouped.items(), key=lambda item: -item[1]["instructions"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("--by", choices=sorted(COLUMNS), default="shared", help="counter to rank instructions by")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    kernel, rows = read_rows(args.csv)
    print(kernel)
    print("totals: " + ", ".join(f"{key} {value:,.0f}" for key, value in totals(rows).items()))
    print(f"\ntop {args.top} instructions by {args.by}:")
    print(f"{'address':>8} {'executed':>12} {'shared':>11} {'global':>11} {'stalls':>8}  source")
    for row in top(rows, args.by, args.top):
        print(f"{row['Address'][-8:]:>8} {number(row[COLUMNS['instructions']]):>12,.0f} {number(row[COLUMNS['shared']]):>11,.0f} "
              f"{number(row[COLUMNS['global']]):>11,.0f} {number(row[COLUMNS['stalls']]):>8,.0f}  {row['Source'].strip()}")
    print("\nper execution count (a code region):")
    print(f"{'executions':>12} {'instructions':>14} {'shared':>11} {'global':>11} {'stalls':>8}")
    for executions, sums in regions(rows)[: args.top]:
        print(f"{executions:>12,} {sums['instructions']:>14,.0f} {sums['shared']:>11,.0f} {sums['global']:>11,.0f} {sums['stalls']:>8,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
