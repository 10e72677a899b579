"""Small forward + backward calls of every compiled backend, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tools/sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/sanitize_cases.py --backends tma tma_ws
    compute-sanitizer --tool synccheck python tools/sanitize_cases.py

Covers every dtype, the fast and the deterministic backward, partial tiles and points outside the
levels. Prints one line per case; any error the tool finds is reported by compute-sanitizer itself.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mmdeform_tma  # noqa: E402
from msda_cases import make_problem  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="*", default=["cuda", "tma", "tma_ws"])
    args = p.parse_args(argv)
    shapes = [(7, 9), (4, 5), (2, 3), (1, 1)]
    for backend in args.backends:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for deterministic in (False, True):
                g = torch.Generator().manual_seed(0)
                problem = make_problem(shapes, batch=2, queries=37, heads=3, channels=32, points=3, dtype=dtype, generator=g)
                problem = problem.to(device="cuda", dtype=dtype, coord_dtype=problem.sampling_locations.dtype).requires_grad_()
                torch.use_deterministic_algorithms(deterministic)
                out = mmdeform_tma.multi_scale_deformable_attn(*problem.args(), backend=backend)
                out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                print(f"{backend:7} {str(dtype):15} deterministic={deterministic}: ok")
    torch.use_deterministic_algorithms(False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
