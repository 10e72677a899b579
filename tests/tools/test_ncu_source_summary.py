"""tools/ncu_source_summary.py on a small export in ncu's `--page source --csv` format, on the CPU."""

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import ncu_source_summary  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "L1 Tag Requests Global", "L1 Wavefronts Shared", "Divergent Branches"]
ROWS = [  # a loop body run 1,000 times, and a stage run 10 times
    ["0x7f0000001000", "LDS.128 R4, [R2]", "5", "1,000", "0", "4,000", ""],
    ["0x7f0000001010", "LDG.E.128 R8, desc[UR4][R6.64]", "2", "1,000", "6,600", "0", ""],
    ["0x7f0000001020", "HADD2.F32 R10, -RZ, R8.H0_H0", "90", "1,000", "0", "0", ""],
    ["0x7f0000002000", "STS.128 [R3], R12", "1", "10", "0", "40", ""],
    ["0x7f0000002010", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R7+URZ], R6", "30", "10", "0", "", ""],
]


def write_export(path: Path, header=HEADER, rows=ROWS, first=("Kernel Name", "void k<__half>(int)")):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(first)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_totals_parse_thousands_separators_and_empty_cells(tmp_path):
    kernel, rows = ncu_source_summary.read_rows(write_export(tmp_path / "k.csv"))
    assert kernel == "void k<__half>(int)"
    assert ncu_source_summary.totals(rows) == {"instructions": 3020.0, "shared": 4040.0, "global": 6600.0, "stalls": 128.0}


def test_top_ranks_by_the_chosen_counter(tmp_path):
    _, rows = ncu_source_summary.read_rows(write_export(tmp_path / "k.csv"))
    assert [r["Source"].split()[0] for r in ncu_source_summary.top(rows, "stalls", 2)] == ["HADD2.F32", "SYNCS.PHASECHK.TRANS64.TRYWAIT"]
    assert ncu_source_summary.top(rows, "shared", 1)[0]["Source"].startswith("LDS.128")


def test_regions_group_instructions_by_execution_count(tmp_path):
    _, rows = ncu_source_summary.read_rows(write_export(tmp_path / "k.csv"))
    regions = ncu_source_summary.regions(rows)
    assert [executions for executions, _ in regions] == [1000, 10]
    loop = regions[0][1]
    assert (loop["instructions"], loop["shared"], loop["global"], loop["stalls"]) == (3000, 4000, 6600, 97)


def test_an_export_without_source_counters_is_refused(tmp_path):
    path = write_export(tmp_path / "k.csv", header=["Address", "Source", "Instructions Executed"], rows=[["0x1", "NOP", "1"]])
    with pytest.raises(ValueError, match="SourceCounters"):
        ncu_source_summary.read_rows(path)
    with pytest.raises(ValueError, match="not an"):
        ncu_source_summary.read_rows(write_export(tmp_path / "other.csv", first=("ID", "x")))


def test_main_prints_the_tables(tmp_path, capsys):
    assert ncu_source_summary.main([str(write_export(tmp_path / "k.csv")), "--by", "stalls", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "totals: instructions 3,020, shared 4,040, global 6,600, stalls 128" in out
    assert "top 3 instructions by stalls" in out and "per execution count" in out
