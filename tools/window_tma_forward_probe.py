"""Prices the window forward with TMA copies and region tiles (docs/perf_notes.md, item 142): a design probe,
not a backend (`window_tma_forward_probe.cu`).

Item 141 showed that the tensor-core sum from shared-memory windows is exact and reads 2 wavefronts a point,
but lost to three costs: the windows' copies (cp.async, 4.3 instructions a point), their poor reuse (tiles of
2-64 queries), and the records (5.5 instructions a point). This probe removes each:

- a CTA takes a region of the finest level (8 x 16 pixels by default) and every query, of any level, whose
  reference point lies in it (about 170 queries), so each level's window serves all of them;
- the windows are placed on the host from the reference points (an encoder's queries are its pixels) with a
  margin for the sampling offsets, and copied by TMA, one box a window row; points outside their window are
  summed from global memory;
- each lane turns its own query's points into records in its warp's shared memory (no CTA barrier), and a
  warp reads four steps' records in two 16-byte loads.

    python tools/window_tma_forward_probe.py                        # bs 2 encoder, fp16 and bf16
    python tools/window_tma_forward_probe.py --presets detr_enc_bs8 detr_enc_bs6_p8 --compare dcnv4

Each row: the probe's error against float64 (queries of every level) beside the rounding error of the exact
result, the share of points summed outside their windows, and median / p90 ms of the probe, `tma_ws` and
`cuda` (and DCNv4 with --compare) on the same rotated input sets, in the same run. `--swizzle-check` first
copies one window row to a shared address that is a multiple of 128 but not of 512 and reports whether the
TMA's 64-byte swizzle follows the shared address (the probe's model) or the box's start.

Measured on the H100 (items 142-143): the swizzle follows the shared address; the lean version is exact
(1.0001x the rounding error) and the fastest forward on every encoder row, 1.22-1.57x DCNv4 and 8-27 % under
`tma_ws`, with the L1 at 79 % of its rate (3.46 shared wavefronts a point: `ldmatrix` 2, the records' loads 1).
The package's `tma_ws` config `rg_r8x16` (mmdeform_tma/csrc/hopper/region_forward.cu, item 145) is the
shuffle version with its plan computed on the device; this probe keeps the record version beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import benchmark_op  # noqa: E402
from window_mma_forward_probe import accuracy_set, rotated_sets_and_outputs, time_and_compare  # noqa: E402

ROW_BYTES = 64  # a head's 32 channels of 2 bytes
SLOT_STRIDE = 34  # window_tma_forward_probe.cu: kSlotStride
WARP_RECORD_BYTES = 2 * (31 + 3 * SLOT_STRIDE + 1) * 16
SHARED_LIMIT = 227 * 1024
VERSIONS = {"barrier": 0, "lean": 1, "shuffle": 2}  # the kernel's `version`
WARPS = 6  # the kernel's warps a CTA (32 queries each)
SOURCE = Path(__file__).with_suffix(".cu")
HOPPER_SOURCES = Path(__file__).resolve().parents[1] / "mmdeform_tma" / "csrc" / "hopper"
SIGNATURES = (
    "void run(torch::Tensor value, torch::Tensor locations, torch::Tensor weights, torch::Tensor tiles, "
    "torch::Tensor windows, std::vector<int64_t> geometry, std::vector<int64_t> buffer_bytes, torch::Tensor out, "
    "bool box_swizzle, int64_t version);"
    "torch::Tensor swizzle_check(torch::Tensor value, int64_t box_width, int64_t offset);"
)


def reference_points(levels: list[tuple[int, int]]) -> torch.Tensor:
    """(num_queries, 2) float64: each encoder query's reference point (x, y) in [0, 1], the centre of its pixel."""
    refs = []
    for h, w in levels:
        ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                                indexing="ij")
        refs.append(torch.stack([(xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h], -1))
    return torch.cat(refs)


def round_to_conflict_free(width: int) -> int:
    """The least window width >= width that is 2 mod 4: with SWIZZLE_64B every ldmatrix phase then reads
    eight distinct bank groups (tests/tools/test_window_tma_forward_probe.py)."""
    return width + (2 - width) % 4


def region_tiles(levels: list[tuple[int, int]], region: tuple[int, int], warps: int, margin: int) -> dict:
    """The CTAs' queries and windows.

    Each query goes to the region of the finest level that holds its reference point; a region's queries fill
    CTAs of `warps` x 32 (-1 padded). A CTA's level-l window spans its queries' reference points in level-l
    pixels, widened by `margin` pixels each side (and one for the bilinear corner): origin (x, y) and rows per
    CTA; the width is one per level (the TMA box), the largest any CTA needs, made 2 mod 4."""
    refs = reference_points(levels)
    h0, w0 = levels[0]
    ry, rx = region
    columns = math.ceil(w0 / rx)
    cell_y = (refs[:, 1] * h0 // ry).clamp(max=math.ceil(h0 / ry) - 1)
    cell_x = (refs[:, 0] * w0 // rx).clamp(max=columns - 1)
    cell = (cell_y * columns + cell_x).long()
    order = torch.argsort(cell * refs.shape[0] + torch.arange(refs.shape[0]))  # by region, then query id
    capacity = warps * 32
    tiles, origins, needs = [], [], []
    for r in torch.unique(cell).tolist():
        ids = order[cell[order] == r]
        for first in range(0, ids.numel(), capacity):
            chunk = ids[first:first + capacity]
            tiles.append(chunk.tolist() + [-1] * (capacity - chunk.numel()))
            rows = []
            for h, w in levels:
                x = refs[chunk, 0] * w - 0.5
                y = refs[chunk, 1] * h - 0.5
                slack = margin + 1e-3  # a point at exactly the margin stays inside after rounding
                ox, oy = math.floor(float(x.min()) - slack), math.floor(float(y.min()) - slack)
                right, bottom = math.floor(float(x.max()) + slack) + 1, math.floor(float(y.max()) + slack) + 1
                rows.append((ox, oy, bottom - oy + 1, right - ox + 1))
            origins.append(rows)
            needs.append([row[3] for row in rows])
    box_widths = [round_to_conflict_free(max(n[l] for n in needs)) for l in range(len(levels))]
    windows = torch.tensor([[row[:3] for row in rows] for rows in origins], dtype=torch.int32)
    return {"tiles": torch.tensor(tiles, dtype=torch.int32), "windows": windows, "box_widths": box_widths,
            "rows": [int(windows[:, l, 2].max()) for l in range(len(levels))]}


def launch_geometry(levels: list[tuple[int, int]], plan: dict, warps: int) -> tuple[list[int], list[int], int]:
    """(geometry: per level height, width, first key, box width, row pitch; the two window buffers' bytes,
    even and odd levels; the CTA's dynamic shared memory)."""
    geometry, start = [], 0
    for (h, w), bw in zip(levels, plan["box_widths"]):
        geometry += [h, w, start, bw, bw * ROW_BYTES]
        start += h * w
    sizes = [bw * ROW_BYTES * rows for bw, rows in zip(plan["box_widths"], plan["rows"])]
    buffers = [max(sizes[parity::2], default=0) for parity in (0, 1)]
    buffers = [-(-b // 1024) * 1024 for b in buffers]  # the second buffer 1024-byte aligned
    return geometry, buffers, sum(buffers) + warps * WARP_RECORD_BYTES


def outside_share(levels, plan: dict, locations: torch.Tensor) -> float:
    """The share of in-level points whose corners leave their CTA's window (summed from global memory)."""
    tiles, windows = plan["tiles"].to(locations.device), plan["windows"].to(locations.device)
    cta_of = torch.full((locations.shape[1],), -1, dtype=torch.long, device=locations.device)
    slots = tiles >= 0
    cta_of[tiles[slots].long()] = torch.arange(tiles.shape[0], device=tiles.device).repeat_interleave(
        slots.sum(1))
    outside = total = 0
    for l, (h, w) in enumerate(levels):
        x = locations[..., l, :, 0] * w - 0.5
        y = locations[..., l, :, 1] * h - 0.5
        valid = (x > -1) & (y > -1) & (x < w) & (y < h)
        win = windows[cta_of, l].view(1, -1, 1, 1, 3)
        xr, yr = torch.floor(x) - win[..., 0], torch.floor(y) - win[..., 1]
        inside = (xr >= 0) & (yr >= 0) & (xr + 1 < plan["box_widths"][l]) & (yr + 1 < win[..., 2])
        outside += int((valid & ~inside).sum())
        total += int(valid.sum())
    return outside / max(total, 1)


def swizzle_models(box_width: int, offset: int) -> dict:
    """Where each 16-byte chunk of a box of `box_width` 64-byte rows copied to shared byte `offset` lands, as
    (row, chunk) per 16-byte unit of shared memory [0, offset + box), under the two models."""
    models = {}
    for name in ("address", "box"):
        units = {}
        for row in range(box_width):
            for chunk in range(4):
                logical = row * ROW_BYTES + chunk * 16
                base = offset + logical if name == "address" else logical
                placed = base ^ (((base >> 7) & 3) << 4)
                units[(placed if name == "address" else offset + placed) // 16] = (row, chunk)
        models[name] = units
    return models


def check_swizzle(module, device, box_width: int = 30, offset: int = 128) -> str:
    """Copies rows whose elements say (row, chunk) and names the model the shared bytes follow."""
    keys = box_width
    rows = torch.arange(keys, dtype=torch.float32).view(keys, 1, 1).expand(keys, 1, 32)
    chunks = (torch.arange(32) // 8).view(1, 1, 32).float()
    value = (rows * 4 + chunks).to(torch.float16).view(1, keys, 1, 32).contiguous().to(device)  # exact in fp16
    raw = module.swizzle_check(value, box_width, offset).cpu()
    halves = raw.view(torch.int16).view(torch.float16).float().view(-1, 8)  # 16-byte units
    found = {}
    for unit in range(offset // 16, halves.shape[0]):
        tag = int(halves[unit, 0])
        found[unit] = (tag // 4, tag % 4)
    for name, units in swizzle_models(box_width, offset).items():
        if all(found.get(u) == rc for u, rc in units.items()):
            return name
    return "neither"


def parse_shape(text: str) -> tuple[int, int]:
    h, w = (int(v) for v in text.split("x"))
    return h, w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", default=["detr_enc_bs2"])
    p.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    p.add_argument("--region", type=parse_shape, default=(8, 16), help="HxW pixels of the finest level")
    p.add_argument("--versions", nargs="+", default=["lean"], choices=list(VERSIONS),
                   help="lean: pairs in branch-free blocks of four, no CTA barrier between levels; shuffle: lean, "
                        "the corner addresses formed from the owning lane's word by shfl; barrier: the first "
                        "version (a barrier a level, a branch a pair; 4 points only)")
    p.add_argument("--margin", type=int, default=6, help="window margin, pixels each side of the references")
    p.add_argument("--compare", nargs="*", default=[], choices=["dcnv4"])
    p.add_argument("--backends", nargs="*", default=["tma_ws", "cuda"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--accuracy-queries", type=int, default=4096)
    p.add_argument("--swizzle-check", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("window_tma_forward_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load_inline

    module = load_inline("window_tma_forward_probe", SIGNATURES, cuda_sources=SOURCE.read_text(),
                         functions=["run", "swizzle_check"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                         extra_include_paths=[str(HOPPER_SOURCES), str(HOPPER_SOURCES.parent), str(SOURCE.parent)])
    device = torch.device("cuda")
    report = {"swizzle_model": check_swizzle(module, device)} if args.swizzle_check else {}
    if report:
        print(json.dumps(report), flush=True)
    box_swizzle = report.get("swizzle_model") == "box"  # the records follow what the check found
    rows = []
    for preset in args.presets:
        shape = benchmark_op.PRESETS[preset]
        if shape.queries is not None or shape.channels != 32:
            raise SystemExit(f"{preset}: the probe takes encoder presets of 32 channels")
        levels = [tuple(lv) for lv in shape.levels]
        plan = region_tiles(levels, args.region, WARPS, args.margin)
        geometry, buffers, shared = launch_geometry(levels, plan, WARPS)
        if shared > SHARED_LIMIT:
            raise SystemExit(f"{preset}: {shared} bytes of shared memory a CTA")
        tiles, windows = plan["tiles"].to(device), plan["windows"].to(device)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            sets, outs = rotated_sets_and_outputs(shape, dtype, device)
            check, pick, exact, ours = accuracy_set(shape, dtype, device, args.accuracy_queries)
            value, _, _, loc, attn = check
            row = {
                "preset": preset, "dtype": dtype_name, "ctas": int(tiles.shape[0]), "region": list(args.region),
                "box_swizzle": box_swizzle, "warps": WARPS, "margin": args.margin, "box_widths": plan["box_widths"],
                "rows": plan["rows"], "shared_bytes": shared, "outside_share": outside_share(levels, plan, loc),
                "rel_err_tma_ws": benchmark_op.rel_l2(ours, exact),
                "rounding_err": benchmark_op.rel_l2(exact.to(dtype), exact),
            }
            probe_calls = {}
            for version_name in args.versions:
                name, version = f"probe_{version_name}", VERSIONS[version_name]
                check_out = torch.full_like(outs[0], float("nan"))
                module.run(value, loc, attn, tiles, windows, geometry, buffers, check_out, box_swizzle, version)
                row[f"rel_err_{name}"] = benchmark_op.rel_l2(check_out[:, pick], exact)
                row[f"nonfinite_{name}"] = int((~torch.isfinite(check_out)).sum())  # every output row written
                probe_calls[name] = [lambda i=i, v=version: module.run(sets[i][0], sets[i][3], sets[i][4], tiles,
                                                                       windows, geometry, buffers, outs[i],
                                                                       box_swizzle, v)
                                     for i in range(len(sets))]
            rows.append(time_and_compare(row, probe_calls, list(args.backends) + list(args.compare), sets, device,
                                         args.warmup, args.iters))
    if args.out:
        bench_common.write_json(args.out, {"environment": bench_common.environment(device), "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, **report, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
