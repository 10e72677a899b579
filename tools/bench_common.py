"""Shared pieces of the benchmark tools: environment record, timing, statistics, output files."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's commit; MMDEFORM_TMA_COMMIT names it where the tree travelled without .git."""
    if os.environ.get("MMDEFORM_TMA_COMMIT"):
        return os.environ["MMDEFORM_TMA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    import mmdeform_tma

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "mmdeform_tma": mmdeform_tma.__version__,
        "build": {k: v for k, v in vars(mmdeform_tma.build_info()).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    for package in ("mmcv", "mmengine", "mmdet"):
        try:
            env[package] = __import__(package).__version__
        except Exception:  # absent or broken: recorded as such
            env[package] = None
    return env


def measure_copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the DRAM ceiling to compare with."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def summarize(samples: list[float], unit: str = "ms") -> dict:
    ordered = sorted(samples)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        f"median_{unit}": statistics.median(ordered),
        f"p90_{unit}": pct(0.9),
        f"p99_{unit}": pct(0.99),
        "samples": len(ordered),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_wall_per_call(
    call: Callable[[], object], device: torch.device, calls: int, repeats: int, warmup: int
) -> list[float]:
    """Eager wall time per call in microseconds, one sample per repeat of `calls` back-to-back calls.
    The device is synchronised before and after each repeat, so a sample is the host's cost per
    call unless the device is the slower side (then it is the device's)."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(device)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return samples


class GcMeter:
    """Host time the cyclic garbage collector takes while the meter is active (`gc.callbacks`), and
    how many collections of each generation ran. A host-bound loop of identical steps whose p90 sits
    far above its median (Deformable DETR's fast path on an H100: 113 / 147 ms, 150 / 172 ms) has a
    stall in some iterations; collections of the oldest generation, over the millions of objects of
    a detector with compiled graphs, are one candidate this makes visible."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.collections = [0, 0, 0]
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.ms += (time.perf_counter() - self._started) * 1e3
            self.collections[info["generation"]] += 1
            self._started = None

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def interleaved_host_wall_per_call(
    calls_by_key: dict, device: torch.device, calls: int, repeats: int, warmup: int
) -> dict:
    """host_wall_per_call for several calls at once, their samples interleaved: each of `repeats`
    rounds takes one sample of every call, the order rotating from round to round. A host whose
    speed drifts (the H100 machine's did, by up to 1.7x between rows measured one after another:
    2026-11-23, commit 31a286d) then slows every call's samples alike, instead of the rows that
    happened to run during the slow spell. Returns key -> samples in microseconds per call."""
    keys = list(calls_by_key)
    for key in keys:
        for _ in range(warmup):
            calls_by_key[key]()
    samples: dict = {key: [] for key in keys}
    for round_ in range(repeats):
        shift = round_ % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            samples[key] += host_wall_per_call(calls_by_key[key], device, calls, repeats=1, warmup=0)
    return samples


@dataclass
class BoundCall:
    """One MSDA implementation bound to one input set, in that implementation's own convention."""

    leaves: tuple[torch.Tensor, ...]  # the differentiable inputs it takes
    run: Callable[..., torch.Tensor]  # leaves -> output (bs, queries, heads * channels)
    gradients: Callable[[tuple], dict]  # the leaves' gradients, named as in the accuracy records
    failures_are_results: bool = False  # a compared foreign kernel: its exceptions are recorded, not raised
    launch_spec: dict | None = None


class _BackendObserver(TorchDispatchMode):
    """Records which mmdeform_tma backend each direction ran, from the ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, list[str]] = {}
        self.configs: dict[str, list[int]] = {}  # the compiled op's `config` argument, per direction

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mmdeform_tma":
            op = func._opname
            direction = "forward" if op.endswith("_forward") else "backward" if op.endswith("_backward") else None
            if direction:
                names = [a.name for a in func._schema.arguments]
                if "backend" in names:
                    index = names.index("backend")
                    backend = kwargs["backend"] if "backend" in kwargs else args[index]
                else:  # per-backend ops: mmcv_forward, reference_backward, ...
                    backend = op.rpartition("_")[0].replace("reference", "pytorch")
                self.seen.setdefault(direction, []).append(backend)
                if "config" in names:
                    config = kwargs["config"] if "config" in kwargs else args[names.index("config")]
                    self.configs.setdefault(direction, []).append(config)
        return func(*args, **kwargs)


def observed_backends(call: Callable[[], object], configs: bool = False) -> dict[str, str]:
    """Run `call` once and name the backend each direction used ('unknown' where no mmdeform_tma
    op was seen): what 'auto' picked, whatever the dispatch logic behind it. With `configs`, also
    the kernel configs the compiled op was called with, per direction under 'forward config' and
    'backward config' ('-' where the ops take none; -1 is the kernel's own heuristic): two rows
    that ran the same backend can still differ there."""
    observer = _BackendObserver()
    with observer:
        call()
    seen = {
        direction: "+".join(dict.fromkeys(observer.seen[direction])) if direction in observer.seen else "unknown"
        for direction in ("forward", "backward")
    }
    if configs:
        for direction in ("forward", "backward"):
            numbers = observer.configs.get(direction)
            seen[f"{direction} config"] = "+".join(dict.fromkeys(map(str, numbers))) if numbers else "-"
    return seen


def time_calls(
    device: torch.device, calls: list[Callable[[], object]], warmup: int, iters: int, use_graphs: bool = True
) -> tuple[list[float], str]:
    """Time `calls` round-robin (one per rotated input set). On CUDA each call is captured in a
    CUDA graph when possible, so host-side Python does not pad short kernels; otherwise events
    around eager calls. The events of a chunk of calls are queued while a spin kernel holds the
    GPU (`held_chunks`), so no call waits for the host. Returns per-call milliseconds and the mode."""
    if device.type != "cuda":
        for i in range(warmup):
            calls[i % len(calls)]()
        samples = []
        for i in range(iters):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            samples.append((time.perf_counter() - t0) * 1e3)
        return samples, "cpu wall clock"

    runners, mode = calls, "cuda events, eager"
    if use_graphs:
        for attempt in range(2):  # a first capture can trip over one-time initialisation: retry once
            try:
                runners = [capture(call) for call in calls]
                mode = "cuda events, graph replay"
                break
            except Exception as exc:  # e.g. a call that synchronises with the host cannot be captured
                traceback.print_exc(file=sys.stderr)
                torch.cuda.synchronize()
                runners, mode = calls, f"cuda events, eager (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})"
        if runners is calls:
            print(f"warning: {mode}", file=sys.stderr)
    for i in range(warmup):
        runners[i % len(runners)]()
    torch.cuda.synchronize()
    samples, held = held_chunks(runners, iters)
    return samples, f"{mode}, {'queue held' if held else 'host-bound (the queue could not be held)'}"


# Sessions 29 and 30 timed one graph replay between two events with the host queueing as the GPU
# ran: a sub-20 us decoder call whose replay the host had not yet submitted counted the wait as
# GPU time (0.0159 ms, p90 0.0285, for a 0.0120 ms kernel; docs/perf_notes.md, session 31). Holding
# the GPU in a spin kernel while the host queues a chunk puts every call's launch in the queue
# before the GPU reaches it.
HOLD_MARGIN = 2.0  # the hold lasts this many times the host's measured queueing time
MIN_HOLD_MS = 0.5
MAX_HOLD_MS = 50.0


def hold_plan(host_ms_per_call: float, iters: int) -> tuple[int, float]:
    """Chunk size and hold (ms) for calls that take `host_ms_per_call` to queue: as many calls per
    chunk as a hold of at most MAX_HOLD_MS covers with the margin, at least one."""
    per_call = max(host_ms_per_call, 1e-4)
    chunk = max(1, min(iters, int(MAX_HOLD_MS / (HOLD_MARGIN * per_call))))
    return chunk, min(MAX_HOLD_MS, max(MIN_HOLD_MS, HOLD_MARGIN * per_call * chunk))


def spin_cycles_per_ms() -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond, measured with events."""
    cycles = 2_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # the first launch pays the kernel's load
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def held_chunks(runners: list[Callable[[], object]], iters: int, retries: int = 2) -> tuple[list[float], bool]:
    """Per-call milliseconds of `iters` calls, each between its own events, queued in chunks behind
    a spin kernel. A chunk whose queueing outlasted its hold is timed again with twice the hold;
    returns False with the samples when one still did not fit (the call synchronises with the host,
    or its host cost exceeds MAX_HOLD_MS)."""
    cycles_per_ms = spin_cycles_per_ms()
    torch.cuda._sleep(int(MAX_HOLD_MS * cycles_per_ms))
    t0 = time.perf_counter()
    probe = min(iters, 4)
    for i in range(probe):
        runners[i % len(runners)]()
    host_ms = (time.perf_counter() - t0) * 1e3 / probe
    torch.cuda.synchronize()
    chunk, hold_ms = hold_plan(host_ms, iters)
    samples: list[float] = []
    held = True
    while len(samples) < iters:
        first, size = len(samples), min(chunk, iters - len(samples))
        for attempt in range(retries + 1):
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(size)]
            torch.cuda._sleep(int(hold_ms * cycles_per_ms))
            t0 = time.perf_counter()
            for i, (start, end) in enumerate(pairs):
                start.record()
                runners[(first + i) % len(runners)]()
                end.record()
            queued_ms = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            if queued_ms < hold_ms:
                break
            if attempt == retries:
                held = False
            hold_ms = min(MAX_HOLD_MS, 2 * hold_ms)
        samples += [start.elapsed_time(end) for start, end in pairs]
    return samples, held


def warm_up_gpu(device: torch.device, seconds: float = 1.0) -> None:
    """Keep the GPU busy before the first measurement: in one H100 run the first rows of a fresh
    process (decoder-sized calls) came out 2-4x slower than the same calls measured later."""
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a = (a @ a).tanh_()
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def side_stream(device: torch.device):
    """A side stream as the current one while a benchmark makes its inputs and runs, the previous
    one after. A backward runs on its forward's stream and is joined back to it, so a forward on the
    legacy default stream makes every captured backward fail ('operation would make the legacy
    stream depend on a capturing blocking stream'): the first backward row of every operator run
    since at least session 15 was timed eagerly, 0.156 against 0.057 ms for a decoder backward in
    graphs (H100, torch 2.11, 2026-11-24; docs/perf_notes.md, item 39). The rows after it captured
    only because the failed capture had left its own stream current."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.current_stream(device)
    torch.cuda.set_stream(torch.cuda.Stream(device))
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        torch.cuda.set_stream(previous)


def capture(call: Callable[[], object]) -> Callable[[], None]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up allocations and lazy initialisation outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def console_table(header: list[str], rows: list[list[object]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in [header, *rows])


def progress(iterable, total: int, description: str):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=description, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return iterable
