"""Sweep for 'auto': on each of CASES, is backend='auto' within 1.10x of the fastest compiled backend,
forward and backward separately?

    python tools/sweep_backends.py                       # every case, every compiled backend and auto
    python tools/sweep_backends.py --list                # the cases and the time estimate; runs nothing
    python tools/sweep_backends.py --cases 0 7 31        # a subset, by index
    python tools/sweep_backends.py --render bench_results/sweep.json   # redo Markdown and PNG

Each (case, direction, backend) is timed as tools/benchmark_op.py times it: CUDA-graph replays of
rotated input sets (2-8, so the L2 cannot hold them), CUDA events, median of --iters after
--warmup. 'auto' is timed through the public `mmdeform_tma.multi_scale_deformable_attn(...,
backend='auto')`, so whatever it picks (per direction, from whatever table or rule) is what is
timed; the backend it ran is read from the ops it called (bench_common.observed_backends). The
forward is an inference call (no gradients); the backward is the gradient of a forward that
recorded one, as in training. Inputs come from fixed seeds (benchmark_op.rotated_input_sets).

Writes JSON (every timing, and per case and direction: the fastest backend, auto's pick, their
time ratio and whether it meets the target), Markdown and a PNG of the ratio per case.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import benchmark_op  # noqa: E402
from benchmark_op import Shape  # noqa: E402

import mmdeform_tma  # noqa: E402

TARGET_RATIO = 1.10
SWEEP_DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Case:
    shape: Shape
    locality: str  # 'local': reference point + N(0, 2 px); 'uniform': anywhere in [-0.1, 1.1]
    dtype: str

    @property
    def name(self) -> str:
        return self.shape.name

    def describe(self) -> str:
        return f"{self.shape.describe()} {self.locality} {self.dtype}"


def pyramid(height: int, width: int, levels: int, stride: int) -> tuple[tuple[int, int], ...]:
    """Feature-map sizes of an image at strides stride, 2*stride, ... (ceil, as a conv backbone pads)."""
    return tuple((math.ceil(height / (stride * 2**i)), math.ceil(width / (stride * 2**i))) for i in range(levels))


def _case(index, batch, heads, channels, levels, points, queries, image, stride, locality, dtype) -> Case:
    height, width = image
    kind = "enc" if queries is None else f"q{queries}"
    name = f"s{index:02d}_{kind}_b{batch}_h{heads}c{channels}_l{levels}p{points}_{height}x{width}_{locality}_{dtype}"
    shape = Shape(name, pyramid(height, width, levels, stride), batch, queries, heads, channels, points)
    return Case(shape, locality, dtype)


F16, BF16, F32 = "float16", "bfloat16", "float32"
DETR_IMAGE, DINO5_IMAGE, M2F_IMAGE = (800, 1216), (800, 1333), (1024, 1024)
# (batch, heads, channels, levels, points, queries (None: one per key, an encoder), image, stride, locality, dtype)
_TABLE = [
    # Deformable DETR / DINO-4scale: 8 heads x 32 channels, 4 levels x 4 points, strides 8-64
    (1, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", BF16),
    (2, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", F32),
    (2, 8, 32, 4, 4, None, DETR_IMAGE, 8, "uniform", F16),
    (8, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", F16),
    (16, 8, 32, 4, 4, None, DETR_IMAGE, 8, "local", BF16),
    (1, 8, 32, 4, 4, 100, DETR_IMAGE, 8, "local", F32),
    (2, 8, 32, 4, 4, 300, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 4, 300, DETR_IMAGE, 8, "uniform", BF16),
    (8, 8, 32, 4, 4, 300, DETR_IMAGE, 8, "local", F32),
    (16, 8, 32, 4, 4, 300, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 4, 900, DETR_IMAGE, 8, "local", F16),
    (4, 8, 32, 4, 4, 900, DETR_IMAGE, 8, "local", BF16),
    (16, 8, 32, 4, 4, 900, DETR_IMAGE, 8, "uniform", F32),
    # DINO-5scale / Co-DETR: 5 levels from stride 4 (89,023 keys)
    (1, 8, 32, 5, 4, None, DINO5_IMAGE, 4, "local", F16),
    (1, 8, 32, 5, 4, None, DINO5_IMAGE, 4, "uniform", BF16),
    (2, 8, 32, 5, 4, 900, DINO5_IMAGE, 4, "local", F16),
    (1, 8, 32, 5, 4, 90000, DINO5_IMAGE, 4, "uniform", F32),
    # Mask2Former pixel decoder: 3 levels, strides 8-32
    (1, 8, 32, 3, 4, None, M2F_IMAGE, 8, "local", F16),
    (2, 8, 32, 3, 4, None, M2F_IMAGE, 8, "local", BF16),
    (4, 8, 32, 3, 4, None, M2F_IMAGE, 8, "local", F32),
    (2, 8, 32, 3, 4, None, M2F_IMAGE, 8, "uniform", F16),
    # points per level 2-8
    (2, 8, 32, 4, 2, None, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 8, None, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 4, 8, 300, DETR_IMAGE, 8, "local", F32),
    (4, 8, 32, 4, 2, 300, DETR_IMAGE, 8, "local", BF16),
    (1, 8, 32, 3, 6, None, M2F_IMAGE, 8, "local", F16),
    # heads 4-16 x channels 16-128
    (2, 4, 64, 4, 4, None, DETR_IMAGE, 8, "local", F16),
    (2, 16, 16, 4, 4, None, DETR_IMAGE, 8, "local", F16),
    (1, 4, 128, 4, 4, None, DETR_IMAGE, 8, "local", BF16),
    (2, 16, 32, 4, 4, 900, DETR_IMAGE, 8, "local", F16),
    (2, 8, 64, 4, 4, None, DETR_IMAGE, 8, "local", F32),
    (2, 8, 128, 4, 4, 300, DETR_IMAGE, 8, "local", F32),
    (1, 16, 64, 4, 4, None, DETR_IMAGE, 8, "local", BF16),
    (8, 4, 16, 4, 4, 100, DETR_IMAGE, 8, "uniform", F32),
    (2, 12, 32, 3, 4, None, M2F_IMAGE, 8, "local", F16),
    # smaller images and other query counts
    (8, 8, 32, 4, 4, None, (512, 512), 8, "local", F16),
    (16, 8, 32, 3, 4, None, (320, 320), 8, "local", BF16),
    (1, 8, 32, 3, 4, 100, M2F_IMAGE, 8, "uniform", F16),
    (4, 8, 32, 4, 4, 2000, DETR_IMAGE, 8, "local", F16),
    (2, 8, 32, 5, 4, 5000, DINO5_IMAGE, 4, "local", BF16),
    (4, 8, 32, 4, 4, None, (1333, 800), 8, "uniform", F32),
    (1, 8, 32, 5, 8, 300, DINO5_IMAGE, 4, "local", F16),
    (2, 8, 32, 4, 4, None, (640, 640), 8, "local", F16),
]
CASES = [_case(i, *row) for i, row in enumerate(_TABLE)]

# Estimate: seconds per (point x channel) of the slowest compiled backend on an H100 when this was set
# (docs/perf_notes.md, encoder bs2: the since retired `tma`, fp32 forward 1.13 ms, backward 1.82 ms over
# 165 M point-channels; an upper bound for today's backends), uniform
# sampling 2x, at least 25 us a call; plus set-up per timing (graph captures) and per case (inputs).
SECONDS_PER_POINT_CHANNEL = {"forward": 7e-12, "backward": 11e-12}
UNIFORM_FACTOR = 2.0
MIN_CALL_S = 25e-6
SETUP_PER_TIMING_S = 0.25
SETUP_PER_CASE_S = 0.3


def estimate_seconds(cases: list[Case], timings_per_direction: int, warmup: int, iters: int) -> float:
    total = 0.0
    for case in cases:
        s = case.shape
        point_channels = s.batch * s.num_queries * s.heads * len(s.levels) * s.points * s.channels
        set_bytes = benchmark_op.compulsory_bytes(s, benchmark_op.DTYPES[case.dtype], "forward")  # about one input set
        rotations = benchmark_op.rotation_count(set_bytes)
        total += SETUP_PER_CASE_S
        for direction in SWEEP_DIRECTIONS:
            factor = UNIFORM_FACTOR if case.locality == "uniform" else 1.0
            call_s = max(MIN_CALL_S, point_channels * SECONDS_PER_POINT_CHANNEL[direction] * factor)
            calls = warmup + iters + 3 * rotations  # each rotated set runs twice before its capture, and once in it
            total += timings_per_direction * (SETUP_PER_TIMING_S + calls * call_s)
    return total


@dataclass
class Timing:
    case: int
    name: str
    shape: str
    dtype: str
    locality: str
    direction: str
    backend: str
    timing: dict = field(default_factory=dict)
    timing_mode: str = ""
    ran: str | None = None  # for 'auto': the backend its ops named
    error: str | None = None


def summarize_case(timings: list[Timing]) -> dict:
    """For one case and direction: the fastest non-auto backend, auto's pick, and auto's ratio to it."""
    first = timings[0]
    ok = {t.backend: t.timing["median_ms"] for t in timings if t.timing and not t.error}
    auto = next((t for t in timings if t.backend == "auto"), None)
    candidates = {b: ms for b, ms in ok.items() if b != "auto"}
    fastest = min(candidates, key=candidates.get) if candidates else None
    auto_ms = ok.get("auto")
    ratio = auto_ms / candidates[fastest] if fastest and auto_ms else None
    modes = {t.backend: t.timing_mode for t in timings if t.timing and not t.error}
    return {
        "case": first.case,
        "name": first.name,
        "shape": first.shape,
        "dtype": first.dtype,
        "locality": first.locality,
        "direction": first.direction,
        "median_ms": ok,
        "unavailable": {t.backend: t.error for t in timings if t.error},
        "fastest": fastest,
        "fastest_ms": candidates.get(fastest),
        "auto_ms": auto_ms,
        "auto_pick": auto.ran if auto else None,
        "ratio": ratio,
        "within_target": None if ratio is None else ratio <= TARGET_RATIO,
        # a graph capture that failed for one of the two makes the ratio one of eager against replay
        "same_timing_mode": None if ratio is None else modes["auto"] == modes[fastest],
    }


def time_case(
    index: int, case: Case, backends: list[str], device: torch.device, warmup: int, iters: int, use_graphs: bool
) -> list[Timing]:
    dtype = benchmark_op.DTYPES[case.dtype]
    input_sets = benchmark_op.rotated_input_sets(case.shape, dtype, case.locality, device)
    timings = []
    for direction in SWEEP_DIRECTIONS:
        for backend in [*backends, "auto"]:
            t = Timing(index, case.name, case.shape.describe(), case.dtype, case.locality, direction, backend)
            try:
                if backend == "auto":
                    t.ran = auto_pick(input_sets[0], direction)
                graphs = use_graphs and backend != "pytorch"  # the reference reads level shapes on the host
                samples, t.timing_mode = bench_common.time_calls(
                    device, benchmark_op.timed_calls(backend, direction, input_sets), warmup, iters, use_graphs=graphs
                )
                t.timing = bench_common.summarize(samples)
            except mmdeform_tma.BackendUnavailableError as exc:
                t.error = "unavailable: " + str(exc).splitlines()[-1].strip(" -")
            timings.append(t)
    return timings


def auto_pick(inputs, direction: str) -> str:
    """The backend 'auto' runs in `direction`: the forward as timed (no gradients), the backward
    after a forward that records one. Read from the ops it calls; where none is recognised, what
    `mmdeform_tma.dispatch.select` declares, if the package has it; else 'unknown'."""
    bound = benchmark_op.bind("auto", inputs)
    if direction == "forward":
        ran = bench_common.observed_backends(benchmark_op.direction_call(bound, "forward", None))["forward"]
    else:
        grad_out = benchmark_op.output_gradient(inputs, torch.Generator(inputs[0].device).manual_seed(5))
        training_step = benchmark_op.direction_call(bound, "forward+backward", grad_out)
        ran = bench_common.observed_backends(training_step)["backward"]
    return ran if ran != "unknown" else declared_pick(inputs, direction)


def declared_pick(inputs, direction: str) -> str:
    select = getattr(mmdeform_tma.dispatch, "select", None)  # per-direction selection, where the package has it
    if select is None:
        return "unknown"
    value, shapes, starts, locations, weights = inputs
    if direction == "backward":
        locations = locations.detach().requires_grad_()
    with torch.set_grad_enabled(direction == "backward"):
        selection = select("auto", mmdeform_tma.inputs.validate(value, shapes, starts, locations, weights))
    return f"{getattr(selection, direction).name} (dispatch.select)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--backends", nargs="*", help="default: every compiled backend available on the device")
    p.add_argument("--cases", nargs="*", type=int, help=f"indices into CASES (0-{len(CASES) - 1}); default all")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-graphs", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--list", action="store_true", help="print the cases and the time estimate, run nothing")
    p.add_argument("--out", type=Path, default=Path("bench_results/sweep"), help="output prefix (.json .md .png)")
    p.add_argument("--render", type=Path, help="only rewrite the Markdown and PNG of a saved JSON (to --out)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        write_outputs(args.out, saved["environment"], [Timing(**t) for t in saved["results"]])
        return 0
    indices = args.cases if args.cases is not None else list(range(len(CASES)))
    cases = [CASES[i] for i in indices]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = args.backends
    if backends is None:
        available = mmdeform_tma.available_backends(device)
        backends = [b for b in benchmark_op.COMPILED_BACKENDS if b in available]
    estimate = estimate_seconds(cases, len(backends) + 1, args.warmup, args.iters)
    timed = ", ".join([*backends, "auto"])
    print(f"{len(cases)} cases x {len(SWEEP_DIRECTIONS)} directions x {len(backends) + 1} ({timed}); "
          f"estimate on an H100: {estimate / 60:.1f} min", file=sys.stderr)
    if args.list:
        print(bench_common.console_table(["#", "case"], [[i, CASES[i].describe()] for i in indices]))
        return 0
    if not backends:
        raise SystemExit(
            f"no compiled backend is available on {device} (python -m mmdeform_tma.info says why); the sweep compares "
            "compiled backends: run it on a GPU build, or name backends with --backends"
        )
    env = bench_common.environment(device)
    env.update(backends=backends, warmup=args.warmup, iters=args.iters, target_ratio=TARGET_RATIO)
    start = time.perf_counter()
    timings: list[Timing] = []
    with bench_common.side_stream(device):
        if device.type == "cuda":
            bench_common.warm_up_gpu(device)
        for index in bench_common.progress(indices, len(indices), "sweep"):
            timings += time_case(index, CASES[index], backends, device, args.warmup, args.iters, not args.no_graphs)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env["elapsed_s"] = time.perf_counter() - start
    summary = write_outputs(args.out, env, timings)
    met = [s for s in summary if s["within_target"]]
    judged = [s for s in summary if s["within_target"] is not None]
    print(bench_common.console_table(*summary_table(summary)))
    print(f"\nauto within {TARGET_RATIO:.2f}x of the fastest: {len(met)} of {len(judged)} (case, direction) pairs; "
          f"took {env['elapsed_s'] / 60:.1f} min (estimate {estimate / 60:.1f})")
    print(f"wrote {args.out}.json, {args.out}.md, {args.out}.png  (device: {env['device']}, commit {env['commit']})")
    return 0


def summaries(timings: list[Timing]) -> list[dict]:
    groups: dict[tuple[int, str, str], list[Timing]] = {}
    for t in timings:
        groups.setdefault((t.case, t.name, t.direction), []).append(t)
    return [summarize_case(group) for group in groups.values()]


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary_table(summary: list[dict]) -> tuple[list[str], list[list[object]]]:
    header = ["#", "shape", "dtype", "sampling", "direction", "fastest", "ms", "auto ran", "auto ms", "ratio"]
    header.append(f"<= {TARGET_RATIO:.2f}")
    verdict = {True: "yes", False: "**no**", None: "-"}
    rows = [
        [s["case"], s["shape"], s["dtype"], s["locality"], s["direction"], s["fastest"] or "-",
         fmt(s["fastest_ms"], ".4f"), s["auto_pick"] or "-", fmt(s["auto_ms"], ".4f"),
         fmt(s["ratio"], ".3f") + ("" if s["same_timing_mode"] in (True, None) else " (timing modes differ)"),
         verdict[s["within_target"]]]
        for s in summary
    ]
    return header, rows


def write_outputs(prefix: Path, env: dict, timings: list[Timing]) -> list[dict]:
    summary = summaries(timings)
    bench_common.write_json(
        prefix.with_suffix(".json"),
        {
            "environment": env,
            "cases": [c.describe() for c in CASES],
            "summary": summary,
            "results": [asdict(t) for t in timings],
        },
    )
    judged = [s for s in summary if s["within_target"] is not None]
    md = [
        f"# Backend sweep for 'auto' ({env['device']})",
        "",
        f"date {env['date']}, commit {env['commit']}, torch {env['torch']} (CUDA {env['torch_cuda']}); backends "
        f"{', '.join(env['backends'])} and auto; median of {env['iters']} CUDA-graph replays after {env['warmup']} "
        "warm-up calls.",
        "",
        f"'ratio' is auto's median over the fastest backend's; the target is <= {TARGET_RATIO:.2f}. Met on "
        f"{sum(bool(s['within_target']) for s in judged)} of {len(judged)} (case, direction) pairs. 'auto ran' names "
        "the backend whose ops auto called.",
        "",
        bench_common.markdown_table(*summary_table(summary)),
    ]
    prefix.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(prefix.with_suffix(".png"), env, summary)
    return summary


def plot(path: Path, env: dict, summary: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({s["case"] for s in summary})
    fig, ax = plt.subplots(figsize=(max(8, 0.25 * len(cases) + 3), 4))
    for direction, marker in zip(SWEEP_DIRECTIONS, ("o", "s")):
        points = [
            (cases.index(s["case"]), s["ratio"])
            for s in summary
            if s["direction"] == direction and s["ratio"] is not None
        ]
        if points:
            ax.scatter(*zip(*points), marker=marker, label=direction, s=22)
    ax.axhline(TARGET_RATIO, color="tab:red", linestyle="--", linewidth=1, label=f"target {TARGET_RATIO:.2f}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([str(c) for c in cases], fontsize=6)
    ax.set_xlabel("case (see the JSON or Markdown for shapes)")
    ax.set_ylabel("auto / fastest backend")
    ax.set_title(f"auto against the fastest backend per case ({env['device']}, {env['commit']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
