"""Choosing backends, and planning a call once per call signature.

A named backend must be able to run the inputs or raises `BackendUnavailableError` with its
reasons. 'auto' picks, among the backends able to run, the forward and the backward separately:
the compiled backends' measured times decide each direction (`tuning.fastest_backend`, which
answers for unmeasured shapes from the nearest measured one); `mmcv` and the reference come only
when no compiled backend can run, in `AUTO_PRIORITY` order. 'auto' that finds none lists every
backend's reasons. Nothing falls back silently.

Everything the choice depends on is metadata, so `plan` decides it once per `signature` and
`mmdeform_tma.functional` reuses the result (`PLANS`): a repeated call builds a key and makes one
dictionary lookup. Keys hold shapes, dtypes, devices, values of CPU level geometry and flags,
never tensor identities.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from . import tuning
from .backends import BACKEND_NAMES, BACKENDS, Backend
from .backends.base import Launch, clear_device_copies
from .backends.compiled import CompiledKernelBackend
from .inputs import MSDAInputs, check_level_geometry, strict_validation, validate

logger = logging.getLogger(__name__)

# 'auto' order where nothing measured decides: mmcv and the reference after the compiled backends,
# and among those when no table covers this GPU's architecture.
AUTO_PRIORITY: tuple[str, ...] = ("tma_ws", "cuda", "mmcv", "pytorch")
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKEND_NAMES)
COMPILED_BACKENDS: tuple[str, ...] = tuple(n for n in AUTO_PRIORITY if isinstance(BACKENDS[n], CompiledKernelBackend))
# Call signature -> what the call runs. Bounded: shapes that change every call (random image
# sizes) must not grow it without end. When full it starts again (thread-safe, unlike evicting
# one entry while another thread inserts); the signatures in use are planned again once.
PLANS: dict[tuple, Launch] = {}
MAX_PLANS = 1024


class BackendUnavailableError(RuntimeError):
    """The requested backend (or, for 'auto', every backend) cannot run these inputs."""


class Selection(NamedTuple):
    forward: Backend
    backward: Backend  # differs from forward only between compiled backends, which share one op


# Names that no longer run anything, with the reason and what replaces them.
RETIRED_BACKENDS: dict[str, str] = {
    "tma": (
        "its per-point TMA kernels were retired in 0.2.0: slower than 'tma_ws' or 'cuda' on every shape and "
        "direction measured (1.11x-7x on an H100, docs/perf_notes.md, session 21); use 'tma_ws', or 'auto'"
    ),
}


def unknown_backend_message(name: object) -> str:
    """Why `name` is no backend: retired (and what replaces it), or never one."""
    if isinstance(name, str) and name in RETIRED_BACKENDS:
        return f"backend {name!r} no longer exists: {RETIRED_BACKENDS[name]}"
    return f"unknown backend {name!r}; valid names: {', '.join(BACKEND_CHOICES)}"


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(unknown_backend_message(name)) from None


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


def select(name: str, inputs: MSDAInputs) -> Selection:
    """The forward and backward backends for a call."""
    if name != "auto":
        backend = get_backend(name)
        can_run(backend, inputs, raise_error=True)
        return Selection(backend, backend)
    able = [candidate for candidate in AUTO_PRIORITY if can_run(BACKENDS[candidate], inputs, raise_error=False)]
    if not able:
        report = [f"{candidate}: " + "; ".join(BACKENDS[candidate].not_supported_reasons(inputs)) for candidate in AUTO_PRIORITY]
        raise BackendUnavailableError(f"no backend can run {inputs.describe()}:\n" + "\n".join(f"  - {r}" for r in report))
    compiled = tuple(candidate for candidate in able if candidate in COMPILED_BACKENDS)
    if not compiled:
        return Selection(BACKENDS[able[0]], BACKENDS[able[0]])
    forward = tuning.fastest_backend("forward", inputs, compiled)
    backward = tuning.fastest_backend(tuning.backward_direction(), inputs, compiled) if inputs.needs_grad else forward
    return Selection(BACKENDS[forward], BACKENDS[backward])


def select_backend(name: str, inputs: MSDAInputs) -> Backend:
    """The backend that runs the forward of a call (see `select` for both directions)."""
    return select(name, inputs).forward


def _values(tensor: torch.Tensor):
    """Values of CPU level geometry, which validation and the device copies depend on (reading a
    CPU tensor is no synchronisation); None elsewhere, where no host code reads them."""
    if not tensor.is_cpu:
        return None
    values = tensor.tolist()
    return tuple(map(tuple, values)) if tensor.dim() == 2 else tuple(values) if tensor.dim() == 1 else None


def signature(backend, value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> tuple | None:
    """What a call's plan depends on: the tensors' shapes, dtypes and devices, CPU level geometry's
    values, whether a backward will run, the deterministic and strict flags and the dispatch-mode
    depth (`backends.base.on_device`). None when an argument is no tensor (validation says which)."""
    try:
        return (
            backend,
            torch.is_grad_enabled()
            and (value.requires_grad or sampling_locations.requires_grad or attention_weights.requires_grad),
            torch.are_deterministic_algorithms_enabled(),
            strict_validation(),
            torch._C._len_torch_dispatch_stack(),
            value.shape, value.dtype, value.device,
            spatial_shapes.shape, spatial_shapes.dtype, spatial_shapes.device, _values(spatial_shapes),
            level_start_index.shape, level_start_index.dtype, level_start_index.device, _values(level_start_index),
            sampling_locations.shape, sampling_locations.dtype, sampling_locations.device,
            attention_weights.shape, attention_weights.dtype, attention_weights.device,
        )
    except AttributeError:
        return None


def _checking_geometry(launch: Launch, num_keys: int) -> Launch:
    def checked(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        check_level_geometry(spatial_shapes, level_start_index, num_keys)
        return launch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    return checked


def plan(backend, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *, key=None) -> Launch:
    """Validate, select and bind a call; with `key` (its `signature`) remember the result."""
    inputs = validate(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    selection = select(backend, inputs)
    launch = selection.forward.launcher(inputs, selection.backward)
    if strict_validation() and not (spatial_shapes.is_cpu and level_start_index.is_cpu) and not torch.compiler.is_compiling():
        launch = _checking_geometry(launch, inputs.num_keys)  # strict mode checks device-resident geometry every call
    if key is not None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = launch
    return launch


def clear_caches() -> None:
    """Forget plans, device copies of level geometry and tuning lookups."""
    PLANS.clear()
    clear_device_copies()
    tuning.clear_caches()


def available_backends(device: str | torch.device | None = None, dtype: torch.dtype = torch.float32) -> list[str]:
    """Backends able to run a small probe problem on `device` (default: CUDA if present, else CPU)."""
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
