"""Problem generators and independent float64 references for the tests.

`loop_reference` is a slow, literal transcription of the definition (one Python loop per index),
sharing no code with `mmdeform_tma.reference` (grid_sample). `gather_reference` vectorises the same
arithmetic with explicit corner indexing, for larger problems and any device.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# The compiled backends the GPU tests cover; MMDEFORM_TMA_TEST_BACKENDS=cuda narrows them.
COMPILED_BACKENDS = tuple(os.environ.get("MMDEFORM_TMA_TEST_BACKENDS", "cuda,tma_ws").split(","))


def backend_skip_reason(name: str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a backend cannot run a small CUDA problem here (for pytest.skip), or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    from mmdeform_tma.backends import BACKENDS
    from mmdeform_tma.info import probe_inputs

    reasons = BACKENDS[name].not_supported_reasons(probe_inputs(torch.device("cuda"), dtype, requires_grad=True))
    return f"{name} cannot run here: {'; '.join(reasons)}" if reasons else None


@dataclass
class Problem:
    value: torch.Tensor
    spatial_shapes: torch.Tensor
    level_start_index: torch.Tensor
    sampling_locations: torch.Tensor
    attention_weights: torch.Tensor

    def args(self):
        return (self.value, self.spatial_shapes, self.level_start_index, self.sampling_locations, self.attention_weights)

    def to(self, device=None, dtype=None, coord_dtype=None):
        return Problem(
            self.value.to(device=device, dtype=dtype),
            self.spatial_shapes.to(device),
            self.level_start_index.to(device),
            self.sampling_locations.to(device=device, dtype=coord_dtype),
            self.attention_weights.to(device=device, dtype=coord_dtype),
        )

    def requires_grad_(self):
        for t in (self.value, self.sampling_locations, self.attention_weights):
            t.requires_grad_()
        return self


def level_start(shapes: list[tuple[int, int]]) -> list[int]:
    starts, total = [], 0
    for h, w in shapes:
        starts.append(total)
        total += h * w
    return starts


def make_problem(
    shapes: list[tuple[int, int]],
    batch: int = 2,
    queries: int = 5,
    heads: int = 2,
    channels: int = 4,
    points: int = 3,
    *,
    dtype: torch.dtype = torch.float64,
    device="cpu",
    generator: torch.Generator | None = None,
    spread: float = 0.25,
    outside_fraction: float = 0.2,
    locality: str = "uniform",
) -> Problem:
    """Random inputs. `locality='uniform'` draws locations over [-spread, 1 + spread]; 'local'
    places them at random reference points + N(0, 2 px) per level; 'encoder' is Deformable
    DETR's encoder: one query per pixel of every level in raster order (queries must equal the
    number of keys), its reference point the pixel's centre, + N(0, 2 px) per level.
    A fraction of the points is pushed outside the image and some land exactly on borders."""
    g = generator
    levels = len(shapes)
    num_keys = sum(h * w for h, w in shapes)
    value = torch.randn(batch, num_keys, heads, channels, generator=g, dtype=torch.float64)
    if locality == "encoder":
        if queries != num_keys:
            raise ValueError(f"locality='encoder' needs one query per key ({num_keys}), got {queries}")
        centres = []
        for h, w in shapes:
            ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
            centres.append(torch.stack([(xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h], -1))
        ref = torch.cat(centres).view(1, num_keys, 1, 1, 1, 2)
        wh = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float64).view(1, 1, 1, levels, 1, 2)
        offsets = torch.randn(batch, queries, heads, levels, points, 2, generator=g, dtype=torch.float64) * 2.0 / wh
        loc = ref + offsets
    elif locality == "local":
        ref = torch.rand(batch, queries, 1, 1, 1, 2, generator=g, dtype=torch.float64)
        wh = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float64).view(1, 1, 1, levels, 1, 2)
        offsets = torch.randn(batch, queries, heads, levels, points, 2, generator=g, dtype=torch.float64) * 2.0 / wh
        loc = ref + offsets
    else:
        loc = torch.rand(batch, queries, heads, levels, points, 2, generator=g, dtype=torch.float64)
        loc = loc * (1 + 2 * spread) - spread
    if outside_fraction > 0:
        mask = torch.rand(loc.shape[:-1], generator=g) < outside_fraction
        far = torch.rand(loc.shape, generator=g, dtype=torch.float64) * 4 - 1.5
        loc = torch.where(mask[..., None], far, loc)
        # a few points exactly on pixel centres and image borders
        border = torch.rand(loc.shape[:-1], generator=g) < 0.05
        loc = torch.where(border[..., None], torch.round(loc * 4) / 4, loc)
    logits = torch.randn(batch, queries, heads, levels * points, generator=g, dtype=torch.float64)
    attn = logits.softmax(-1).view(batch, queries, heads, levels, points)
    problem = Problem(
        value,
        torch.tensor(shapes, dtype=torch.long).view(levels, 2),
        torch.tensor(level_start(shapes), dtype=torch.long),
        loc,
        attn,
    )
    return problem.to(device=device, dtype=dtype, coord_dtype=dtype if dtype == torch.float64 else torch.float32)


def loop_reference(value, spatial_shapes, sampling_locations, attention_weights) -> torch.Tensor:
    """The definition, one scalar at a time, in float64."""
    v = value.double().cpu()
    loc = sampling_locations.double().cpu()
    attn = attention_weights.double().cpu()
    shapes = spatial_shapes.tolist()
    starts = level_start([tuple(s) for s in shapes])
    bs, _, heads, channels = v.shape
    _, queries, _, levels, points, _ = loc.shape
    out = torch.zeros(bs, queries, heads, channels, dtype=torch.float64)
    for b in range(bs):
        for q in range(queries):
            for h in range(heads):
                for lvl in range(levels):
                    height, width = shapes[lvl]
                    for p in range(points):
                        x = loc[b, q, h, lvl, p, 0].item()
                        y = loc[b, q, h, lvl, p, 1].item()
                        a = attn[b, q, h, lvl, p].item()
                        h_im, w_im = y * height - 0.5, x * width - 0.5
                        if not (h_im > -1 and w_im > -1 and h_im < height and w_im < width):
                            continue
                        y0, x0 = math.floor(h_im), math.floor(w_im)
                        ly, lx = h_im - y0, w_im - x0
                        for dy, wy in ((0, 1 - ly), (1, ly)):
                            for dx, wx in ((0, 1 - lx), (1, lx)):
                                yy, xx = y0 + dy, x0 + dx
                                if 0 <= yy < height and 0 <= xx < width:
                                    key = starts[lvl] + yy * width + xx
                                    out[b, q, h] += a * wy * wx * v[b, key, h]
    return out.view(bs, queries, heads * channels)


def _corners(spatial_shapes, level_start_index, sampling_locations, coord_dtype=torch.float64):
    """For each of the four bilinear corners of every sampling point: (valid, key, bilinear weight),
    each shaped (bs, queries, heads, levels, points); the geometry in `coord_dtype`, the weights
    returned in float64 and differentiable."""
    loc = sampling_locations.to(coord_dtype)
    levels = loc.shape[3]
    hw = spatial_shapes.to(loc.device).to(coord_dtype)
    height = hw[:, 0].view(1, 1, 1, levels, 1)
    width = hw[:, 1].view(1, 1, 1, levels, 1)
    start = level_start_index.to(loc.device).view(1, 1, 1, levels, 1)
    h_im = loc[..., 1] * height - 0.5
    w_im = loc[..., 0] * width - 0.5
    inside = (h_im > -1) & (w_im > -1) & (h_im < height) & (w_im < width)
    y0, x0 = torch.floor(h_im).detach(), torch.floor(w_im).detach()
    ly, lx = h_im - y0, w_im - x0
    for dy, wy in ((0, 1 - ly), (1, ly)):
        for dx, wx in ((0, 1 - lx), (1, lx)):
            yy, xx = y0 + dy, x0 + dx
            valid = inside & (yy >= 0) & (yy < height) & (xx >= 0) & (xx < width)
            key = torch.where(valid, start + yy.clamp(min=0).long() * width.long() + xx.clamp(min=0).long(), 0)
            yield valid, key, (wy * wx).double()


def _batch_head_index(shape, device):
    bs, _, heads = shape[:3]
    b = torch.arange(bs, device=device).view(bs, 1, 1, 1, 1).expand(shape)
    h = torch.arange(heads, device=device).view(1, 1, heads, 1, 1).expand(shape)
    return b, h


def gather_reference(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, coord_dtype=torch.float64
) -> torch.Tensor:
    """The same arithmetic vectorised with explicit corner gathers: float64 math (the sampling
    geometry in `coord_dtype`, float32 to mimic a float32 kernel), any device, int64 indexing
    straight into `value` (no copy of it), differentiable."""
    bs, _, heads, channels = value.shape
    queries = sampling_locations.shape[1]
    sampled = 0.0  # (bs, queries, heads, levels, points, channels): bilinear samples, 0 outside
    for valid, key, bilinear in _corners(spatial_shapes, level_start_index, sampling_locations, coord_dtype):
        b, h = _batch_head_index(key.shape, value.device)
        gathered = value[b, key, h].double()
        gathered = torch.where(valid[..., None], gathered, 0.0)  # a corner outside is never read
        sampled = sampled + torch.where(valid, bilinear, 0.0)[..., None] * gathered
    out = (attention_weights.double()[..., None] * sampled).sum(dim=(3, 4))
    return out.view(bs, queries, heads * channels)


def value_gradient_entries(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """The exact value gradient at every (batch, key, head) some corner touches, in float64:
    returns (b, key, h, gradient[channels]) with one row per distinct touched entry."""
    bs, num_keys, heads, channels = value.shape
    go = grad_output.double().view(bs, -1, heads, 1, 1, channels)
    rows, contributions = [], []
    for valid, key, bilinear in _corners(spatial_shapes, level_start_index, sampling_locations):
        b, h = _batch_head_index(key.shape, value.device)
        weight = attention_weights.double() * bilinear
        contribution = (weight[..., None] * go).detach()
        rows.append(((b * num_keys + key) * heads + h)[valid])
        contributions.append(contribution[valid])
    rows, contributions = torch.cat(rows), torch.cat(contributions)
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = torch.zeros(len(unique), channels, dtype=torch.float64, device=value.device).index_add_(0, inverse, contributions)
    h = unique % heads
    key = (unique // heads) % num_keys
    b = unique // heads // num_keys
    return b, key, h, summed


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double().to(actual.device)
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


def rounding_error(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative L2 error of rounding the exact result to `dtype`: the floor for any kernel."""
    return rel_l2(exact.to(dtype), exact)


