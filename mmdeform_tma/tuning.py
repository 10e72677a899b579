"""Autotuned kernel choices, read at run time.

`tools/autotune.py` times every compiled variant of each backend on a GPU, drops the ones that fail
the correctness check, and writes the best few per shape into `tuning_tables/<device>.json`. Here:
  - `kernel_config` gives the `config` index of the fastest variant for a call (-1: the kernel's
    own heuristic);
  - `preferred_backends` orders the compiled backends by measured time, which 'auto' follows.
`MMDEFORM_TMA_TUNING_TABLE=/path/table.json` adds a table of your own (it wins on equal keys).
Lookups are `assume_constant_result`: torch.compile resolves them once while tracing.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from ._extension import kernel_configs
from .inputs import MSDAInputs

TABLE_DIR = Path(__file__).with_name("tuning_tables")
TABLE_FORMAT = 1


def shape_key(dtype: torch.dtype, heads: int, channels: int, levels: int, points: int, work: int) -> str:
    """What a table entry is keyed on; `work` (batch x queries) is bucketed by powers of two."""
    return f"{str(dtype).removeprefix('torch.')}/h{heads}/c{channels}/l{levels}/p{points}/w{max(work, 1).bit_length()}"


def inputs_key(inputs: MSDAInputs) -> str:
    return shape_key(
        inputs.dtype, inputs.num_heads, inputs.channels, inputs.num_levels, inputs.num_points, inputs.batch * inputs.num_queries
    )


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@torch.compiler.assume_constant_result
def device_name(device: torch.device) -> str:
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def table_paths() -> list[Path]:
    paths = sorted(TABLE_DIR.glob("*.json"))
    extra = os.environ.get("MMDEFORM_TMA_TUNING_TABLE")
    return paths + ([Path(extra)] if extra else [])


@functools.cache
def load_tables() -> dict[str, dict[str, dict[str, dict[str, list[tuple[str, float]]]]]]:
    """device name -> shape key -> backend -> direction -> [(config name, median ms)], best first."""
    tables: dict = {}
    for path in table_paths():
        data = json.loads(path.read_text())
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"{path}: tuning table format {data.get('format')!r}, expected {TABLE_FORMAT}")
        per_device = tables.setdefault(data["device"], {})
        for entry in data["entries"]:
            ranked = [(choice["config"], float(choice["ms"])) for choice in entry["best"]]
            per_device.setdefault(entry["key"], {}).setdefault(entry["backend"], {})[entry["direction"]] = ranked
    return tables


@torch.compiler.assume_constant_result
def _best_config(device: str, key: str, backend: str, direction: str) -> int:
    ranked = load_tables().get(device, {}).get(key, {}).get(backend, {}).get(direction)
    names = kernel_configs(backend, direction)
    for config_name, _ in ranked or ():
        if config_name in names:
            return names.index(config_name)
    return -1


@torch.compiler.assume_constant_result
def _fastest_backends(device: str, key: str, with_backward: bool) -> tuple[str, ...]:
    directions = ("forward", "backward") if with_backward else ("forward",)
    totals = {}
    for backend, per_direction in load_tables().get(device, {}).get(key, {}).items():
        if all(per_direction.get(d) for d in directions):
            totals[backend] = sum(per_direction[d][0][1] for d in directions)
    return tuple(sorted(totals, key=totals.get))


def kernel_config(backend: str, direction: str, inputs: MSDAInputs) -> int:
    """The tuned `config` index for this call, or -1 (the kernel's own heuristic)."""
    if inputs.device.type != "cuda":
        return -1
    return _best_config(device_name(inputs.device), inputs_key(inputs), backend, direction)


def preferred_backends(inputs: MSDAInputs) -> tuple[str, ...]:
    """Compiled backends with measurements for this shape, fastest first."""
    if inputs.device.type != "cuda":
        return ()
    return _fastest_backends(device_name(inputs.device), inputs_key(inputs), inputs.needs_grad)
