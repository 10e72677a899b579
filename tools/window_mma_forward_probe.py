"""Prices a forward design before it is built into the package (docs/perf_notes.md, item 141): value rows
in shared-memory windows, read by ldmatrix and summed on the tensor cores (`window_mma_forward_probe.cu`).

The package's encoder forward is held by issue (73 %) and L1 (77 % of its wavefront rate) at once
(items 134-139). This design cuts both: one `ldmatrix.x4` reads two points' corner rows in four
conflict-free wavefronts (the gathers through L1 take about 4.6 a point), and one `mma` sums them in
place of 128 conversions and FMAs.

    python tools/window_mma_forward_probe.py                        # bs 2 encoder, fp16 and bf16
    python tools/window_mma_forward_probe.py --presets detr_enc_bs8 detr_enc_bs6_p8 --compare dcnv4

Each row: the probe's error against float64 (on queries of every level) beside the rounding error of
the exact result, and median / p90 ms of the probe, `tma_ws` and `cuda` (and DCNv4 with --compare) on
the same rotated input sets, in the same run. Encoder presets with 32 channels only. Tiles are pixel
blocks of each query level, sized so that a tile's points reach about the same 8 x 8 block of the
finest level (`--tile-shapes`); a level's window is its points' bounding box, capped at
`--max-pixels` rows, and points outside it are summed on the CUDA cores.

Measured on the H100 (item 141): exact (1.0001x the rounding error), and 2.0x the time of `tma_ws`:
the window copies (cp.async, 4.3 instructions a point) and the per-level records (5.5) cost what the
tensor cores save in the sum.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import benchmark_op  # noqa: E402

from mmdeform_tma.reference import ms_deform_attn_reference  # noqa: E402

TILE_QUERIES = 64
# Each schedule's default window cap: the most rows that leave 4 CTAs a SM with one window (serial: the
# level's records, box, copy, wait and sum in turn) and 3 with two (overlap: level l + 1's window copied
# and level l + 2's records prepared while level l is summed).
SCHEDULES = {"serial": 600, "overlap": 448}
SOURCE = Path(__file__).with_suffix(".cu")
HOPPER_SOURCES = Path(__file__).resolve().parents[1] / "mmdeform_tma" / "csrc" / "hopper"  # mma_fragments.cuh
SIGNATURE = (
    "void run(torch::Tensor value, torch::Tensor shapes, torch::Tensor starts, torch::Tensor locations, "
    "torch::Tensor weights, torch::Tensor tiles, torch::Tensor out, int64_t max_pixels, int64_t max_width, "
    "bool overlap);"
)


def encoder_tiles(levels: list[tuple[int, int]], tile_shapes: list[tuple[int, int]]) -> torch.Tensor:
    """(tiles, 64) int32 query indices, -1 padded: each query level's pixels in blocks of its tile shape."""
    rows, start = [], 0
    for lq, (h, w) in enumerate(levels):
        th, tw = tile_shapes[min(lq, len(tile_shapes) - 1)]
        if th * tw > TILE_QUERIES:
            raise ValueError(f"tile {th}x{tw} holds more than {TILE_QUERIES} queries")
        for y0 in range(0, h, th):
            for x0 in range(0, w, tw):
                ids = [start + y * w + x for y in range(y0, min(h, y0 + th)) for x in range(x0, min(w, x0 + tw))]
                rows.append(ids + [-1] * (TILE_QUERIES - len(ids)))
        start += h * w
    return torch.tensor(rows, dtype=torch.int32)


