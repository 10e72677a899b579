"""Profile the MSDA kernels with Nsight Compute and summarise what limits them.

    python tools/profile_ncu.py --preset detr_enc_bs2 --dtype float16
    python tools/profile_ncu.py --backends tma_ws --backward-configs c4_t32_s2_w16 c4_t32_s2_w16_g
    python tools/profile_ncu.py --backends tma_ws --forward-configs c4_t64_s3_l1 c4_t32_s2_w16
    python tools/profile_ncu.py --dtype float32 --backends tma_ws --locality uniform

Runs ncu (--clock-control none: the card's clocks stay as they are) on one forward and one
backward of every available compiled backend and of mmcv (or of the `--backends` named; `dcnv4`
is DCNv4's FlashDeformAttn, a benchmark dependency: tools/dcnv4_compare.py), and prints per kernel: duration, DRAM
throughput, L2 and L1 hit rates, L2 throughput, achieved occupancy and the top warp stall reasons.
`--backward-configs` (`--forward-configs`) profiles named kernel configs of one backend's backward
(forward) instead (the names `tools/autotune.py` reports), each with its own launch, to set two
variants side by side; `--forward-only` leaves the backwards out. `--locality uniform` samples
uniformly over each level instead of around the reference points (benchmark_op.make_inputs), where
no accumulation window pays.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "l1tex__t_sector_hit_rate.pct": "L1 hit %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 thru %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1 thru %",
    "l1tex__data_pipe_lsu_wavefronts.sum": "L1 wavefronts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "of which shared",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global load requests",
    "sm__inst_executed.sum": "warp instructions",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "sm__inst_executed.avg.per_cycle_active": "IPC",
}
STALLS = [
    "long_scoreboard", "short_scoreboard", "mio_throttle", "lg_throttle", "barrier", "membar", "wait",
    "math_pipe_throttle", "not_selected", "no_instruction", "drain", "dispatch_stall", "tex_throttle", "branch_resolving",
    "sleeping", "misc",
]
STALL_METRICS = [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
KERNELS = "regex:forward_kernel|forward_lean_kernel|backward_kernel|spread_team_kernel|tma_kernel|tma_ws_kernel|ms_deformable"


def child(args) -> None:
    """The profiled process: one forward and one backward per backend, after a warm-up."""
    import mmdeform_tma
    from benchmark_op import DTYPES, PRESETS, make_inputs

    device = torch.device("cuda")
    value, shapes_t, starts, loc, attn = make_inputs(PRESETS[args.preset], DTYPES[args.dtype], args.locality, device, 0)
    if args.backward_configs or args.forward_configs:
        named_configs(args, value, shapes_t, starts, loc, attn)
        return
    for backend in args.backends:
        if backend == "dcnv4":  # a compared foreign kernel, in its own input convention
            import dcnv4_compare

            bound = dcnv4_compare.bind(dcnv4_compare.load(), (value, shapes_t, starts, loc, attn))
            leaves = [t.detach().requires_grad_() for t in bound.leaves]
            call = lambda: bound.run(*leaves)  # noqa: E731
        else:
            leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]
            call = lambda: mmdeform_tma.multi_scale_deformable_attn(  # noqa: E731
                leaves[0], shapes_t, starts, leaves[1], leaves[2], backend=backend
            )
        for _ in range(2):  # the second iteration is the one profiled (launch-skip below)
            out = call()
            if not args.forward_only:
                torch.autograd.grad(out, leaves, torch.randn_like(out))
        torch.cuda.synchronize()


def named_configs(args, value, shapes_t, starts, loc, attn) -> None:
    """Each named config of the one backend, forward or backward, run twice (the second is profiled)."""
    from mmdeform_tma import _extension

    (backend,) = args.backends
    direction = "backward" if args.backward_configs else "forward"
    wanted = args.backward_configs or args.forward_configs
    names = _extension.kernel_configs(backend, direction)
    missing = [c for c in wanted if c not in names]
    if missing:
        raise SystemExit(f"{backend} has no {direction} config {', '.join(missing)}; it has {', '.join(names)}")
    grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device=value.device, dtype=value.dtype)
    ops = torch.ops.mmdeform_tma
    for name in wanted:
        for _ in range(2):
            if direction == "backward":
                ops.ms_deform_attn_backward(grad, value, shapes_t, starts, loc, attn, backend, names.index(name), False)
            else:
                ops.ms_deform_attn_forward(value, shapes_t, starts, loc, attn, backend, names.index(name))
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="detr_enc_bs2")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--backends", nargs="*", default=None)
    p.add_argument("--backward-configs", nargs="*", default=None, help="named backward configs of one backend")
    p.add_argument("--forward-configs", nargs="*", default=None, help="named forward configs of one backend")
    p.add_argument("--forward-only", action="store_true", help="profile the forwards alone")
    p.add_argument("--locality", choices=["local", "uniform"], default="local", help="sampling locations (make_inputs)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("bench_results/ncu.csv"))
    args = p.parse_args(argv)
    if args.backends is None:
        import mmdeform_tma

        args.backends = [b for b in ("cuda", "tma_ws", "mmcv") if b in mmdeform_tma.available_backends("cuda")]
    if (args.backward_configs or args.forward_configs) and len(args.backends) != 1:
        p.error("--backward-configs / --forward-configs name configs of one backend: give exactly one in --backends")
    if args.backward_configs and args.forward_configs:
        p.error("--backward-configs and --forward-configs: one direction per run")
    if args.child:
        child(args)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu (Nsight Compute) is not on PATH", file=sys.stderr)
        return 2
    command = [
        ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", KERNELS,
        "--metrics", ",".join([*METRICS, *STALL_METRICS]), "--csv", "--page", "raw",
        sys.executable, __file__, "--child", "--preset", args.preset, "--dtype", args.dtype, "--locality", args.locality,
        "--backends", *args.backends,
        *(["--forward-only"] if args.forward_only else []),
        *(["--backward-configs", *args.backward_configs] if args.backward_configs else []),
        *(["--forward-configs", *args.forward_configs] if args.forward_configs else []),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    text = result.stdout[result.stdout.find('"ID"'):] if '"ID"' in result.stdout else ""
    if result.returncode != 0 or not text:
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    rows = list(csv.DictReader(io.StringIO(text)))[1:]  # the first row holds units
    seen = {}
    for row in rows:  # keep the last (warm) launch of each kernel name
        seen[row["Kernel Name"][:90]] = row
    named = args.backward_configs or args.forward_configs
    if named:  # configs of one kernel may share its name: every launch, in order
        seen = {f"#{i} {row['Kernel Name'][:80]}": row for i, row in enumerate(rows)}
        print(f"launch order: each of {', '.join(named)} twice, in that order")
    header = ["kernel", *METRICS.values(), "top stalls (cycles per issue)"]
    table = []
    for name, row in seen.items():
        values = [f"{float(row[m]):.1f}" if row.get(m, "").replace(".", "", 1).isdigit() else row.get(m, "-") for m in METRICS]
        stalls = sorted(((float(row[m]), s) for m, s in zip(STALL_METRICS, STALLS) if row.get(m)), reverse=True)[:3]
        table.append([name, *values, ", ".join(f"{s} {v:.1f}" for v, s in stalls)])
    import bench_common

    print(bench_common.console_table(header, table))
    print(f"\nraw metrics: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
