"""Small forward + backward calls of every compiled backend, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tools/sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/sanitize_cases.py --backends tma_ws
    compute-sanitizer --tool synccheck python tools/sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/sanitize_cases.py --backends tma_ws --groups region

Covers every dtype, the fast and the deterministic backward (its sorted value gradient, which
`auto` takes for these small cross-attention cases, and fixed point), partial tiles and points
outside the levels, and for tma_ws every compiled variant with windows (TMA windows, and the MMA
backward's accumulation windows) on encoder problems (one query per pixel: pixel-block tiles;
sampled locally, and uniformly over a level larger than four windows) and a decoder one, the
tensor-core gather forward configs, the windowless forward configs on a decoder, and the region
forward configs on encoders (local sampling over 3 and 5 levels, regions of more than one pass, and
uniform sampling that hands the output to the windowless fallback). `--groups` narrows a run to some
of these (a kernel just changed, within one device call's time). Prints one line per case; any
error the tool finds is reported by compute-sanitizer itself.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mmdeform_tma  # noqa: E402
from msda_cases import make_problem  # noqa: E402
from mmdeform_tma._extension import kernel_configs  # noqa: E402

ops = torch.ops.mmdeform_tma


def num_keys(levels: list[tuple[int, int]]) -> int:
    return sum(h * w for h, w in levels)


def window_variants(dtype: torch.dtype) -> None:
    """tma_ws's windowed and MMA variants, called through the ops with their config index."""
    encoder = [(9, 13), (5, 7), (3, 4)]
    # One query per key sampled uniformly over a level larger than four of the MMA's 16 x 16 windows:
    # stages without a window (every point direct) beside windowed ones, and the fast 32-channel MMA
    # kernels' CTAs handing their tiles to the spread fallback (their first stage spreads).
    spread = [(40, 48), (20, 24)]
    cases = (("encoder", encoder, num_keys(encoder)), ("local", encoder, 40), ("uniform", spread, num_keys(spread)))
    for locality, levels, queries in cases:
        g = torch.Generator().manual_seed(1)
        problem = make_problem(levels, batch=2, queries=queries, heads=2, channels=32, points=4, dtype=dtype,
                               generator=g, locality=locality)
        args = problem.to(device="cuda", dtype=dtype, coord_dtype=problem.sampling_locations.dtype).args()
        grad = torch.randn(2, queries, 64, device="cuda", dtype=dtype)
        forward_names = kernel_configs("tma_ws", "forward")
        for index, name in enumerate(kernel_configs("tma_ws", "backward")):  # the shared ones, then backward-only ones
            if "_w" not in name and "_m16" not in name:
                continue
            if index < len(forward_names) and forward_names[index] == name:
                ops.ms_deform_attn_forward(*args, "tma_ws", index)
            for deterministic in (False, True):
                ops.ms_deform_attn_backward(grad, *args, "tma_ws", index, deterministic)
            torch.cuda.synchronize()
            print(f"tma_ws  {str(dtype):15} {locality:8} {name}: ok")


def cuda_args(levels, queries: int, heads: int, points: int, dtype: torch.dtype, seed: int, locality: str) -> tuple:
    """The op's inputs for a problem of 32-channel heads, batch 2, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    problem = make_problem(levels, batch=2, queries=queries, heads=heads, channels=32, points=points, dtype=dtype,
                           generator=g, locality=locality)
    return problem.to(device="cuda", dtype=dtype, coord_dtype=problem.sampling_locations.dtype).args()


def forward_configs(args: tuple, dtype: torch.dtype, label: str, selected) -> None:
    """Every tma_ws forward config whose name `selected` accepts, on the inputs `args`."""
    for index, name in enumerate(kernel_configs("tma_ws", "forward")):
        if selected(name):
            ops.ms_deform_attn_forward(*args, "tma_ws", index)
            torch.cuda.synchronize()
            print(f"tma_ws  {str(dtype):15} {label:8} {name}: ok")


def tensor_core_variants(dtype: torch.dtype) -> None:
    """tma_ws's tensor-core gather forward configs (`tc_*`, fp16/bf16 rows of 32 channels): 12 points
    per item (padding lanes), 40 (the step loop) and an encoder; points outside the levels."""
    cases = (("p4_l3", [(9, 13), (5, 7), (3, 4)], 4, 40), ("p8_l5", [(8, 8), (4, 4), (2, 2), (1, 2), (1, 1)], 8, 33),
             ("encoder", [(9, 13), (5, 7), (3, 4)], 4, 9 * 13 + 5 * 7 + 3 * 4))
    for label, levels, points, queries in cases:
        args = cuda_args(levels, queries, 3, points, dtype, seed=2, locality="uniform")
        forward_configs(args, dtype, label, lambda name: name.startswith("tc_"))


def lean_variants(dtype: torch.dtype) -> None:
    """tma_ws's windowless forward configs (`_l1`) on decoders sampled uniformly (corners outside the
    levels): 4 points a level, where 16-query tiles give the half-precision one-slot kernel a tile's
    coordinates held in its producer's registers, and 5 (a point left over after the pairs)."""
    for points in (4, 5):
        args = cuda_args([(9, 13), (5, 7), (3, 4)], 45, 2, points, dtype, seed=3, locality="uniform")
        forward_configs(args, dtype, f"lean_p{points}", lambda name: "_l1" in name)


