"""Digests of every compiled kernel variant's outputs on fixed inputs, to show that a kernel change
which claims to keep results bit for bit does so:

    python tools/output_digests.py --out before.json              # with the old build
    python tools/output_digests.py --compare before.json          # with the new one; exit 1 on a difference

Each backend's forward configs run the forward op, and its backward configs run the deterministic
backward (fixed-point sums, bitwise repeatable); the fast backward's float atomics are not, so it
is left out. Inputs: a Deformable DETR encoder problem (one query per pixel), a decoder-like one
(queries at random reference points) and a uniformly sampled one, in fp16, bf16 and fp32, with
points outside the levels. Entries are keyed by config name, not index, so a build that adds or
drops variants is compared on the ones both have and the rest are listed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from msda_cases import make_problem  # noqa: E402

from mmdeform_tma import library  # noqa: E402
from mmdeform_tma._extension import kernel_configs  # noqa: E402

LEVELS = [(9, 13), (5, 7), (3, 4)]
CASES = {"encoder": sum(h * w for h, w in LEVELS), "local": 40, "uniform": 40}  # locality -> queries
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def configs(backend: str, direction: str) -> list[tuple[str, int]]:
    """(name, index) of each compiled variant; the kernel's own choice (-1) where none is listed."""
    return list((name, i) for i, name in enumerate(kernel_configs(backend, direction))) or [("default", -1)]


def digests(backends: list[str], device: torch.device) -> dict[str, str]:
    ops = torch.ops.mmdeform_tma
    out: dict[str, str] = {}
    for locality, queries in CASES.items():
        for dtype_name, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(7)
            problem = make_problem(LEVELS, batch=2, queries=queries, heads=2, channels=32, points=4, dtype=dtype,
                                   generator=g, locality=locality)
            args = problem.to(device=device, dtype=dtype, coord_dtype=problem.sampling_locations.dtype).args()
            grad = torch.randn(2, queries, 64, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            for backend in backends:
                for name, index in configs(backend, "forward"):
                    out[f"{backend}/forward/{name}/{locality}/{dtype_name}"] = digest(
                        ops.ms_deform_attn_forward(*args, backend, index))
                for name, index in configs(backend, "backward"):
                    out[f"{backend}/backward-deterministic/{name}/{locality}/{dtype_name}"] = digest(
                        *ops.ms_deform_attn_backward(grad, *args, backend, index, True))
    return out


def compare(current: dict[str, str], base: dict[str, str]) -> list[str]:
    """Lines describing each difference; empty when every shared entry is equal."""
    lines = [f"differs: {key}" for key in sorted(current.keys() & base.keys()) if current[key] != base[key]]
    lines += [f"only in the base: {key}" for key in sorted(base.keys() - current.keys())]
    lines += [f"only in this build: {key}" for key in sorted(current.keys() - base.keys())]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="*", default=["cuda", "tma_ws"])
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu (the pytorch backend only)")
    p.add_argument("--out", type=Path, help="write the digests here (JSON)")
    p.add_argument("--compare", type=Path, help="a file written by --out with another build")
    args = p.parse_args(argv)
    if not library.OPS_LOADED:
        raise SystemExit("mmdeform_tma._C is not built: there are no kernels to digest")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    current = digests(args.backends, device)
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "digests": current}, indent=1, sort_keys=True) + "\n")
    print(f"{len(current)} digests")
    if args.compare:
        base = json.loads(args.compare.read_text())["digests"]
        shared = len(current.keys() & base.keys())
        lines = compare(current, base)
        print("\n".join(lines + [f"{shared} shared entries"]))
        return 1 if shared == 0 or any(line.startswith("differs") for line in lines) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
