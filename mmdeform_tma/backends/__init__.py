"""The backends, one module each, registered by name."""

from .base import Backend
from .cuda import CudaBackend
from .mmcv import MMCVBackend
from .pytorch import PyTorchBackend
from .tma_ws import TmaWarpSpecializedBackend

BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (TmaWarpSpecializedBackend(), CudaBackend(), MMCVBackend(), PyTorchBackend())
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)

__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend"]
