"""Does a warp's gather of 64-byte value rows through L1 cost a wavefront per cache line, or per
pass over the 32 banks its bytes fall in? The windowless forward's corner gathers are its wall
(perf_notes.md items 96 and 134): 8 teams of 4 lanes a warp each load a 64-byte row of one head, and
with mmcv's value layout (keys x heads x channels) every row of a head starts at the same offset in
its 128-byte line, so all 8 rows use the same 16 of L1's 32 banks.

    python tools/l1_gather_banks.py                       # times every layout (bench_common.time_calls)
    ncu --kernel-name gather_rows --metrics l1tex__data_pipe_lsu_wavefronts.sum,\\
        l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,gpu__time_duration.sum \\
        python tools/l1_gather_banks.py --iters 1 --warmup 0

(ncu lists the launches in the order of --layouts, six a layout at --iters 1 on the H100 (session 55):
bench_common's warm-up calls and graph replays, the same kernel on the same inputs.)

Each layout gathers the same points: the bs 2 fp16 encoder's level 0 (100 x 152 keys, 8 heads,
32 channels, 16 points a query around its pixel, N(0, 2 px)). A team of 4 lanes loads 16 bytes of
each of its points' 4 corner rows and writes their sum once (so the rows through L1 are the
traffic, 1.3 GB, against about 50 MB of DRAM); the team order and the layout's strides are set
here (torch), so the kernel is the same for every layout:

- `one_head_per_warp`: mmcv's layout, a warp's 8 teams on 8 consecutive queries of one head (the
  forward's teams today);
- `two_heads_per_warp`: the same value, a warp's teams on 4 queries of two heads of opposite
  bank halves, alternating team by team (so also within each quarter warp's load phase);
- `padded_key_stride`: 576-byte keys, so consecutive keys' rows alternate bank halves;
- `head_major`: value transposed to heads x keys x channels.

If L1 wavefronts follow banks, the last three take about half the first one's wavefronts for the
rows; if they follow cache lines, all four take the same. Session 55 (H100): two heads a warp took
26 % fewer wavefronts and 6 % less time (docs/measurements/head_pairs_s55.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

ROW_BYTES = 64  # 32 fp16 channels
LINE_BYTES = 128
TEAMS_PER_WARP = 8
LAYOUTS = ("one_head_per_warp", "two_heads_per_warp", "padded_key_stride", "head_major")

KERNEL = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cstdint>
#include <cuda_fp16.h>
// Team t (4 lanes) sums 16 bytes of each of its points' 4 corner rows, then writes its 64-byte row
// once, as the forward's teams do over a query's points. packed[p x teams + t]: the point's
// top-left key (24 bits) and head (8 bits); a row's bytes are key x key_bytes + head x head_bytes.
__global__ void gather_rows(const char* __restrict__ value, const int32_t* __restrict__ packed,
                            uint4* __restrict__ out, int64_t teams, int points, int width, int64_t key_bytes,
                            int64_t head_bytes) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 4;
  const int lane = threadIdx.x & 3;
  if (t >= teams) return;
  float acc[8] = {};
  for (int p = 0; p < points; ++p) {
    const int32_t word = __ldg(packed + p * teams + t);
    const int64_t key = word & 0xFFFFFF;
    const char* row = value + (word >> 24) * head_bytes + 16 * lane;
    const int64_t keys[4] = {key, key + 1, key + width, key + width + 1};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint4 r = __ldg(reinterpret_cast<const uint4*>(row + keys[k] * key_bytes));
      const __half2* v = reinterpret_cast<const __half2*>(&r);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(v[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
      }
    }
  }
  uint4 o;
  __half2* h = reinterpret_cast<__half2*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(acc[2 * i], acc[2 * i + 1]);
  out[4 * t + lane] = o;
}

void run(torch::Tensor value, torch::Tensor packed, torch::Tensor out, int64_t width, int64_t key_bytes,
         int64_t head_bytes) {
  const int64_t points = packed.size(0), teams = packed.size(1);
  const int threads = 256;
  // the current stream, which a graph capture records (the legacy stream escaped it: session 55)
  gather_rows<<<static_cast<unsigned>((teams * 4 + threads - 1) / threads), threads, 0,
                at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const char*>(value.data_ptr()), packed.data_ptr<int32_t>(), reinterpret_cast<uint4*>(out.data_ptr()),
      teams, static_cast<int>(points), static_cast<int>(width), key_bytes, head_bytes);
}
"""
SIGNATURE = ("void run(torch::Tensor value, torch::Tensor packed, torch::Tensor out, int64_t width, int64_t key_bytes, "
             "int64_t head_bytes);")


