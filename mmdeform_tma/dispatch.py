"""Choosing a backend: 'auto' takes the first able one, a named one must be able or raise.

Nothing falls back silently: a backend named explicitly that cannot run the inputs raises
`BackendUnavailableError` with its reasons, and 'auto' that finds none lists every backend's.
"""

from __future__ import annotations

import logging

import torch

from . import tuning
from .backends import BACKEND_NAMES, BACKENDS, Backend
from .inputs import MSDAInputs

logger = logging.getLogger(__name__)

# Default order for 'auto'; a tuning table measured on the GPU reorders the compiled backends.
AUTO_PRIORITY: tuple[str, ...] = ("tma_ws", "tma", "cuda", "mmcv", "pytorch")
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKEND_NAMES)


class BackendUnavailableError(RuntimeError):
    """The requested backend (or, for 'auto', every backend) cannot run these inputs."""


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(BACKEND_CHOICES)}") from None


def can_run(backend: Backend, inputs: MSDAInputs, *, raise_error: bool) -> bool:
    """The one predicate: logs the reasons when probing for 'auto', raises them when forced."""
    reasons = backend.not_supported_reasons(inputs)
    if not reasons:
        return True
    message = f"backend {backend.name!r} cannot run {inputs.describe()}:\n" + "\n".join(f"  - {r}" for r in reasons)
    if raise_error:
        raise BackendUnavailableError(message)
    logger.debug(message)
    return False


def auto_order(inputs: MSDAInputs) -> tuple[str, ...]:
    preferred = tuning.preferred_backends(inputs) if inputs.device.type == "cuda" else ()
    return (*preferred, *(name for name in AUTO_PRIORITY if name not in preferred))


def select_backend(name: str, inputs: MSDAInputs) -> Backend:
    if name != "auto":
        backend = get_backend(name)
        can_run(backend, inputs, raise_error=True)
        return backend
    report = []
    for candidate in auto_order(inputs):
        backend = BACKENDS[candidate]
        if can_run(backend, inputs, raise_error=False):
            return backend
        report.append(f"{candidate}: " + "; ".join(backend.not_supported_reasons(inputs)))
    raise BackendUnavailableError(f"no backend can run {inputs.describe()}:\n" + "\n".join(f"  - {r}" for r in report))


def available_backends(device: str | torch.device | None = None, dtype: torch.dtype = torch.float32) -> list[str]:
    """Backends able to run a small probe problem on `device` (default: CUDA if present, else CPU)."""
    from .inputs import validate

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    probe = validate(
        torch.zeros((1, 4, 1, 32), dtype=dtype, device=device),
        torch.tensor([[2, 2]], dtype=torch.long),
        torch.tensor([0], dtype=torch.long),
        torch.zeros((1, 1, 1, 1, 1, 2), dtype=torch.float32, device=device),
        torch.zeros((1, 1, 1, 1, 1), dtype=torch.float32, device=device),
    )
    return [name for name in AUTO_PRIORITY if not BACKENDS[name].not_supported_reasons(probe)]