# The kernel's lane formulas, mirrored for the CPU tests (tests/tools/test_window_mma_forward_probe.py):
# ldmatrix lane i gives the row of corner (i & 3) of the pair's query i >> 4 at 16-byte chunk
# 2 ((i >> 2) & 1) + ((i >> 3) & 1); a window row's chunk j is stored at j ^ (y & 1).
def ldmatrix_row(lane: int, pixel: int, y: int, width: int) -> tuple[int, int, int]:
    """(point of the pair, chunk, byte offset in the window) of the row `lane` reads, for a point whose
    top-left corner is window pixel `pixel` on level row `y`."""
    dx, dy = lane & 1, (lane >> 1) & 1
    chunk = 2 * ((lane >> 2) & 1) + ((lane >> 3) & 1)
    offset = (pixel + dy * width + dx) * 64 + ((chunk ^ ((y + dy) & 1)) << 4)
    return lane >> 4, chunk, offset


def b_fragment(lane: int, hi: list, lo: list) -> tuple[tuple, tuple]:
    """(b0, b1) of `lane`: hi[p] / lo[p] are the pair's query p's four corner weights (TL TR BL BR)."""
    g, t = lane >> 2, lane & 3
    weights = (lo if g & 1 else hi)[lane >> 4]
    pair = (weights[2 * (t & 1)], weights[2 * (t & 1) + 1])
    live = ((g >> 1) & 1) == (t >> 1)
    zero = (0.0, 0.0)
    return (pair if live and g < 4 else zero), (pair if live and g >= 4 else zero)


def emulate_step(rows, hi, lo):
    """One step's output as the kernel leaves it (hi + lo of D): rows[p][corner] are the pair's 32-channel
    corner rows. ldmatrix.trans and the m16n8k16 fragments follow the PTX ISA's layouts."""
    stored = [[None] * 8 for _ in range(4)]
    for lane in range(32):
        point, chunk, _ = ldmatrix_row(lane, 0, 0, 2)
        stored[lane >> 3][lane & 7] = rows[point][lane & 3][8 * chunk:8 * chunk + 8]
    a = [[0.0] * 16 for _ in range(16)]
    b = [[0.0] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):  # register j of .trans: stored rows 2t, 2t + 1 at column g
            for e in range(2):
                a[g + 8 * (j & 1)][2 * t + 8 * (j >> 1) + e] = stored[j][2 * t + e][g]
        b0, b1 = b_fragment(lane, hi, lo)
        for e in range(2):
            b[2 * t + e][g], b[2 * t + 8 + e][g] = b0[e], b1[e]
    d = [[sum(a[m][k] * b[k][n] for k in range(16)) for n in range(8)] for m in range(16)]
    out = [[0.0] * 32 for _ in range(2)]
    for lane in range(32):  # d0 d1 / d2 d3: query t >> 1, channel 16 (t & 1) + g / + 8, hi and lo
        g, t = lane >> 2, lane & 3
        c = 16 * (t & 1) + g
        out[t >> 1][c] = d[g][2 * t] + d[g][2 * t + 1]
        out[t >> 1][c + 8] = d[g + 8][2 * t] + d[g + 8][2 * t + 1]
    return out


def rotated_sets_and_outputs(shape, dtype: torch.dtype, device: torch.device):
    """The timed input sets (rotated, local sampling) and an output tensor for each."""
    sets = benchmark_op.rotated_input_sets(shape, dtype, "local", device)
    outs = [torch.empty(s[3].shape[0], s[3].shape[1], shape.heads * shape.channels, device=device, dtype=dtype)
            for s in sets]
    return sets, outs


def accuracy_set(shape, dtype: torch.dtype, device: torch.device, queries: int):
    """(a fresh input set, `queries` queries of every level picked from it, their float64 result, `tma_ws`'s):
    what a probe's output is checked against."""
    import mmdeform_tma

    check = benchmark_op.make_inputs(shape, dtype, "local", device, 1234)
    pick = torch.randperm(shape.num_queries, generator=torch.Generator().manual_seed(0))[:queries].to(device)
    value, shapes_t, _, loc, attn = check
    exact = ms_deform_attn_reference(value.double(), shapes_t, loc[:, pick].double(), attn[:, pick].double())
    ours = mmdeform_tma.multi_scale_deformable_attn(*check, backend="tma_ws")[:, pick]
    return check, pick, exact, ours