def corner_keys(height: int, width: int, heads: int, points: int, batch: int, seed: int, device) -> torch.Tensor:
    """Key of each point's top-left corner, [batch, queries, heads, points] (queries = the level's
    pixels in raster order, each sampling around its own centre), clamped so all 4 corners exist."""
    g = torch.Generator(device=device).manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    centre = torch.stack([xs.flatten() + 0.5, ys.flatten() + 0.5], -1).float()
    q = height * width
    loc = centre.view(1, q, 1, 1, 2) + 2.0 * torch.randn(batch, q, heads, points, 2, device=device, generator=g)
    x0 = (loc[..., 0] - 0.5).floor().clamp(0, width - 2).long()
    y0 = (loc[..., 1] - 0.5).floor().clamp(0, height - 2).long()
    return y0 * width + x0


def strides(layout: str, keys: int, heads: int) -> tuple[int, int]:
    """(key_bytes, head_bytes): a row's byte offset is key x key_bytes + head x head_bytes."""
    if layout == "head_major":
        return ROW_BYTES, keys * ROW_BYTES
    return heads * ROW_BYTES + (ROW_BYTES if layout == "padded_key_stride" else 0), ROW_BYTES


def row_offset(layout: str, key: torch.Tensor, head: torch.Tensor, keys: int, heads: int) -> torch.Tensor:
    """Byte offset of (key, head)'s row in the layout's value."""
    key_bytes, head_bytes = strides(layout, keys, heads)
    return key * key_bytes + head * head_bytes


def value_bytes(layout: str, keys: int, heads: int) -> int:
    key_bytes, head_bytes = strides(layout, keys, heads)
    return (keys - 1) * key_bytes + (heads - 1) * head_bytes + ROW_BYTES


def team_points(layout: str, key0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, heads), each [points, teams]: team t's point p in the order the warps take the teams.
    A team is one (batch, query, head); consecutive teams are consecutive queries of one head, or
    for two_heads_per_warp 4 queries of heads (2j, 2j + 1), the heads alternating team by team:
    every quarter warp (two teams, one 128-bit load phase) then reads one row of each bank half,
    as does the warp."""
    batch, queries, heads, points = key0.shape
    head = torch.arange(heads, device=key0.device).view(1, 1, heads, 1).expand_as(key0)
    if layout != "two_heads_per_warp":
        order = lambda x: x.permute(3, 0, 2, 1).reshape(points, -1)  # noqa: E731  p; b, h, q
    else:
        half = TEAMS_PER_WARP // 2
        if queries % half or heads % 2:
            raise ValueError(f"two_heads_per_warp takes queries in fours and heads in pairs, not {queries} and {heads}")
        # b, query group, query, head pair, head in the pair, p -> p; b, pair, group, query, head in the pair
        order = lambda x: x.reshape(batch, -1, half, heads // 2, 2, points).permute(5, 0, 3, 1, 2, 4).reshape(points, -1)  # noqa: E731
    return order(key0).contiguous(), order(head).contiguous()


def pack(keys: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """The kernel's words: key in the low 24 bits, head above."""
    if int(keys.max()) >= 1 << 24 or int(heads.max()) >= 1 << 7:
        raise ValueError("keys below 2^24 and heads below 128")
    return (keys | (heads << 24)).to(torch.int32).contiguous()


def bank_halves(offsets: torch.Tensor) -> torch.Tensor:
    """Which half of the 32 banks (0 or 1) each row starts in."""
    return (offsets % LINE_BYTES) // ROW_BYTES


def warps_in_both_halves(offsets: torch.Tensor) -> float:
    """Of a layout's warp-wide row loads ([points, teams] row offsets, 8 teams a warp), the share
    whose rows start in both halves of the banks."""
    halves = bank_halves(offsets).view(offsets.shape[0], -1, TEAMS_PER_WARP)
    return float((halves.amin(-1) != halves.amax(-1)).float().mean())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="*", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("l1_gather_banks needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.utils.cpp_extension import load_inline

    module = load_inline("l1_gather_banks", SIGNATURE, cuda_sources=KERNEL, functions=["run"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    device = torch.device("cuda")
    height, width, heads, points = 100, 152, 8, 16
    keys = height * width
    key0 = corner_keys(height, width, heads, points, args.batch, 0, device)
    print(f"{torch.cuda.get_device_name(device)}; {key0.numel()} points of 4 corner rows")
    for layout in args.layouts:
        keys_at, heads_at = team_points(layout, key0)
        packed = pack(keys_at, heads_at)
        key_bytes, head_bytes = strides(layout, keys, heads)
        both = warps_in_both_halves(row_offset(layout, keys_at, heads_at, keys, heads))
        value = torch.randn(value_bytes(layout, keys, heads) // 2, device=device).half()
        out = torch.empty(packed.shape[1] * ROW_BYTES, dtype=torch.uint8, device=device)

        def call(v=value, w=packed, o=out, kb=key_bytes, hb=head_bytes):
            module.run(v, w, o, width, kb, hb)

        samples, mode = bench_common.time_calls(device, [call], args.warmup, args.iters)
        if samples:
            summary = bench_common.summarize([ms * 1000.0 for ms in samples], unit="us")
            print(f"{layout:20} median {summary['median_us']:8.1f} us   p90 {summary['p90_us']:8.1f} us   "
                  f"warp loads in both bank halves {100 * both:5.1f} %   ({mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