def symbolic_sizes(**hints: int):
    """Symbolic sizes as torch.compile's dynamic shapes trace them (one per keyword, with its hint),
    and their shape environment: what planning code does with them shows in its guards."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    sizes = [
        env.create_symintnode(env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC), hint=hint)
        for name, hint in hints.items()
    ]
    return sizes, env


def guards(env) -> list[str]:
    return [str(guard.expr) for guard in env.guards]


# The refusals of tma_ws's forward-only config families, as the kernels word them: the GPU tests check
# that a config raises exactly these, and tests/test_tuning.py that the tables' rule (tuning.config_runs)
# agrees.
def tensor_core_forward_reason(name: str, problem) -> str | None:
    """The error a tensor-core gather forward config (`tc_*`) must raise for this problem, if any."""
    if not name.startswith("tc_"):
        return None
    if problem.value.dtype not in (torch.float16, torch.bfloat16):
        return "takes float16 or bfloat16 values"
    if problem.value.shape[-1] != 32:
        return "takes heads of 32 channels"
    return None


def region_forward_reason(name: str, problem) -> str | None:
    """The error a region forward config (`rg_*`) must raise for this problem, if any."""
    if not name.startswith("rg_"):
        return None
    batch, keys, _, channels = problem.value.shape
    queries, levels, points = problem.sampling_locations.shape[1], *problem.sampling_locations.shape[3:5]
    if problem.value.dtype not in (torch.float16, torch.bfloat16):
        return "takes float16 or bfloat16 values"
    if channels != 32:
        return "takes heads of 32 channels"
    if queries != keys:
        return "takes encoder self-attention"
    if points not in (4, 8):
        return "takes 4 or 8 points a level"
    if not 2 <= levels <= 5:
        return "takes 2 to 5 levels"
    return None
