"""tools/make_synthetic_coco.py, tools/train.py and tools/test.py on the CPU (tiny config)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mmdet")
ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py"


def run(*args, cwd=ROOT):
    result = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    run("tools/make_synthetic_coco.py", "--out", str(out), "--num-train", "4", "--num-val", "2", "--size", "96")
    return out


def data_options(root: Path) -> list[str]:
    ann = root / "annotations/instances_val.json"
    return [
        f"train_dataloader.dataset.data_root={root}/",
        f"val_dataloader.dataset.data_root={root}/",
        f"test_dataloader.dataset.data_root={root}/",
        f"val_evaluator.ann_file={ann}",
        f"test_evaluator.ann_file={ann}",
    ]


def test_synthetic_dataset_is_coco(dataset):
    coco = json.loads((dataset / "annotations/instances_train.json").read_text())
    assert len(coco["images"]) == 4 and coco["annotations"]
    assert [c["name"] for c in coco["categories"]] == ["circle", "square", "triangle"]
    for ann in coco["annotations"]:
        x, y, w, h = ann["bbox"]
        image = next(i for i in coco["images"] if i["id"] == ann["image_id"])
        assert 0 <= x and 0 <= y and w > 0 and h > 0 and x + w <= image["width"] + 1e-6 and y + h <= image["height"] + 1e-6
    assert (dataset / "train" / coco["images"][0]["file_name"]).exists()


def test_train_evaluate_and_resume_with_another_backend(dataset, tmp_path):
    work = tmp_path / "work"
    options = [*data_options(dataset), "train_cfg.max_epochs=1", "train_cfg.val_interval=1", "default_hooks.checkpoint.interval=1"]
    log = run("tools/train.py", TINY, "--work-dir", str(work), "--cfg-options", *options)
    assert "Epoch(train) [1][2/2]" in log and "loss:" in log and "coco/bbox_mAP" in log
    checkpoint = work / "epoch_1.pth"
    assert checkpoint.exists()
    # the checkpoint, saved with backend='pytorch', resumes on mmcv's own module (no backend key)
    resumed = run(
        "tools/train.py", TINY, "--work-dir", str(work), "--resume", str(checkpoint), "--cfg-options", *options,
        "train_cfg.max_epochs=2", "model.encoder.layer_cfg.self_attn_cfg.backend=None",
        "model.decoder.layer_cfg.cross_attn_cfg.backend=None",
    )
    assert "resumed epoch: 1" in resumed and "Epoch(train) [2][2/2]" in resumed
    tested = run("tools/test.py", TINY, str(work / "epoch_2.pth"), "--work-dir", str(tmp_path / "test"), "--cfg-options", *data_options(dataset))
    assert "coco/bbox_mAP" in tested


def test_global_loss_is_logged_and_two_identical_runs_compare_within_noise(dataset, tmp_path):
    config = tmp_path / "tiny_with_global_loss.py"
    config.write_text(
        f"_base_ = '{ROOT / TINY}'\n"
        "custom_imports = dict(imports=['mmdeform_tma', 'mmdeform_tma.integrations.mmengine_hooks'])\n"
        "custom_hooks = [dict(type='LossOverRanksHook')]\n"
    )
    options = [
        *data_options(dataset), "train_cfg.max_epochs=2", "train_cfg.val_interval=3", "default_hooks.checkpoint.interval=3",
        "default_hooks.logger.interval=1", "log_processor.window_size=1", "randomness.seed=0",
    ]
    for name in ("a", "b"):
        run("tools/train.py", str(config), "--work-dir", str(tmp_path / name), "--cfg-options", *options)
    records = [json.loads(line) for line in next((tmp_path / "a").glob("*/vis_data/scalars.json")).read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert len(train) == 4 and all(r["global_loss"] == pytest.approx(r["loss"], rel=1e-6) for r in train)  # one rank
    out = run("tools/compare_loss_curves.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"))
    assert "within noise" in out and "NOT" not in out
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert result["iterations"] == 4 and result["max_rel_diff_first"] < 1e-5
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_loss_curves_flags_curves_apart(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import compare_loss_curves

    reference = {s: 10.0 - 0.1 * s + (0.05 if s % 2 else -0.05) for s in range(1, 21)}
    close = {s: v * (1 + 1e-4) for s, v in reference.items()}
    apart = {s: v + 2.0 for s, v in reference.items()}
    assert compare_loss_curves.compare(reference, close)["within_noise"]
    assert not compare_loss_curves.compare(reference, apart)["within_noise"]
    with pytest.raises(ValueError, match="share only"):
        compare_loss_curves.compare(reference, {100: 1.0})
    noisy = {s: 10.0 - 0.1 * s + (0.5 if s % 2 else -0.5) for s in range(1, 21)}
    offset = {s: v * 1.02 for s, v in noisy.items()}  # well inside the RMS noise, but 2 % high all along
    result = compare_loss_curves.compare(noisy, offset)
    assert result["rms_difference"] < result["rms_step_change"] and result["second_half_offset"] == pytest.approx(0.02)
    assert not result["within_noise"]
    assert compare_loss_curves.compare(noisy, offset, max_offset=0.03)["within_noise"]


def write_logged_run(run_dir, losses, window, every=1):
    """A run dir as mmengine leaves it: its config, and the running means its LogProcessor logs."""
    from mmengine.logging import HistoryBuffer

    (run_dir / "vis_data").mkdir(parents=True)
    (run_dir / "vis_data" / "config.py").write_text(f"log_processor = dict(type='LogProcessor', window_size={window})\n")
    buffer, lines = HistoryBuffer(), []
    for step, loss in enumerate(losses, start=1):
        buffer.update(loss)
        if step % every == 0:
            lines.append(json.dumps({"loss": float(buffer.mean(window)), "iter": step, "step": step}))
    (run_dir / "vis_data" / "scalars.json").write_text("\n".join(lines) + "\n")
    return run_dir / "vis_data" / "scalars.json"


def test_compare_loss_curves_undoes_mmengine_running_means(tmp_path):
    pytest.importorskip("mmengine")
    sys.path.insert(0, str(ROOT / "tools"))
    import compare_loss_curves

    losses = [20.0 + 5.0 * math.sin(1.7 * i) + 0.1 * i for i in range(1, 41)]
    scalars = write_logged_run(tmp_path / "a" / "20261123_000000", losses, window=7)
    assert compare_loss_curves.logged_window(scalars) == 7
    curve = compare_loss_curves.read_curve(scalars)
    assert [curve[s] for s in sorted(curve)] == pytest.approx(losses, rel=1e-9)
    sparse = write_logged_run(tmp_path / "b" / "20261123_000000", losses, window=7, every=2)
    with pytest.raises(ValueError, match="window_size=1"):
        compare_loss_curves.read_curve(sparse)


def write_curve(run_dir, losses):
    """A hand-made run dir: per-iteration losses, no saved config (taken as logged)."""
    (run_dir / "run" / "vis_data").mkdir(parents=True)
    lines = [json.dumps({"loss": loss, "iter": step, "step": step}) for step, loss in enumerate(losses, start=1)]
    (run_dir / "run" / "vis_data" / "scalars.json").write_text("\n".join(lines) + "\n")
    return run_dir


def test_compare_loss_curves_bounds_the_offset_by_the_reference_runs_own_noise(tmp_path):
    """Two runs of the reference configuration that sit 1.5 % apart make a 1.2 % offset noise; without
    them, the default 1 % bound flags it, and an offset beyond the measured noise stays flagged."""
    sys.path.insert(0, str(ROOT / "tools"))
    import compare_loss_curves

    base = [10.0 - 0.05 * i + (0.3 if i % 2 else -0.3) for i in range(1, 41)]
    eager_a, eager_b = base, [v * 1.015 for v in base]
    fast = [v * 1.012 for v in base]
    far = [v * 1.03 for v in base]

    def curve(values):
        return dict(enumerate(values, start=1))

    assert not compare_loss_curves.compare(curve(eager_a), curve(fast))["within_noise"]
    noise = compare_loss_curves.run_to_run_noise([curve(eager_a), curve(eager_b)])
    assert noise["runs"] == 2 and noise["largest_offset"] == pytest.approx(0.015)
    assert noise["offset_bound"] == pytest.approx(0.015)
    result = compare_loss_curves.compare_with_repeats([curve(eager_a), curve(eager_b)], curve(fast))
    assert result["within_noise"] and result["max_offset"] == pytest.approx(0.015)
    assert result["offsets_against_each_reference"] == pytest.approx([0.012, 1.012 / 1.015 - 1])
    assert not compare_loss_curves.compare_with_repeats([curve(eager_a), curve(eager_b)], curve(far))["within_noise"]
    # quieter references never loosen the bound below --max-offset
    assert compare_loss_curves.run_to_run_noise([curve(eager_a), curve(eager_a)])["offset_bound"] == 0.01
    with pytest.raises(ValueError, match="at least two runs"):
        compare_loss_curves.run_to_run_noise([curve(eager_a)])

    dirs = [write_curve(tmp_path / name, values) for name, values in (("a", eager_a), ("b", eager_b), ("f", fast))]
    assert compare_loss_curves.main([str(dirs[0]), str(dirs[2])]) == 1
    assert compare_loss_curves.main([str(dirs[0]), str(dirs[2]), "--repeats", str(dirs[1]), "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["run_to_run"]["offset_bound"] == pytest.approx(0.015) and report["within_noise"]


def write_text_log(path, losses, window, style="epoch"):
    """mmengine's text log as LogProcessor prints it: the config dump, then one train line per
    iteration with running means to 4 decimals (and a validation line that must be skipped)."""
    from mmengine.logging import HistoryBuffer

    buffer = HistoryBuffer()
    lines = [f"log_processor = dict(by_epoch=True, type='LogProcessor', window_size={window})"]
    for step, loss in enumerate(losses, start=1):
        buffer.update(loss)
        total = len(losses)
        where = f"Epoch(train) [1][{step:3d}/{total}]" if style == "epoch" else f"Iter(train) [{step:3d}/{total}]"
        lines.append(f"11/25 04:09:27 - mmengine - INFO - {where}  lr: 1.0000e-04  time: 0.3763  grad_norm: nan  "
                     f"loss: {buffer.mean(window):.4f}  loss_cls: 1.2139  d0.loss_cls: 1.1572")
    lines.append("11/25 04:10:48 - mmengine - INFO - Epoch(val) [1][25/25]    coco/bbox_mAP: 0.0080  loss: 3.0000")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_compare_loss_curves_reads_mmengine_text_logs(tmp_path):
    """A run whose work dir is gone is compared from its kept text log: per-iteration losses from
    the 4-decimal running means the log prints, epoch- or iteration-based."""
    pytest.importorskip("mmengine")
    sys.path.insert(0, str(ROOT / "tools"))
    import compare_loss_curves

    losses = [20.0 + 5.0 * math.sin(1.7 * i) + 0.1 * i for i in range(1, 41)]
    for style in ("epoch", "iter"):
        curve, window = compare_loss_curves.read_run(write_text_log(tmp_path / "run_1.log", losses, 1, style))
        assert window == 1 and sorted(curve) == list(range(1, 41))
        assert [curve[s] for s in sorted(curve)] == pytest.approx(losses, abs=5e-5)
    with pytest.raises(ValueError, match="window_size=1"):
        compare_loss_curves.read_run(write_text_log(tmp_path / "means.log", losses, 4))
    with pytest.raises(ValueError, match="no training losses"):
        compare_loss_curves.read_text_log(write_text_log(tmp_path / "none.log", [], 1))
    apart = write_text_log(tmp_path / "apart.log", [v * 1.05 for v in losses], 1)
    again = write_text_log(tmp_path / "again.log", [v * 1.001 for v in losses], 1)
    assert compare_loss_curves.main([str(tmp_path / "run_1.log"), str(again)]) == 0
    assert compare_loss_curves.main([str(tmp_path / "run_1.log"), str(apart)]) == 1
