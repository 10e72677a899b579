"""`python -m mmdeform_tma.info`: the build, the GPU, and whether each backend can run, and why not."""

from __future__ import annotations

import argparse
import platform

import torch

from . import __version__, _extension
from .backends import BACKENDS
from .dispatch import AUTO_PRIORITY
from .inputs import validate
from .integrations import mmcv as mmcv_integration


def probe_inputs(device: torch.device, dtype: torch.dtype, requires_grad: bool):
    """A Deformable-DETR-like problem (8 heads of 32 channels, 4 levels, 4 points), tiny."""
    shapes = torch.tensor([[8, 8], [4, 4], [2, 2], [1, 1]], dtype=torch.long)
    starts = torch.tensor([0, 64, 80, 84], dtype=torch.long)
    value = torch.zeros((1, 85, 8, 32), dtype=dtype, device=device, requires_grad=requires_grad)
    locations = torch.zeros((1, 2, 8, 4, 4, 2), dtype=torch.float32, device=device)
    weights = torch.zeros((1, 2, 8, 4, 4), dtype=torch.float32, device=device)
    return validate(value, shapes, starts, locations, weights)


def report(device: torch.device, dtypes: list[torch.dtype]) -> str:
    info = _extension.build_info()
    lines = [f"mmdeform_tma {__version__}  (torch {torch.__version__}, Python {platform.python_version()})", ""]
    lines.append("build:")
    if info.loaded:
        lines.append(f"  extension    : loaded, built against torch {info.torch_version}")
        cuda = f"yes, CUDA {info.cuda_version}, targets {', '.join(info.cuda_archs)}" if info.with_cuda else "no"
        lines.append(f"  CUDA kernels : {cuda}")
        lines.append(f"  sm_90a (TMA) : {'yes' if info.with_hopper else 'no'}")
    else:
        lines.append(f"  extension    : NOT LOADED: {info.error}")
    lines.append("")
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        lines.append(f"GPU: {torch.cuda.get_device_name(index)} (compute capability {major}.{minor}), torch CUDA {torch.version.cuda}")
    else:
        lines.append(f"GPU: none visible (torch CUDA build: {torch.version.cuda or 'no'})")
    mmcv_error = mmcv_integration.install_error()
    lines.append(f"mmcv MultiScaleDeformableAttention backend=: {'not installed: ' + mmcv_error if mmcv_error else 'ok (or mmcv absent)'}")
    lines.append("")
    lines.append(f"backends on {device} (probe: 8 heads x 32 channels, 4 levels, 4 points, with backward):")
    for dtype in dtypes:
        inputs = probe_inputs(device, dtype, requires_grad=True)
        lines.append(f"  value {str(dtype).removeprefix('torch.')}:")
        for name in AUTO_PRIORITY:
            backend = BACKENDS[name]
            reasons = backend.not_supported_reasons(inputs)
            status = "available" if not reasons else "unavailable"
            lines.append(f"    {name:<8} {status:<12} {backend.summary}")
            lines.extend(f"             - {reason}" for reason in reasons)
    lines.append("")
    lines.append(
        "'auto' picks the forward and the backward backend separately: the fastest that can run in the "
        "tuning table of this GPU (or of its compute capability), from the nearest measured shape; "
        f"without one, the first that can run of: {', '.join(AUTO_PRIORITY)}"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default=None, help="device to probe (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(report(device, [torch.float32, torch.float16, torch.bfloat16]))


if __name__ == "__main__":
    main()
