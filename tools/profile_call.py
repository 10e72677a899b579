"""Where one call's time goes: the kernels of a public op call (forward + backward), per call.

    python tools/profile_call.py --presets detr_dec_bs2 --backends tma_ws cuda --dtypes float16
    python tools/profile_call.py --presets detr_dec_bs2 dino_dec_bs2 --grad-value-layouts dense touched \\
        --deterministic both --out docs/measurements/calls_h100
    python tools/profile_call.py --device cpu          # the reference backend's ops, tiny preset
    python tools/profile_call.py --presets detr_enc_bs2 --forward-config rg_r8x16 --locality local uniform

torch.profiler over `--calls` eager calls of `mmdeform_tma.multi_scale_deformable_attn` and the
backward of its output, input sets rotated as in tools/benchmark_op.py (L2 cannot hold them all).
Each row is one kernel (on the CPU: one operator): its time and launch count per call, summed
over its launches. `--grad-value-layouts` sets MMDEFORM_TMA_GRAD_VALUE_LAYOUT per run (dense: the
whole accumulator zeroed and converted; touched: only the sampled cells' rows; sorted: the
deterministic backward's contributions sorted by cell), so the layouts of the value gradient are
compared kernel by kernel. `--forward-config NAME` profiles the forward op alone with one of the
backend's compiled forward configs (what a table would choose is bypassed), e.g. a config whose call
launches several kernels; `--locality` samples around the reference points or uniformly. Writes JSON
and Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from benchmark_op import DTYPES, PRESETS, rotated_input_sets  # noqa: E402

import mmdeform_tma  # noqa: E402
from mmdeform_tma._extension import kernel_configs  # noqa: E402

LAYOUT_VARIABLE = "MMDEFORM_TMA_GRAD_VALUE_LAYOUT"
NAME_WIDTH = 90


@contextlib.contextmanager
def grad_value_layout(layout: str | None):
    """MMDEFORM_TMA_GRAD_VALUE_LAYOUT set to `layout` inside (None: as it was)."""
    before = os.environ.get(LAYOUT_VARIABLE)
    if layout is not None:
        os.environ[LAYOUT_VARIABLE] = layout
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAYOUT_VARIABLE, None)
        else:
            os.environ[LAYOUT_VARIABLE] = before


def short_name(name: str) -> str:
    name = name.replace("mmdeform_tma::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def kernel_times(prof, device: torch.device, calls: int) -> list[dict]:
    """Per kernel (CPU: per operator, self time): microseconds and launches per call, largest first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us <= 0:
            continue
        totals[short_name(event.key)][0] += us
        totals[short_name(event.key)][1] += event.count
    rows = [{"kernel": k, "us_per_call": us / calls, "launches_per_call": n / calls} for k, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def forward_config_index(backend: str, name: str) -> int:
    names = list(kernel_configs(backend, "forward"))
    if name not in names:
        raise SystemExit(f"profile_call: backend {backend!r} compiles no forward config {name!r} "
                         f"(it has: {', '.join(names) or 'none'})")
    return names.index(name)


def profile_case(preset: str, backend: str, dtype: torch.dtype, deterministic: bool, layout: str | None,
                 device: torch.device, calls: int, warmup: int, locality: str = "local",
                 forward_config: str | None = None) -> dict:
    shape = PRESETS[preset]
    sets = rotated_input_sets(shape, dtype, locality, device)
    grads_out = []
    if forward_config is None:
        for value, shapes, starts, loc, attn in sets:
            for t in (value, loc, attn):
                t.requires_grad_()
            q = loc.shape[1]
            grads_out.append(torch.randn(value.shape[0], q, value.shape[2] * value.shape[3], device=device, dtype=dtype))
        index = -1
    else:
        index = forward_config_index(backend, forward_config)

    def call(i: int) -> None:
        value, shapes, starts, loc, attn = sets[i % len(sets)]
        if forward_config is not None:
            torch.ops.mmdeform_tma.ms_deform_attn_forward(value, shapes, starts, loc, attn, backend, index)
            return
        out = mmdeform_tma.multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend=backend)
        torch.autograd.grad(out, (value, loc, attn), grads_out[i % len(sets)])

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with grad_value_layout(layout):
            for i in range(warmup):
                call(i)
            bench_common.synchronize(device)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                for i in range(calls):
                    call(i)
                bench_common.synchronize(device)
    finally:
        torch.use_deterministic_algorithms(previous)
    kernels = kernel_times(prof, device, calls)
    return {
        "preset": preset,
        "shape": shape.describe(),
        "backend": backend,
        "forward_config": forward_config,
        "locality": locality,
        "dtype": str(dtype).removeprefix("torch."),
        "deterministic": deterministic,
        "grad_value_layout": layout or "default",
        "calls": calls,
        "total_us_per_call": sum(k["us_per_call"] for k in kernels),
        "kernels": kernels,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--presets", nargs="*", choices=list(PRESETS), default=None, help="default: detr_dec_bs2 (GPU), tiny (CPU)")
    p.add_argument("--backends", nargs="*", default=None, help="default: tma_ws (GPU), pytorch (CPU)")
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=None, help="default: float16 (GPU), float32 (CPU)")
    p.add_argument("--deterministic", choices=("off", "on", "both"), default="off")
    p.add_argument("--grad-value-layouts", nargs="*", choices=("dense", "touched", "sorted", "auto"), default=None,
                   help=f"values of {LAYOUT_VARIABLE} to run (default: leave it as it is)")
    p.add_argument("--locality", nargs="*", choices=("local", "uniform"), default=["local"])
    p.add_argument("--forward-config", default=None,
                   help="profile the forward op alone with this compiled forward config of each backend")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    presets = args.presets or (["detr_dec_bs2"] if on_gpu else ["tiny"])
    backends = args.backends or (["tma_ws"] if on_gpu else ["pytorch"])
    dtypes = [DTYPES[d] for d in (args.dtypes or (["float16"] if on_gpu else ["float32"]))]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    layouts = args.grad_value_layouts or [None]
    results = []
    for preset in presets:
        for backend in backends:
            for dtype in dtypes:
                for deterministic, layout, locality in itertools.product(modes, layouts, args.locality):
                    row = profile_case(preset, backend, dtype, deterministic, layout, device, args.calls, args.warmup,
                                       locality, args.forward_config)
                    results.append(row)
                    what = f"forward config {args.forward_config}" if args.forward_config else (
                        f"deterministic={deterministic} layout={row['grad_value_layout']}")
                    print(f"{preset} {backend} {row['dtype']} {locality} {what}: {row['total_us_per_call']:.1f} us per call")
                    for k in row["kernels"]:
                        print(f"    {k['us_per_call']:9.1f} us  x{k['launches_per_call']:g}  {k['kernel']}")
    if args.out is not None:
        bench_common.write_json(args.out.with_suffix(".json"), {"environment": bench_common.environment(device), "results": results})
        header = ["preset", "backend", "call", "locality", "dtype", "deterministic", "grad_value layout", "kernel",
                  "µs per call", "launches"]
        rows = []
        for r in results:
            what = f"forward {r['forward_config']}" if r["forward_config"] else "forward + backward"
            rows.append([r["preset"], r["backend"], what, r["locality"], r["dtype"], r["deterministic"], r["grad_value_layout"],
                         "**total**", f"**{r['total_us_per_call']:.1f}**", ""])
            rows += [[""] * 7 + [f"`{k['kernel']}`", f"{k['us_per_call']:.1f}", f"{k['launches_per_call']:g}"] for k in r["kernels"]]
        args.out.with_suffix(".md").write_text(bench_common.markdown_table(header, rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
