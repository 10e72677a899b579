"""Loads the compiled extension ``mmdeform_tma._C``, reports what it was built with, and answers
the dispatcher's questions about the GPU (name, compute capability).

Loading never touches a GPU: it only maps the shared library and registers the operator schema.
GPU queries run once per device. The queries the dispatcher makes are
`torch.compiler.assume_constant_result`, so that torch.compile evaluates them once while tracing
instead of breaking the graph.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

BUILD_HINT = (
    "build it from the repository root with `pip install -e . --no-build-isolation` on a machine with "
    "a CUDA toolkit (nvcc) and a CUDA-enabled torch, or set FORCE_CUDA=1; TORCH_CUDA_ARCH_LIST must "
    "include 9.0 for the Hopper kernels"
)


@dataclass(frozen=True)
class BuildInfo:
    loaded: bool
    error: str | None = None
    with_cuda: bool = False
    with_hopper: bool = False
    cuda_archs: tuple[str, ...] = ()
    cuda_version: int | None = None
    torch_version: str | None = None

    def supports_device(self, capability: tuple[int, int]) -> bool:
        """Whether the compiled targets include code that runs on a GPU of this capability."""
        major, minor = capability
        for arch in self.cuda_archs:
            kind, _, number = arch.partition("_")
            digits = number.rstrip("a")
            arch_cap = (int(digits[:-1]), int(digits[-1]))
            if kind == "sm" and arch_cap == (major, minor):
                return True
            if kind == "sm" and not number.endswith("a") and arch_cap[0] == major and arch_cap[1] <= minor:
                return True  # SASS runs on later minor revisions of the same major
            if kind == "compute" and arch_cap <= (major, minor) and not number.endswith("a"):
                return True  # PTX is JIT-compiled for newer GPUs
        return False


@functools.cache
def _load():
    try:
        return importlib.import_module("mmdeform_tma._C"), None
    except ImportError as exc:
        return None, f"mmdeform_tma._C could not be imported ({exc})"


def extension():
    """The `_C` module, or None when it cannot be imported (build_info().error says why)."""
    return _load()[0]


@functools.cache
def build_info() -> BuildInfo:
    module, error = _load()
    if module is None:
        return BuildInfo(loaded=False, error=error)
    raw = module.build_info()
    return BuildInfo(
        loaded=True,
        with_cuda=bool(raw["with_cuda"]),
        with_hopper=bool(raw["with_hopper"]),
        cuda_archs=tuple(arch for arch in raw["cuda_archs"].split(",") if arch),
        cuda_version=raw["cuda_version"],
        torch_version=raw["torch_version"],
    )


@functools.cache
def _kernel_configs(backend: str, direction: str) -> tuple[str, ...]:
    module = extension()
    return tuple(module.kernel_configs(backend, direction)) if module is not None else ()


@torch.compiler.assume_constant_result
def kernel_configs(backend: str, direction: str) -> tuple[str, ...]:
    """Names of the compiled kernel variants of a backend, in the order the ops' `config` indexes."""
    return _kernel_configs(backend, direction)


@functools.cache
def _gpu(index: int) -> tuple[str, tuple[int, int]]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@torch.compiler.assume_constant_result
def device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, queried once (and constant under torch.compile)."""
    return _gpu(_index(device))[1]


@torch.compiler.assume_constant_result
def device_name(device: torch.device) -> str:
    """Name of a CUDA device, the key of its tuning table; queried once."""
    return _gpu(_index(device))[0]


@torch.compiler.assume_constant_result
def build_reasons(needs_hopper: bool) -> tuple[str, ...]:
    """Why the compiled kernels cannot run at all in this build (empty when they can)."""
    info = build_info()
    if not info.loaded:
        return (f"not built: {info.error}; {BUILD_HINT}",)
    if not info.with_cuda:
        return (f"not built: the extension was compiled without CUDA kernels; {BUILD_HINT}",)
    if needs_hopper and not info.with_hopper:
        return (f"not built: the extension has no sm_90a (Hopper) kernels; {BUILD_HINT}",)
    return ()


@torch.compiler.assume_constant_result
def device_reason(major: int, minor: int) -> str:
    """Why this build has no code for a GPU of this capability ('' when it has)."""
    info = build_info()
    if info.supports_device((major, minor)):
        return ""
    return (
        f"not built for this GPU (compute capability {major}.{minor}; built for {', '.join(info.cuda_archs)}); "
        f"rebuild with TORCH_CUDA_ARCH_LIST including {major}.{minor}"
    )
