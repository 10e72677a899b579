"""tools/ab_compare.py: the change per row and the deterministic-over-fast ratios, on made-up rounds."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import ab_compare  # noqa: E402


def write_round(path: Path, rows: dict) -> Path:
    results = []
    for (preset, dtype, backend), ms in rows.items():
        row = {"preset": preset, "dtype": dtype, "backend": backend, "direction": "backward", "timing": {}}
        if isinstance(ms, str):
            row["error"] = ms
        else:
            row["timing"] = {"median_ms": ms}
        results.append(row)
    path.write_text(json.dumps({"environment": {}, "results": results}))
    return path


def test_change_is_the_ratio_of_the_best_medians_and_ratios_are_per_round(tmp_path):
    fast, det = ("enc", "float16", "tma_ws"), ("enc", "float16", "tma_ws+det")
    base = [write_round(tmp_path / "b1.json", {fast: 1.0, det: 2.0}), write_round(tmp_path / "b2.json", {fast: 0.9, det: 2.2})]
    new = [write_round(tmp_path / "n1.json", {fast: 0.95, det: 1.5}), write_round(tmp_path / "n2.json", {fast: 1.0, det: 1.6})]
    out = tmp_path / "report.md"
    assert ab_compare.main([*map(str, base), "--new", *map(str, new), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| enc float16 tma_ws backward | 1.0000 / 0.9000 | 0.9500 / 1.0000 | +5.6 % |" in text
    assert "| enc float16 tma_ws+det backward | 2.0000 / 2.2000 | 1.5000 / 1.6000 | -25.0 % |" in text
    assert "- enc float16 tma_ws backward: 2.000x / 2.444x" in text  # base rounds
    assert "- enc float16 tma_ws backward: 1.579x / 1.600x" in text  # change rounds


def test_rows_missing_or_failed_on_either_side_are_listed_not_compared(tmp_path):
    a, b, c = ("enc", "float32", "tma_ws"), ("dec", "float32", "tma_ws"), ("dec", "float16", "tma_ws")
    base = [write_round(tmp_path / "b.json", {a: 1.0, b: "CUDA error"})]
    new = [write_round(tmp_path / "n.json", {a: 1.1, b: 0.5, c: 0.4})]
    lines = ab_compare.compare([ab_compare.medians(p) for p in base], [ab_compare.medians(p) for p in new])
    assert "| enc float32 tma_ws backward | 1.0000 | 1.1000 | +10.0 % |" in lines
    assert lines[-1] == "Not compared (missing from a round of either side): dec float32 tma_ws backward, dec float16 tma_ws backward"
    assert not any(line.startswith("Deterministic") for line in lines)
