"""tools/sweep_backends.py: its case list, its summary rule and its outputs, on the CPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import benchmark_op  # noqa: E402
import sweep_backends  # noqa: E402


def test_cases_cover_the_required_ranges():
    cases = sweep_backends.CASES
    shapes = [c.shape for c in cases]
    assert len(cases) >= 40
    assert len({c.name for c in cases}) == len(cases)
    assert (min(s.batch for s in shapes), max(s.batch for s in shapes)) == (1, 16)
    assert (min(s.heads for s in shapes), max(s.heads for s in shapes)) == (4, 16)
    assert (min(s.channels for s in shapes), max(s.channels for s in shapes)) == (16, 128)
    assert {len(s.levels) for s in shapes} == {3, 4, 5}
    assert (min(s.points for s in shapes), max(s.points for s in shapes)) == (2, 8)
    assert (min(s.num_queries for s in shapes), max(s.num_queries for s in shapes)) == (100, 90000)
    assert {c.locality for c in cases} == {"local", "uniform"}
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert any(s.queries is None for s in shapes) and any(s.queries is not None for s in shapes)


def test_pyramid_is_a_backbone_s():
    assert sweep_backends.pyramid(800, 1216, 4, 8) == ((100, 152), (50, 76), (25, 38), (13, 19))
    assert sum(h * w for h, w in sweep_backends.pyramid(800, 1333, 5, 4)) == 89023


def test_the_default_sweep_fits_its_time_budget_on_an_h100():
    args = sweep_backends.parse_args([])
    seconds = sweep_backends.estimate_seconds(sweep_backends.CASES, len(benchmark_op.COMPILED_BACKENDS) + 1, args.warmup, args.iters)
    assert 60 < seconds < 8 * 60


def timing(backend, ms=None, error=None, direction="forward", ran=None, mode="cuda events, graph replay"):
    return sweep_backends.Timing(3, "s03", "shape", "float16", "local", direction, backend,
                                 {"median_ms": ms} if ms else {}, mode if ms else "", ran, error)


def test_summary_names_the_fastest_and_auto_s_ratio():
    summary = sweep_backends.summarize_case(
        [timing("cuda", 1.0), timing("pytorch", 2.0), timing("tma_ws", error="unavailable: channels"), timing("auto", 1.2, ran="pytorch")]
    )
    assert (summary["fastest"], summary["fastest_ms"], summary["auto_ms"], summary["auto_pick"]) == ("cuda", 1.0, 1.2, "pytorch")
    assert summary["ratio"] == pytest.approx(1.2) and summary["within_target"] is False
    assert summary["unavailable"] == {"tma_ws": "unavailable: channels"}
    assert summary["same_timing_mode"] is True
    assert sweep_backends.summarize_case([timing("cuda", 1.0), timing("auto", 1.05, ran="cuda")])["within_target"] is True


def test_summary_flags_auto_timed_eagerly_against_a_replayed_fastest():
    eager = "cuda events, eager (graph capture failed: RuntimeError: sync)"
    summary = sweep_backends.summarize_case([timing("cuda", 1.0), timing("auto", 3.0, ran="cuda", mode=eager)])
    assert summary["same_timing_mode"] is False
    header, rows = sweep_backends.summary_table([summary])
    assert rows[0][header.index("ratio")] == "3.000 (timing modes differ)"


def test_summary_without_an_auto_time_judges_nothing():
    summary = sweep_backends.summarize_case([timing("cuda", 1.0), timing("auto", error="unavailable: no backend")])
    assert summary["ratio"] is None and summary["within_target"] is None and summary["fastest"] == "cuda"


def test_list_prints_the_cases_and_runs_nothing(capsys):
    assert sweep_backends.main(["--list", "--device", "cpu", "--cases", "0", "44"]) == 0
    captured = capsys.readouterr()
    assert "estimate on an H100" in captured.err
    assert "bs1 nq=20197 S=20197 L4 P4 H8 C32 local float16" in captured.out and "S=8500" in captured.out


def test_without_compiled_backends_it_stops_and_says_why():
    with pytest.raises(SystemExit, match="no compiled backend is available on cpu"):
        sweep_backends.main(["--device", "cpu", "--cases", "0"])


def test_a_small_sweep_end_to_end(tmp_path, monkeypatch):
    tiny = sweep_backends.Case(benchmark_op.Shape("tiny", ((6, 8), (3, 4)), 1, 5, heads=2, channels=4, points=2), "uniform", "float32")
    monkeypatch.setattr(sweep_backends, "CASES", [tiny, tiny])
    out = tmp_path / "sweep"
    args = ["--device", "cpu", "--backends", "pytorch", "--iters", "2", "--warmup", "1", "--out", str(out)]
    assert sweep_backends.main(args) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["results"]) == 2 * 2 * 2  # cases x directions x (pytorch, auto)
    assert [(s["case"], s["direction"]) for s in data["summary"]] == [(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward")]
    for summary in data["summary"]:
        assert summary["fastest"] == "pytorch" and summary["auto_pick"] == "pytorch" and summary["ratio"] > 0
    assert data["environment"]["elapsed_s"] > 0
    assert "| # | shape |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    rendered = tmp_path / "again"
    assert sweep_backends.main(["--render", str(out.with_suffix(".json")), "--out", str(rendered)]) == 0
    assert rendered.with_suffix(".md").read_text().count("\n") == out.with_suffix(".md").read_text().count("\n")


def test_auto_pick_falls_back_on_what_dispatch_declares(monkeypatch):
    from types import SimpleNamespace

    import mmdeform_tma

    tiny = benchmark_op.Shape("tiny", ((4, 4),), 1, 3, heads=1, channels=2, points=1)
    inputs = benchmark_op.make_inputs(tiny, torch.float32, "local", torch.device("cpu"), 0)
    monkeypatch.setattr(sweep_backends.bench_common, "observed_backends", lambda call: {"forward": "unknown", "backward": "unknown"})
    monkeypatch.delattr(mmdeform_tma.dispatch, "select", raising=False)
    assert sweep_backends.auto_pick(inputs, "backward") == "unknown"
    seen = []

    def select(name, validated):
        seen.append((name, validated.needs_grad))
        return SimpleNamespace(forward=SimpleNamespace(name="cuda"), backward=SimpleNamespace(name="tma_ws"))

    monkeypatch.setattr(mmdeform_tma.dispatch, "select", select, raising=False)
    assert sweep_backends.auto_pick(inputs, "forward") == "cuda (dispatch.select)"
    assert sweep_backends.auto_pick(inputs, "backward") == "tma_ws (dispatch.select)"
    assert seen == [("auto", False), ("auto", True)]


def test_auto_pick_per_direction():
    tiny = benchmark_op.Shape("tiny", ((4, 4),), 1, 3, heads=1, channels=2, points=1)
    inputs = benchmark_op.make_inputs(tiny, torch.float32, "local", torch.device("cpu"), 0)
    assert sweep_backends.auto_pick(inputs, "forward") == "pytorch"
    assert sweep_backends.auto_pick(inputs, "backward") == "pytorch"
