"""DCNv4's FlashDeformAttn as a compared kernel in the operator benchmark (`--compare dcnv4`).

A benchmark dependency only: mmdeform_tma never imports it. DCNv4 queries the GPU when imported,
so `load()` imports it on first use and stops the run with the reason if it cannot.

Its input convention (DCNv4 1.0.0.post2, `flash_deform_attn_func.py` and `src/cuda/*.cuh`):
  - value (bs, keys, heads, channels), spatial_shapes and level_start_index as mmcv's, on the GPU;
  - one tensor `sampling_loc_attn` in value's dtype: per (batch, query, head), the levels x points
    (x, y) locations, level-major, then levels x points attention *logits*; the kernel applies
    the softmax over all levels x points itself;
  - locations normalised exactly as mmcv's (pixel = loc * size - 0.5, a point is sampled when it
    lies strictly inside (-1, size) on both axes; corners outside read zero);
  - `K` is the number of points per level (4 or 8 only), at most 5 levels;
  - launch parameters from its own `findspec` / `findspec_bwd` (d_stride, threads per block);
  - its backward returns the gradient of `sampling_loc_attn`, i.e. of the locations and the
    logits (not of the softmax weights).
Logits are log(weights): their softmax returns the weights, so both kernels compute one function.
Like mmcv's, DCNv4 rounds the locations to value's dtype: that rounding counts as its error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from bench_common import BoundCall

IM2COL_STEP = 64  # what DCNv4's FlashDeformAttn module passes
INSTALL_HINT = (
    "build its wheel on the GPU machine (tar xzf .deps/DCNv4-1.0.0.post2.tar.gz -C /tmp && "
    "TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip wheel --no-deps --no-build-isolation -w /tmp/w "
    "/tmp/DCNv4-1.0.0.post2), install it with `pip install --no-deps --target /tmp/site <wheel>` and put "
    "/tmp/site on PYTHONPATH (.deps/setup.sh does)"
)


@dataclass(frozen=True)
class Dcnv4:
    function: type  # DCNv4.functions.FlashDeformAttnFunction
    findspec: Callable[[int, int, int, int], tuple[int, int]]
    findspec_bwd: Callable[[int, int, int, int], tuple[int, int]]
    version: str | None


@functools.cache
def load() -> Dcnv4:
    """DCNv4's function and launch-spec helpers; exits with the reason and the remedy if absent."""
    try:
        from DCNv4.functions import flash_deform_attn_func as module
    except Exception as exc:  # not installed, its extension unbuilt, or no (supported) GPU at import
        reason = f"{type(exc).__name__}: {exc}"
        raise SystemExit(f"--compare dcnv4: cannot import DCNv4 ({reason}); {INSTALL_HINT}") from exc
    try:
        from importlib.metadata import version

        installed = version("DCNv4")
    except Exception:  # an unpacked source tree has no metadata
        installed = None
    return Dcnv4(module.FlashDeformAttnFunction, module.findspec, module.findspec_bwd, installed)


def pack_locations_and_logits(locations: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mmcv-style (bs, nq, heads, levels, points, 2) locations and softmax weights -> DCNv4's
    (bs, nq, heads * levels * points * 3) tensor of locations then logits per (query, head)."""
    bs, nq, heads, levels, points, _ = locations.shape
    pairs = locations.double().reshape(bs, nq, heads, levels * points * 2)
    logits = weights.double().log().reshape(bs, nq, heads, levels * points)  # rounded once, to `dtype`, like the pairs
    per_head = torch.cat([pairs, logits], -1)
    return per_head.reshape(bs, nq, heads * levels * points * 3).to(dtype).contiguous()


def unpack_gradients(grad_value: torch.Tensor, grad_packed: torch.Tensor, locations_shape: torch.Size) -> dict:
    """DCNv4's two gradients, named and shaped as the accuracy records name ours."""
    bs, nq, heads, levels, points, _ = locations_shape
    per_head = grad_packed.reshape(bs, nq, heads, levels * points * 3)
    return {
        "grad_value": grad_value,
        "grad_locations": per_head[..., : levels * points * 2].reshape(locations_shape),
        "grad_logits": per_head[..., levels * points * 2 :].reshape(bs, nq, heads, levels, points),
    }


def launch_spec(dcnv4: Dcnv4, inputs) -> dict:
    """The (d_stride, threads per block) DCNv4 launches with for this problem, per direction."""
    value, _, _, locations, _ = inputs
    problem = (value.shape[0], locations.shape[1], value.shape[2], value.shape[3])  # batch, queries, heads, channels
    forward, backward = dcnv4.findspec(*problem), dcnv4.findspec_bwd(*problem)
    return {
        "forward": {"d_stride": forward[0], "block_threads": forward[1]},
        "backward": {"d_stride": backward[0], "block_threads": backward[1]},
    }


def bind(dcnv4: Dcnv4, inputs) -> BoundCall:
    """DCNv4 on one input set; the packing happens here, outside any timed call, as a DCNv4 model
    produces the packed tensor directly from its linear layer."""
    value, spatial_shapes, level_start_index, locations, weights = inputs
    points = locations.shape[4]

    def run(value, packed):
        return dcnv4.function.apply(value, spatial_shapes, level_start_index, packed, IM2COL_STEP, points)

    return BoundCall(
        leaves=(value, pack_locations_and_logits(locations, weights, value.dtype)),
        run=run,
        gradients=lambda grads: unpack_gradients(grads[0], grads[1], locations.shape),
        failures_are_results=True,
        launch_spec=launch_spec(dcnv4, inputs),
    )
