"""Autotuned choices, read at run time: which compiled backend 'auto' runs in each direction, and
which kernel variant ("config") a backend runs.

`tools/autotune.py` times every compiled variant of each backend on a GPU, drops the ones that fail
the correctness check, and writes the best few per shape into `tuning_tables/<device>.json`, with
the GPU's name and compute capability. Here:
  - `fastest_backend` picks, for one direction, the fastest of the backends that can run;
  - `kernel_config` gives the `config` index of a backend's fastest variant (-1: the kernel's own
    heuristic).
Both answer for shapes the table lacks from the nearest measured shape (`distance`), never from a
fixed order. Under `torch.use_deterministic_algorithms(True)` the backward runs fixed-point sums
(or, on cross-attention, sorted contributions that no config changes) whose fastest variants differ
(the gather configs: 2.2 ms where the fast path's config takes 7.1 on the fp16 DETR encoder; H100,
2026-11-23, commit 56e4c52): that direction, `backward-deterministic`, is tuned apart, and where
nothing of it was measured the fast backward's choices stand. A measurement counts only through
configs this build compiles: one whose configs are all gone was of kernels since replaced, and is
ignored until the table is tuned again. A GPU without a table of its own uses the tables of GPUs of
its compute capability (an H200 reads the H100's); a fixed order remains only where nothing of its
architecture was measured. `MMDEFORM_TMA_TUNING_TABLE=/path/table.json` adds a table of your own (it
wins on equal keys). Lookups are cached and `assume_constant_result`: torch.compile resolves them
once while tracing; eager calls make them once per call signature (`mmdeform_tma.functional`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ._extension import device_capability, device_name, kernel_configs
from .inputs import MSDAInputs

TABLE_DIR = Path(__file__).with_name("tuning_tables")
DETERMINISTIC_BACKWARD = "backward-deterministic"  # a table direction; its kernels are the backward's
TABLE_FORMAT = 1
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# key -> backend -> direction -> [(config name, median ms)], best first
Entries = dict[str, dict[str, dict[str, list[tuple[str, float]]]]]


def work_bits(work) -> int:
    """`max(work, 1).bit_length()`, by comparisons: under torch.compile's dynamic shapes a symbolic
    work size then guards on its power-of-two range (one graph per bucket), not on its value."""
    bits = 1
    while work >= 1 << bits:
        bits += 1
    return bits


def shape_key(dtype: torch.dtype, heads: int, channels: int, levels: int, points: int, work: int) -> str:
    """What a table entry is keyed on; `work` (batch x queries) is bucketed by powers of two."""
    return f"{str(dtype).removeprefix('torch.')}/h{heads}/c{channels}/l{levels}/p{points}/w{work_bits(work)}"


def self_attention(inputs: MSDAInputs) -> bool:
    """One query per key: what the self-attention-only configs need beside the table key."""
    return inputs.num_queries == inputs.num_keys


def inputs_key(inputs: MSDAInputs) -> str:
    return shape_key(
        inputs.dtype, inputs.num_heads, inputs.channels, inputs.num_levels, inputs.num_points, inputs.batch * inputs.num_queries
    )


@dataclass(frozen=True)
class ShapeKey:
    dtype: str
    heads: int
    channels: int
    levels: int
    points: int
    work_bits: int

    @classmethod
    def parse(cls, key: str) -> ShapeKey:
        dtype, *fields = key.split("/")
        heads, channels, levels, points, work_bits = (int(field[1:]) for field in fields)
        return cls(dtype, heads, channels, levels, points, work_bits)

    @property
    def row_bytes(self) -> int:
        """Bytes of one head's channels: what the kernels' vector and TMA layouts follow."""
        return self.channels * ELEMENT_BYTES.get(self.dtype, 4)


def distance(target: ShapeKey, measured: ShapeKey) -> tuple:
    """How far a measured shape is from the target; smaller tuples are nearer.

    First the number of layout differences (dtype, bytes per head row, heads): the kernels' code
    paths follow the layout. Then the size: |log2 work| + |levels| + |log2 points| apart, where work
    is batch x queries. On a tie the larger measured shape wins (a wrong choice costs more there).
    """
    layout = (
        (target.dtype != measured.dtype) + (target.row_bytes != measured.row_bytes) + (target.heads != measured.heads)
    )
    size = (
        abs(target.work_bits - measured.work_bits)
        + abs(target.levels - measured.levels)
        + abs(math.log2(max(target.points, 1)) - math.log2(max(measured.points, 1)))
    )
    return layout, size, -measured.work_bits, -measured.levels, -measured.points


def table_paths() -> list[Path]:
    paths = sorted(TABLE_DIR.glob("*.json"))
    extra = os.environ.get("MMDEFORM_TMA_TUNING_TABLE")
    return paths + ([Path(extra)] if extra else [])


@dataclass(frozen=True)
class Table:
    capability: tuple[int, int] | None  # None in tables written before autotune recorded it
    entries: Entries


@functools.cache
def load_tables() -> dict[str, Table]:
    """device name -> its table."""
    tables: dict[str, Table] = {}
    for path in table_paths():
        data = json.loads(path.read_text())
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"{path}: tuning table format {data.get('format')!r}, expected {TABLE_FORMAT}")
        known = tables.get(data["device"], Table(None, {}))
        capability = tuple(data["capability"]) if "capability" in data else known.capability
        table = tables[data["device"]] = Table(capability, known.entries)
        for entry in data["entries"]:
            ranked = [(choice["config"], float(choice["ms"])) for choice in entry["best"]]
            table.entries.setdefault(entry["key"], {}).setdefault(entry["backend"], {})[entry["direction"]] = ranked
    return tables


@functools.cache
def measurements(device: str, capability: tuple[int, int]) -> Entries:
    """This GPU's table, or else the merged tables of GPUs with its compute capability."""
    tables = load_tables()
    if device in tables:
        return tables[device].entries
    merged: Entries = {}
    for name in sorted(tables):
        if tables[name].capability == tuple(capability):
            for key, per_backend in tables[name].entries.items():
                for backend, per_direction in per_backend.items():
                    merged.setdefault(key, {}).setdefault(backend, {}).update(per_direction)
    return merged


