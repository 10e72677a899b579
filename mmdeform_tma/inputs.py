"""Validated arguments of one multi-scale deformable attention call.

Metadata (ranks, sizes, dtypes, devices) is always checked. The *values* of `spatial_shapes` and
`level_start_index` are checked when they live on the CPU, or on any device in strict mode: reading
them from a GPU would synchronise the host on every call, which mmcv's own `assert` does and which
breaks CUDA-graph capture. When they are on the GPU and strict mode is off (or inside
torch.compile), the CUDA kernels check the level geometry on the device and return NaN, loudly, for
an inconsistent one; they never read outside `value`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_strict = os.environ.get("MMDEFORM_TMA_STRICT", "0") == "1"


def strict_validation() -> bool:
    """Whether level geometry on the GPU is checked on the host (one synchronisation per call)."""
    return _strict


def set_strict_validation(enabled: bool) -> None:
    global _strict
    _strict = bool(enabled)


@contextlib.contextmanager
def strict_validation_enabled(enabled: bool = True):
    previous = strict_validation()
    set_strict_validation(enabled)
    try:
        yield
    finally:
        set_strict_validation(previous)


@dataclass(frozen=True)
class MSDAInputs:
    value: torch.Tensor  # (bs, num_keys, heads, channels)
    spatial_shapes: torch.Tensor  # (levels, 2) int64, (h, w)
    level_start_index: torch.Tensor  # (levels,) int64
    sampling_locations: torch.Tensor  # (bs, queries, heads, levels, points, 2), (x, y) in [0, 1]
    attention_weights: torch.Tensor  # (bs, queries, heads, levels, points)
    batch: int
    num_keys: int
    num_heads: int
    channels: int
    num_levels: int
    num_points: int
    num_queries: int

    @property
    def device(self) -> torch.device:
        return self.value.device

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    @property
    def needs_grad(self) -> bool:
        """Whether autograd will call a backward for this call."""
        return torch.is_grad_enabled() and (
            self.value.requires_grad or self.sampling_locations.requires_grad or self.attention_weights.requires_grad
        )

    @classmethod
    def from_validated(cls, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        """Wrap tensors that already passed `validate` (e.g. saved for backward)."""
        batch, num_keys, heads, channels = value.shape
        _, queries, _, levels, points, _ = sampling_locations.shape
        return cls(
            value=value,
            spatial_shapes=spatial_shapes,
            level_start_index=level_start_index,
            sampling_locations=sampling_locations,
            attention_weights=attention_weights,
            batch=batch,
            num_keys=num_keys,
            num_heads=heads,
            channels=channels,
            num_levels=levels,
            num_points=points,
            num_queries=queries,
        )

    def describe(self) -> str:
        return (
            f"value {tuple(self.value.shape)} {self.dtype} on {self.device}, levels {self.num_levels}, "
            f"points {self.num_points}, queries {self.num_queries}"
        )


def _require_tensor(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")


def _require_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(tensor.shape)}")


def _require_same_size(what: str, sizes: dict[str, int]) -> None:
    # compared, not hashed: under torch.compile's dynamic shapes a set would pin each size's value
    first, *rest = sizes.values()
    if any(size != first for size in rest):
        detail = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(f"{what} differs between arguments ({detail})")


def validate(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> MSDAInputs:
    """Check the arguments and return them with their sizes; raises TypeError or ValueError."""
    args = {
        "value": value,
        "spatial_shapes": spatial_shapes,
        "level_start_index": level_start_index,
        "sampling_locations": sampling_locations,
        "attention_weights": attention_weights,
    }
    for name, tensor in args.items():
        _require_tensor(name, tensor)

    _require_rank("value", value, 4, "(bs, num_keys, heads, channels)")
    _require_rank("spatial_shapes", spatial_shapes, 2, "(levels, 2)")
    _require_rank("level_start_index", level_start_index, 1, "(levels,)")
    _require_rank("sampling_locations", sampling_locations, 6, "(bs, queries, heads, levels, points, 2)")
    _require_rank("attention_weights", attention_weights, 5, "(bs, queries, heads, levels, points)")
    if spatial_shapes.shape[1] != 2:
        raise ValueError(f"spatial_shapes must be (levels, 2) holding (h, w), got {tuple(spatial_shapes.shape)}")
    if sampling_locations.shape[-1] != 2:
        raise ValueError(
            f"the last dimension of sampling_locations must be 2 (x, y), got {tuple(sampling_locations.shape)}"
        )

    if value.dtype not in VALUE_DTYPES:
        raise TypeError(f"value must be float16, bfloat16, float32 or float64, got {value.dtype}")
    coord_dtypes = {torch.float32, value.dtype}
    for name in ("sampling_locations", "attention_weights"):
        if args[name].dtype not in coord_dtypes:
            allowed = " or ".join(sorted(str(d) for d in coord_dtypes))
            raise TypeError(f"{name} must be {allowed} (float32 or value's dtype), got {args[name].dtype}")
    for name in ("spatial_shapes", "level_start_index"):
        if args[name].dtype != torch.int64:
            raise TypeError(f"{name} must be int64 (torch.long), got {args[name].dtype}; convert it with .long()")

    device = value.device
    for name in ("sampling_locations", "attention_weights"):
        if args[name].device != device:
            raise ValueError(f"{name} is on {args[name].device} but value is on {device}; move them to one device")
    for name in ("spatial_shapes", "level_start_index"):
        if args[name].device not in (device, torch.device("cpu")):
            raise ValueError(f"{name} is on {args[name].device}; it must be on the CPU or on value's device {device}")

    _require_same_size(
        "batch size",
        {"value": value.shape[0], "sampling_locations": sampling_locations.shape[0], "attention_weights": attention_weights.shape[0]},
    )
    _require_same_size(
        "number of heads",
        {"value": value.shape[2], "sampling_locations": sampling_locations.shape[2], "attention_weights": attention_weights.shape[2]},
    )
    _require_same_size(
        "number of levels",
        {
            "spatial_shapes": spatial_shapes.shape[0],
            "level_start_index": level_start_index.shape[0],
            "sampling_locations": sampling_locations.shape[3],
            "attention_weights": attention_weights.shape[3],
        },
    )
    _require_same_size(
        "number of points", {"sampling_locations": sampling_locations.shape[4], "attention_weights": attention_weights.shape[4]}
    )
    _require_same_size(
        "number of queries", {"sampling_locations": sampling_locations.shape[1], "attention_weights": attention_weights.shape[1]}
    )
    # Under torch.compile the values are data-dependent: the kernels' device-side check stands in.
    # Outside strict mode only CPU values are read: reading a GPU tensor would synchronise.
    if not torch.compiler.is_compiling() and (strict_validation() or spatial_shapes.is_cpu):
        starts = level_start_index if strict_validation() or level_start_index.is_cpu else None
        check_level_geometry(spatial_shapes, starts, value.shape[1])
    return MSDAInputs.from_validated(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def check_level_geometry(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor | None, num_keys: int) -> None:
    """The values check: h, w >= 0, level_start_index (when given) is the running sum of h*w, and
    the levels add up to num_keys."""
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist() if level_start_index is not None else None
    expected_start = 0
    for level, (h, w) in enumerate(shapes):
        if h < 0 or w < 0:
            raise ValueError(f"spatial_shapes[{level}] = ({h}, {w}) is negative")
        if starts is not None and starts[level] != expected_start:
            raise ValueError(
                f"level_start_index[{level}] = {starts[level]} does not match spatial_shapes: level {level} starts at "
                f"{expected_start} (the sum of h*w of the levels before it); level_start_index = {starts}"
            )
        expected_start += h * w
    if expected_start != num_keys:
        raise ValueError(
            f"spatial_shapes {shapes} cover {expected_start} keys (sum of h*w) but value has num_keys = {num_keys}"
        )