def time_and_compare(row: dict, probe_calls: dict, backends: list, sets, device, warmup: int, iters: int) -> dict:
    """Times each probe's calls and each backend bound to `sets` (same rotated inputs, same process) into
    row["<name>_ms"] and ["<name>_p90_ms"], each backend's time over the fastest probe's and the timing mode;
    prints the row as a JSON line and returns it."""
    mode = ""
    for name, calls in list(probe_calls.items()) + [(b, None) for b in backends]:
        if calls is None:
            bound = [benchmark_op.bind(name, s) for s in sets]
            calls = [lambda b=b: b.run(*b.leaves) for b in bound]
        with torch.no_grad():
            samples, mode = bench_common.time_calls(device, calls, warmup, iters)
        stats = bench_common.summarize(samples)
        row[f"{name}_ms"] = stats["median_ms"]
        row[f"{name}_p90_ms"] = stats["p90_ms"]
    best = min(row[f"{name}_ms"] for name in probe_calls)
    for name in backends:
        row[f"{name}_over_best_probe"] = row[f"{name}_ms"] / best
    row["timing"] = mode
    print(json.dumps(row), flush=True)
    return row


def parse_shapes(text: list[str]) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=["detr_enc_bs2"])
    p.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    p.add_argument("--tile-shapes", nargs="*", default=["8x8", "4x8", "2x4", "1x2"],
                   help="HxW query block of each query level (the last repeats)")
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--max-pixels", type=int, default=None,
                   help="a window's cap in value rows of 64 bytes (default: the schedule's, see SCHEDULES)")
    p.add_argument("--max-width", type=int, default=48)
    p.add_argument("--compare", nargs="*", default=[], choices=["dcnv4"])
    p.add_argument("--backends", nargs="*", default=["tma_ws", "cuda"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--accuracy-queries", type=int, default=4096)
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("window_mma_forward_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load_inline

    module = load_inline("window_mma_forward_probe", SIGNATURE, cuda_sources=SOURCE.read_text(), functions=["run"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                         extra_include_paths=[str(HOPPER_SOURCES), str(SOURCE.parent)])  # + window_probe_common.cuh
    device = torch.device("cuda")
    tile_shapes = parse_shapes(args.tile_shapes)
    rows = []
    for preset in args.presets:
        shape = benchmark_op.PRESETS[preset]
        if shape.queries is not None or shape.channels != 32:
            raise SystemExit(f"{preset}: the probe takes encoder presets of 32 channels")
        tiles = encoder_tiles(list(shape.levels), tile_shapes).to(device)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            sets, outs = rotated_sets_and_outputs(shape, dtype, device)

            check, pick, exact, ours = accuracy_set(shape, dtype, device, args.accuracy_queries)
            row = {
                "preset": preset, "dtype": dtype_name, "tiles": int(tiles.shape[0]),
                "rel_err_tma_ws": benchmark_op.rel_l2(ours, exact),
                "rounding_err": benchmark_op.rel_l2(exact.to(dtype), exact),
            }
            probe_calls = {}
            for schedule in args.schedules:
                name, overlap = f"probe_{schedule}", schedule == "overlap"
                cap = args.max_pixels or SCHEDULES[schedule]
                check_out = torch.empty_like(outs[0])
                module.run(*check, tiles, check_out, cap, args.max_width, overlap)
                row[f"rel_err_{name}"] = benchmark_op.rel_l2(check_out[:, pick], exact)
                probe_calls[name] = [lambda i=i, c=cap, o=overlap: module.run(*sets[i], tiles, outs[i], c,
                                                                              args.max_width, o)
                                     for i in range(len(sets))]
            rows.append(time_and_compare(row, probe_calls, list(args.backends) + list(args.compare), sets, device,
                                         args.warmup, args.iters))
    if args.out:
        bench_common.write_json(args.out, {"environment": bench_common.environment(device), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