def kernel_direction(direction: str) -> str:
    """The direction whose compiled configs a table direction ranks."""
    return "backward" if direction == DETERMINISTIC_BACKWARD else direction


def backward_direction() -> str:
    """The table direction of a backward run now: the deterministic one under
    torch.use_deterministic_algorithms(True), which the backward kernels read when they run."""
    return DETERMINISTIC_BACKWARD if torch.are_deterministic_algorithms_enabled() else "backward"


HALF_DTYPES = ("float16", "bfloat16")


def config_runs(config: str, target: ShapeKey, self_attention: bool) -> bool:
    """Whether a config runs this call at all. Most run any input; the tma_ws forward-only families
    refuse what their kernels cannot take (the reasons in csrc/hopper/tensor_core_forward.cu and
    region_forward.cu, which a GPU test compares with this), so a measurement of theirs stands only
    for calls they run: the nearest measured shape may differ in levels, points or, for the region
    forward, in being self-attention (a table key, batch x queries, does not tell an encoder from a
    decoder of as many queries in all)."""
    if config.startswith(("tc_", "rg_")) and (target.dtype not in HALF_DTYPES or target.channels != 32):
        return False
    if config.startswith("rg_"):
        # Its 32-bit point indices and its fallback's need value bytes and location coordinates under
        # 2^31 (window_forward.cu's lean_fits): judged at the largest work of the key's bucket.
        work = (1 << target.work_bits) - 1
        small = work * target.heads * target.channels * 2 < 2**31 and work * target.heads * target.levels * target.points * 2 < 2**31
        return self_attention and target.points in (4, 8) and 2 <= target.levels <= 5 and small
    return True


def compiled_ranking(
    ranked: list[tuple[str, float]], backend: str, direction: str, target: ShapeKey, self_attention: bool = True
) -> list[tuple[str, float]]:
    """A measured ranking without the configs this build does not compile and those that do not run
    the target call."""
    names = kernel_configs(backend, kernel_direction(direction))
    return [(config, ms) for config, ms in ranked if config in names and config_runs(config, target, self_attention)]


