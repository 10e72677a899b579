"""Compare the training-loss curves of two mmengine work dirs (e.g. one GPU against DDP on two,
or eager training against tools/train.py --fast).

    python tools/compare_loss_curves.py work_dirs/parity_1gpu work_dirs/parity_2gpu [--out report]
    python tools/compare_loss_curves.py eager fast --repeats eager_2 [eager_3 ...]

Reads each run's newest `*/vis_data/scalars.json` and takes `global_loss` (the loss averaged over
ranks, logged by mmdeform_tma's LossOverRanksHook) where logged, else `loss`. A run may also be
given as mmengine's text log (a `.log` file; its losses are printed to 4 decimals), for runs whose
work dir is gone but whose log was kept. mmengine logs a
loss as the running mean over the last `log_processor.window_size` iterations (mmdet's configs:
50), which smooths away the iteration-to-iteration change the comparison measures noise by; where
the run's saved config says so and every iteration was logged, the running means are undone
exactly into per-iteration losses (otherwise: an error asking for `log_processor.window_size=1`).

"Within noise" means both:
- the RMS of the per-iteration difference between the curves is at most the RMS of the reference
  curve's own iteration-to-iteration change;
- over the second half, the mean difference is at most --max-offset (default 1 %) of the
  reference's mean loss: a systematic offset that RMS noise could hide.
With --repeats (more runs of the reference's own configuration, e.g. eager training run again
with the same seed), run-to-run noise is measured rather than assumed: the offset bound becomes
the largest second-half offset between any two reference runs where that exceeds --max-offset.
Nondeterministic kernels (atomics in the backward) make two identical eager runs drift apart,
by more than 1 % over 100 iterations of DINO in AMP fp16 (H100, 2026-11-23). The other run's
offset against every reference run is reported as well.
Also reported: the largest relative difference over the first iterations (where the runs should
still agree to rounding) and the means over the last ten. Exits 1 when the curves are not within
noise. --out writes JSON and a PNG of both curves.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def find_scalars(work_dir: Path) -> Path:
    candidates = sorted(work_dir.glob("*/vis_data/scalars.json"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise FileNotFoundError(f"{work_dir}: no */vis_data/scalars.json (is it an mmengine work dir?)")
    return candidates[-1]


def logged_window(scalars: Path) -> int:
    """The running-mean window mmengine logged the losses with: log_processor.window_size of the
    config the run saved beside its scalars (mmengine's default, 10, where the config names none)."""
    saved = scalars.parent / "config.py"
    if not saved.exists():
        return 1  # not an mmengine run dir (hand-made curves): the values are taken as logged
    from mmengine.config import Config

    window = Config.fromfile(str(saved)).get("log_processor", {}).get("window_size", 10)
    if not isinstance(window, int):
        raise ValueError(f"{saved}: log_processor.window_size={window!r}; compare runs logged with window_size=1")
    return window


def undo_running_means(means: list[float], window: int) -> list[float]:
    """Per-iteration values from the running means mmengine logged at iterations 1, 2, 3, ...:
    mean_k averages the last min(k, window) values, so value_k = k mean_k - (k-1) mean_(k-1) while
    k <= window, then value_k = window (mean_k - mean_(k-1)) + value_(k-window)."""
    values: list[float] = []
    for k, mean in enumerate(means, start=1):
        previous = means[k - 2] if k > 1 else 0.0
        if k <= window:
            values.append(k * mean - (k - 1) * previous)
        else:
            values.append(window * (mean - previous) + values[k - 1 - window])
    return values


def read_curve(path: Path, window: int | None = None) -> dict[int, float]:
    """Training iteration -> loss, per iteration (running means undone; see logged_window)."""
    curve = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" not in record or "iter" not in record:
            continue  # validation records
        curve[int(record["step"] if "step" in record else record["iter"])] = float(record.get("global_loss", record["loss"]))
    if not curve:
        raise ValueError(f"{path}: no training losses")
    return undo_logged_window(path, curve, logged_window(path) if window is None else window)


TRAIN_LINE = re.compile(r"(?:Epoch\(train\)\s*\[(\d+)\]|Iter\(train\))\s*\[\s*(\d+)/(\d+)\]")
LOGGED_VALUE = r"\s{}: (\S+)"


def read_text_log(path: Path) -> dict[int, float]:
    """Training iteration -> loss from mmengine's text log: the train lines' `global_loss` (else
    `loss`). Only logs of window_size=1 (its config dump says): undoing running means from values
    printed to 4 decimals would add the rounding error up over the run."""
    text = path.read_text()
    curve = {}
    for line in text.splitlines():
        match = TRAIN_LINE.search(line)
        if not match:
            continue
        epoch, index, per_epoch = match.groups()
        value = re.search(LOGGED_VALUE.format("global_loss"), line) or re.search(LOGGED_VALUE.format("loss"), line)
        if value is None:
            continue
        step = (int(epoch) - 1) * int(per_epoch) + int(index) if epoch else int(index)
        curve[step] = float(value.group(1))
    if not curve:
        raise ValueError(f"{path}: no training losses (not an mmengine text log?)")
    if text_log_window(text) != 1:
        raise ValueError(f"{path}: a text log of running means; compare runs logged with log_processor.window_size=1")
    return curve


def text_log_window(text: str) -> int:
    window = re.search(r"window_size=(\d+)", text)
    return int(window.group(1)) if window else 10


def undo_logged_window(path: Path, curve: dict[int, float], window: int) -> dict[int, float]:
    if window <= 1:
        return curve
    steps = sorted(curve)
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(
            f"{path}: losses logged as running means over {window} iterations, but not every iteration from 1: "
            "log with default_hooks.logger.interval=1, or log_processor.window_size=1"
        )
    return dict(zip(steps, undo_running_means([curve[s] for s in steps], window)))


def read_run(run: Path) -> tuple[dict[int, float], int]:
    """A run's per-iteration curve and the window it was logged with: a work dir, or a text log."""
    if run.is_file() and run.suffix == ".log":
        return read_text_log(run), 1
    scalars = find_scalars(run)
    window = logged_window(scalars)
    return read_curve(scalars, window), window


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else float("nan")


def compare(
    reference: dict[int, float], other: dict[int, float], head: int = 5, tail: int = 10, max_offset: float = 0.01
) -> dict:
    steps = sorted(set(reference) & set(other))
    if len(steps) < 3:
        raise ValueError(f"the runs share only {len(steps)} logged iterations")
    a = [reference[s] for s in steps]
    b = [other[s] for s in steps]
    difference = rms([x - y for x, y in zip(a, b)])
    noise = rms([a[i + 1] - a[i] for i in range(len(a) - 1)])
    half = len(steps) // 2
    offset = sum(y - x for x, y in zip(a[half:], b[half:])) / sum(a[half:])  # (other - reference) / reference
    return {
        "iterations": len(steps),
        "rms_difference": difference,
        "rms_step_change": noise,
        "second_half_offset": offset,
        "max_offset": max_offset,
        "within_noise": difference <= noise and abs(offset) <= max_offset,
        "max_rel_diff_first": max(abs(x - y) / abs(x) for x, y in zip(a[:head], b[:head])),
        "first_iterations": head,
        "mean_last_reference": sum(a[-tail:]) / len(a[-tail:]),
        "mean_last_other": sum(b[-tail:]) / len(b[-tail:]),
        "steps": steps,
        "reference": a,
        "other": b,
    }


def run_to_run_noise(references: list[dict[int, float]], max_offset: float = 0.01) -> dict:
    """Pairwise comparisons of runs of one configuration: their largest second-half offset and RMS
    difference, and the offset bound that follows (at least `max_offset`)."""
    if len(references) < 2:
        raise ValueError("run-to-run noise needs at least two runs of the reference configuration")
    pairs = [compare(a, b) for i, a in enumerate(references) for b in references[i + 1 :]]
    largest_offset = max(abs(p["second_half_offset"]) for p in pairs)
    return {
        "runs": len(references),
        "pair_offsets": [p["second_half_offset"] for p in pairs],
        "pair_rms_differences": [p["rms_difference"] for p in pairs],
        "largest_offset": largest_offset,
        "offset_bound": max(max_offset, largest_offset),
    }


def compare_with_repeats(
    references: list[dict[int, float]], other: dict[int, float], max_offset: float = 0.01
) -> dict:
    """compare(references[0], other) judged against the references' measured run-to-run noise."""
    noise = run_to_run_noise(references, max_offset)
    result = compare(references[0], other, max_offset=noise["offset_bound"])
    result["run_to_run"] = noise
    result["offsets_against_each_reference"] = [compare(r, other)["second_half_offset"] for r in references]
    return result


def plot(path: Path, result: dict, labels: tuple[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(result["steps"], result["reference"], label=labels[0], lw=1.2)
    ax.plot(result["steps"], result["other"], label=labels[1], lw=1.2, ls="--")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title(f"RMS difference {result['rms_difference']:.3g} vs step noise {result['rms_step_change']:.3g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", type=Path, help="work dir (or text log) of the reference run (e.g. one GPU)")
    p.add_argument("other", type=Path, help="work dir (or text log) of the run to check (e.g. DDP)")
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    p.add_argument("--max-offset", type=float, default=0.01, help="largest mean relative offset over the second half")
    p.add_argument(
        "--repeats", type=Path, nargs="+", default=[],
        help="work dirs (or text logs) of further runs of the reference's configuration: "
        "the offset bound is their measured noise",
    )
    args = p.parse_args(argv)
    runs = [read_run(run) for run in (args.reference, *args.repeats, args.other)]
    curves, windows = [curve for curve, _ in runs], [window for _, window in runs]
    references, other = curves[:-1], curves[-1]
    if args.repeats:
        result = compare_with_repeats(references, other, max_offset=args.max_offset)
        noise = result["run_to_run"]
        print(f"run-to-run noise of the reference's configuration ({noise['runs']} runs): second-half offsets "
              f"{', '.join(f'{o:+.2%}' for o in noise['pair_offsets'])}; offset bound {noise['offset_bound']:.2%}")
        print("the other run's offset against each reference run: "
              + ", ".join(f"{o:+.2%}" for o in result["offsets_against_each_reference"]))
    else:
        result = compare(references[0], other, max_offset=args.max_offset)
    result["logged_windows"] = windows
    if max(windows) > 1:
        print(f"losses were logged as running means over {windows} iterations: compared per iteration, means undone")
    print(f"{result['iterations']} iterations: RMS difference {result['rms_difference']:.4g}, "
          f"RMS iteration-to-iteration change {result['rms_step_change']:.4g}; second-half offset "
          f"{result['second_half_offset']:+.2%} (at most {result['max_offset']:.2%}) -> "
          f"{'within noise' if result['within_noise'] else 'NOT within noise'}")
    print(f"largest relative difference over the first {result['first_iterations']} iterations: {result['max_rel_diff_first']:.2e}")
    print(f"mean of the last ten: {result['mean_last_reference']:.4f} ({args.reference}) vs {result['mean_last_other']:.4f} ({args.other})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({k: v for k, v in result.items()}, indent=1) + "\n")
        plot(args.out.with_suffix(".png"), result, (str(args.reference), str(args.other)))
    return 0 if result["within_noise"] else 1


if __name__ == "__main__":
    sys.exit(main())