def region_variants(dtype: torch.dtype) -> None:
    """tma_ws's region forward configs (`rg_*`, fp16/bf16 encoders of 32-channel heads): 3 levels (an odd
    count), 5 levels of 8 points, a second level larger than the first (several passes a region), and
    uniform sampling over a first level several windows wide (the flag and the windowless fallback)."""
    cases = (("rg_l3", [(9, 13), (5, 7), (3, 4)], 4, "encoder"),
             ("rg_p8_l5", [(16, 40), (8, 20), (4, 10), (2, 5), (1, 3)], 8, "encoder"),
             ("rg_pass", [(9, 17), (30, 40), (5, 6)], 4, "encoder"),
             ("rg_spread", [(48, 64), (24, 32), (12, 16)], 4, "uniform"))
    for label, levels, points, locality in cases:
        args = cuda_args(levels, num_keys(levels), 2, points, dtype, seed=4, locality=locality)
        forward_configs(args, dtype, label, lambda name: name.startswith("rg_"))


def backend_calls(backends: list[str]) -> None:
    shapes = [(7, 9), (4, 5), (2, 3), (1, 1)]
    wide_shapes = [(40, 60), (20, 30), (10, 15), (5, 8)]  # 3,190 keys: cross-attention at 1,300 queries
    layout_variable = "MMDEFORM_TMA_GRAD_VALUE_LAYOUT"
    previous_layout = os.environ.get(layout_variable)
    for backend in backends:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for deterministic, layout in ((False, "auto"), (True, "auto"), (True, "dense")):
                os.environ[layout_variable] = layout
                # The sorted backward's level runs (queries x 3 points x 4 corners): 444, 3,600,
                # 6,000, 9,600 and 12,000 entries sort in one block each (its 5-, 11-, 15-, 21- and
                # 29-key shapes; fp64 takes cub), 15,600 with cub, in place.
                sorted_runs = ((37, shapes), (300, wide_shapes), (500, wide_shapes), (800, wide_shapes),
                               (1000, wide_shapes), (1300, wide_shapes))
                for queries, levels in sorted_runs if (deterministic, layout) == (True, "auto") else sorted_runs[:1]:
                    g = torch.Generator().manual_seed(0)
                    problem = make_problem(levels, batch=2, queries=queries, heads=3, channels=32, points=3, dtype=dtype,
                                           generator=g)
                    problem = problem.to(device="cuda", dtype=dtype, coord_dtype=problem.sampling_locations.dtype)
                    problem.requires_grad_()
                    torch.use_deterministic_algorithms(deterministic)
                    out = mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend=backend)
                    out.backward(torch.randn_like(out))
                    torch.cuda.synchronize()
                    print(f"{backend:7} {str(dtype):15} deterministic={deterministic} layout={layout} queries={queries}: ok")
    torch.use_deterministic_algorithms(False)
    if previous_layout is None:
        os.environ.pop(layout_variable, None)
    else:
        os.environ[layout_variable] = previous_layout


# tma_ws's config families, each over the dtypes it takes (the backend's calls are group "ops").
VARIANT_GROUPS = {
    "window": ((torch.float16, torch.bfloat16, torch.float32), window_variants),
    "tensor_core": ((torch.float16, torch.bfloat16), tensor_core_variants),
    "lean": ((torch.float16, torch.bfloat16), lean_variants),
    "region": ((torch.float16, torch.bfloat16), region_variants),
}
GROUPS = ("ops", *VARIANT_GROUPS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="*", default=["cuda", "tma_ws"])
    p.add_argument("--groups", nargs="*", choices=GROUPS, default=list(GROUPS),
                   help="ops: every backend's forward and backward calls; the others: tma_ws's config families")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "ops" in args.groups:
        backend_calls(args.backends)
    if "tma_ws" in args.backends:
        for group in (g for g in args.groups if g in VARIANT_GROUPS):
            dtypes, variants = VARIANT_GROUPS[group]
            for dtype in dtypes:
                variants(dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