@functools.cache
def nearest_times(
    device: str,
    capability: tuple[int, int],
    key: str,
    direction: str,
    candidates: tuple[str, ...],
    self_attention: bool = True,
) -> tuple[str, dict[str, float]] | None:
    """The nearest measured shape with a time for any candidate in `direction`, and those times
    (each backend's best config that this build compiles)."""
    target = ShapeKey.parse(key)
    best = None
    for measured_key, per_backend in measurements(device, capability).items():
        times = {}
        for backend in candidates:
            ranked = compiled_ranking(
                per_backend.get(backend, {}).get(direction) or [], backend, direction, target, self_attention
            )
            if ranked:
                times[backend] = ranked[0][1]
        if times:
            rank = distance(target, ShapeKey.parse(measured_key))
            if best is None or rank < best[0]:
                best = (rank, measured_key, times)
    return None if best is None else (best[1], best[2])


@torch.compiler.assume_constant_result
def _fastest(
    device: str,
    capability: tuple[int, int],
    key: str,
    direction: str,
    candidates: tuple[str, ...],
    self_attention: bool = True,
) -> str:
    found = nearest_times(device, capability, key, direction, candidates, self_attention)
    if found is None and direction == DETERMINISTIC_BACKWARD:
        found = nearest_times(device, capability, key, "backward", candidates, self_attention)
    if found is None:
        return candidates[0]
    times = found[1]
    return min(times, key=times.get)


def fastest_backend(direction: str, inputs: MSDAInputs, candidates: tuple[str, ...]) -> str:
    """Of `candidates` (compiled backends able to run, in priority order), the fastest in `direction`
    at this shape or the nearest measured one; the first when nothing of this GPU's architecture
    was measured."""
    device = inputs.device
    return _fastest(
        device_name(device), device_capability(device), inputs_key(inputs), direction, candidates, self_attention(inputs)
    )


@functools.cache
def ranked_configs(
    device: str, capability: tuple[int, int], key: str, backend: str, direction: str, self_attention: bool = True
) -> tuple[str, ...]:
    """Compiled config names for this shape, best first: its own measurement, else the nearest
    measured shape of the same layout (dtype, heads, channels), whose variants are valid for it;
    else none."""
    target = ShapeKey.parse(key)
    best = None
    for measured_key, per_backend in measurements(device, capability).items():
        ranked = compiled_ranking(
            per_backend.get(backend, {}).get(direction) or [], backend, direction, target, self_attention
        )
        measured = ShapeKey.parse(measured_key)
        same_layout = (measured.dtype, measured.heads, measured.channels) == (target.dtype, target.heads, target.channels)
        if ranked and same_layout:
            rank = distance(target, measured)
            if best is None or rank < best[0]:
                best = (rank, ranked)
    return () if best is None else tuple(name for name, _ in best[1])


@torch.compiler.assume_constant_result
def _best_config(
    device: str, capability: tuple[int, int], key: str, backend: str, direction: str, self_attention: bool = True
) -> int:
    ranked = ranked_configs(device, capability, key, backend, direction, self_attention)
    if not ranked and direction == DETERMINISTIC_BACKWARD:
        ranked = ranked_configs(device, capability, key, backend, "backward", self_attention)
    return kernel_configs(backend, kernel_direction(direction)).index(ranked[0]) if ranked else -1


def kernel_config(backend: str, direction: str, inputs: MSDAInputs) -> int:
    """The tuned `config` index for this call, or -1 (the kernel's own heuristic)."""
    device = inputs.device
    if device.type != "cuda":
        return -1
    return _best_config(
        device_name(device), device_capability(device), inputs_key(inputs), backend, direction, self_attention(inputs)
    )


def clear_caches() -> None:
    """Forget loaded tables and lookups (after changing MMDEFORM_TMA_TUNING_TABLE or a table file)."""
    for cached in (load_tables, measurements, nearest_times, ranked_configs):
        cached.cache_clear()
