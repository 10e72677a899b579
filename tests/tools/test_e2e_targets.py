"""tools/e2e_targets.py: end-to-end results against issue 12's targets, on session 22's measured
files and on made-up ones for the cases those do not have."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import e2e_targets  # noqa: E402

MEASURED = ROOT / "docs" / "measurements"
DETR = "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py"
DINO = "configs/synthetic/dino-4scale_r50_synthetic_tma-ws.py"
MASK2FORMER = "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py"
SESSION_22 = [
    "e2e_detr_bs2_h100_0bfe516.json",
    "e2e_dino_bs2_stock_only_h100_0bfe516.json",
    "e2e_detr_bs2_paired_default_h100_0bfe516.json",
    "e2e_dino_bs2_paired_default_h100_0bfe516.json",
    "e2e_mask2former_bs2_fp32_paired_default_h100_0bfe516.json",
    "host_overhead_h100_0bfe516.json",
]


def row_of(report: str, *needles: str) -> str:
    (line,) = [line for line in report.splitlines() if all(n in line for n in needles)]
    return line


def test_session_22_meets_what_it_measured_and_lists_what_it_did_not(tmp_path):
    for name in SESSION_22:
        shutil.copy(MEASURED / name, tmp_path / name)
    report, ok = e2e_targets.summarize([str(tmp_path)])  # a folder: every JSON under it
    assert not ok  # two fast rows were not run
    assert "0.553x | 0.60x: met | 0.544x | 0.80x: met" in row_of(report, "deformable-detr bs 2", "amp-fp16", "136.2")
    assert "| met |" in row_of(report, "mask2former bs 2", "fp32", "| 5 |")
    assert "within noise" in row_of(report, "mask2former bs 2", "fp32", "| 5 |")  # inference 1.008, one round below 1
    assert "1.00x: met" in row_of(report, "| auto | float16 | forward+backward |")
    assert "| - |" in row_of(report, "| mmcv | float16 | forward+backward |")  # mmcv's kernel behind our dispatcher
    not_found = report[report.index("## Not found"):].splitlines()[2:]
    assert [line for line in not_found if line] == [
        "- the fast row of dino-4scale bs 2",
        "- the fast row of deformable-detr bs 8",
    ]


def e2e_run(config: str, batch: int, stock_ms: float, fast_ms: float, infer=(50.0, 30.0)) -> dict:
    def result(backend, fast, train, infer_ms):
        return {"backend": backend, "fast": fast, "precision": "amp-fp16", "train_ms": {"median_ms": train},
                "infer_ms": {"median_ms": infer_ms}, "gpu_kernel_ms": 10.0, "error": None}

    return {
        "environment": {"config": config, "batch": batch, "commit": "abc1234", "device": "GPU"},
        "results": [result("stock", False, stock_ms, infer[0]), result("auto", True, fast_ms, infer[1])],
    }


def paired_run(config: str, train: tuple, infer: tuple) -> dict:
    def ratios(phase, median, smallest):
        return {f"{phase}_ratio": median, f"{phase}_ratio_min": smallest, f"{phase}_ratio_max": median + 0.1,
                f"{phase}_rounds_slower": 0}

    return {
        "environment": {"config": config, "batch": 2, "commit": "abc1234", "device": "GPU"},
        "results": [{"backend": "stock", "train_ms": {"median_ms": 1.0}}],
        "paired_ratios": [
            {"label": "auto", "precision": "amp-fp16", "rounds": 5, **ratios("train", *train),
             **ratios("infer", *infer)}
        ],
    }


def write(tmp_path: Path, name: str, data: dict) -> str:
    (tmp_path / name).write_text(json.dumps(data))
    return str(tmp_path / name)


def test_a_fast_row_above_its_target_is_missed(tmp_path):
    path = write(tmp_path, "dino.json", e2e_run(DINO, 2, 300.0, 210.0))
    report, ok = e2e_targets.summarize([path])
    assert not ok
    assert "0.700x | 0.65x: **missed**" in row_of(report, "dino-4scale bs 2")


def test_a_batch_without_a_target_is_shown_without_one(tmp_path):
    path = write(tmp_path, "detr4.json", e2e_run(DETR, 4, 300.0, 290.0))
    report, _ = e2e_targets.summarize([path])
    assert "0.967x | - | 0.600x | - |" in row_of(report, "deformable-detr bs 4")


@pytest.mark.parametrize(
    "train, verdict",
    [((0.95, 0.90), "met"), ((1.02, 0.99), "within noise"), ((1.02, 1.01), "**missed**")],
    ids=["faster", "slower-within-noise", "slower-every-round"],
)
def test_paired_rows_are_never_slower_beyond_noise(tmp_path, train, verdict):
    path = write(tmp_path, "paired.json", paired_run(DETR, train, (0.9, 0.8)))
    report, _ = e2e_targets.summarize([path])
    cells = [cell.strip() for cell in row_of(report, "| deformable-detr bs 2 |").split("|")]
    assert cells[5] == verdict and cells[7] == "met"


def test_every_asked_for_row_met_exits_zero(tmp_path, capsys):
    write(tmp_path, "a.json", e2e_run(DETR, 2, 250.0, 130.0))
    write(tmp_path, "b.json", e2e_run(DINO, 2, 380.0, 200.0))
    write(tmp_path, "c.json", e2e_run(DETR, 8, 500.0, 200.0))
    for i, config in enumerate((DETR, DINO, MASK2FORMER)):
        write(tmp_path, f"p{i}.json", paired_run(config, (0.9, 0.8), (0.95, 0.9)))
    shutil.copy(MEASURED / "host_overhead_h100_0bfe516.json", tmp_path / "host.json")
    (tmp_path / "unrelated.json").write_text(json.dumps({"rows": [1, 2]}))  # e.g. a sweep: left alone
    (tmp_path / "broken.json").write_text("{")
    assert e2e_targets.main([str(tmp_path)]) == 0
    assert "## Not found" not in capsys.readouterr().out


def test_nothing_found_says_so(tmp_path):
    report, ok = e2e_targets.summarize([str(tmp_path)])
    assert not ok and "## Not found" in report and "- the fast row of deformable-detr bs 2" in report
