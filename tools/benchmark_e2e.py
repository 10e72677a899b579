"""End-to-end benchmark: a real mmdet detector, built from its config, per MSDA backend and precision.

    python tools/benchmark_e2e.py                                   # synthetic Deformable DETR, bs 2, 800x1216
    python tools/benchmark_e2e.py --config configs/synthetic/dino-4scale_r50_synthetic_tma-ws.py
    python tools/benchmark_e2e.py --device cpu                      # tiny config, reference backend
    python tools/benchmark_e2e.py --backends stock auto --fast-backends auto --precisions amp-fp16 --repeats 3
    python tools/benchmark_e2e.py --backends stock --fast-backends auto --compile-mode default reduce-overhead \
        --compile-scope layers network                              # four fast variants
    python tools/benchmark_e2e.py --backends stock --fast-backends auto --compile-shapes automatic static
                                                                    # automatic dynamic shapes against static
    python tools/benchmark_e2e.py --backends stock --fast-backends auto --fast-targets batched mmdet
                                                                    # batched head targets against mmdet's
    python tools/benchmark_e2e.py --backends stock auto --fast-backends --precisions amp-fp16 --paired 10 --iters 10
                                                                    # default path against stock, side by side

For each backend ('stock' is mmcv's own, unpatched MultiScaleDeformableAttention.forward) and
precision (fp32, amp-fp16, amp-bf16) it reports the training iteration time (forward, backward and
optimizer step, synchronised), inference ms/batch and images/s, peak memory, and the loss over N
steps from the same seed and batches, compared with mmcv's. Inputs are synthetic batches (random
boxes on random images) pushed through the model's own data preprocessor. Writes JSON, Markdown
and a PNG chart. `--fast-backends` adds rows on the fast training path (tools/train.py --fast), one
per `--compile-mode` and `--compile-scope` given; `--repeats` runs every variant that many times,
the rounds interleaved, and reports the spread. Fast rows freeze the heap after their warm-up as the
fast path's hook does (`gc.freeze`; `--no-gc-freeze` leaves it), and unfreeze it when done.

What bounds a training iteration, from a torch.profiler trace of a few iterations (CPU and CUDA
activity; each iteration in a record_function range): the GPU kernel time (sum of kernel
durations), kernel launches (cudaLaunch*/cuLaunch* calls), host synchronisations
(cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy) and
the host time blocked in them (waiting for the GPU), scalar reads (aten::_local_scalar_dense: .item(), bool(tensor), ...) and the MSDA kernels' share of
the kernel time, all per iteration. Against the un-profiled wall time: 'GPU/wall' below
BOUND_THRESHOLD means the GPU idles while the host works, i.e. the run is host-bound. The same
trace splits the host's iteration into phases (data preprocessor, backbone and neck, transformer,
head and loss with the targets and the assigner inside it, backward, optimizer step): each phase's host time,
launches, synchronisations, time waiting in them and scalar reads, so a host-bound run shows
where the host goes, and whether it works or waits there.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import gc
import itertools
import re
import statistics
import sys
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from synthetic_batches import batch_for_config  # noqa: E402

import mmdeform_tma  # noqa: E402

PRECISIONS = {"fp32": None, "amp-fp16": "float16", "amp-bf16": "bfloat16"}
MSDA_KERNELS = re.compile(r"mmdeform_tma|portable::|tma_kernel|tma_ws_kernel|tma_ws::|fixed_point|ms_deformable")
# the reference backend's MSDA is grid_sample; only then are those kernels MSDA's (Mask2Former's
# point-sampled mask loss runs grid_sampler too)
REFERENCE_MSDA_KERNELS = re.compile(MSDA_KERNELS.pattern + "|grid_sampler")
STEP_RANGE = "benchmark_e2e::train_step"
PHASE_PREFIX = "benchmark_e2e::phase::"  # the record_function ranges of phase_targets()
NESTED_PHASES = ("targets", "assigner")  # inside 'head + loss': not added again to the iteration's sum
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch")
GRAPH_LAUNCH = "cudaGraphLaunch"  # CUDA-graph replays (reduce-overhead), counted among the launches too
HOST_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALAR_READ = "aten::_local_scalar_dense"  # what .item(), bool(tensor) and friends run
COPY_OR_FILL = ("Memcpy", "Memset")  # device activities that are not kernels
BOUND_THRESHOLD = 0.8  # GPU kernel time below this share of the wall time: host-bound
DEFAULT_CONFIG = {
    "cuda": "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py",
    "cpu": "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py",
}


def build_model(config_path: str, backend: str, device: torch.device, seed: int, fast: dict | None = None):
    """The detector from its config, every MSDA module switched to `backend` (None: mmcv's own).
    With `fast` (`mode`, `scope` and torch.compile arguments) the config is switched to the fast
    training path first (fast_training.fast_training_config) and the model is compiled."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmcv.ops import MultiScaleDeformableAttention

    from mmdet.registry import MODELS

    cfg = Config.fromfile(config_path)
    init_default_scope(cfg.get("default_scope", "mmdet"))
    if fast is not None:
        from mmdeform_tma.integrations import fast_training

        fast_training.fast_training_config(
            cfg,
            compile_mode=fast["mode"],
            compile_scope=fast["scope"],
            batched_targets=fast.get("batched_targets", True),
        )
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None  # offline, and the same random init for every backend
    torch.manual_seed(seed)
    model = MODELS.build(model_cfg)
    model.init_weights()
    for module in model.modules():
        if isinstance(module, MultiScaleDeformableAttention):
            module.backend = None if backend == "stock" else backend
    model = model.to(device)
    if fast is not None:
        fast_training.apply_fast_path(model, **fast)
    return model, cfg


def as_loaded(batch: dict, cfg, device: torch.device) -> dict:
    """`batch` as the config's training data loader hands it over: on a GPU, its images in pinned
    memory when the loader pins (the fast path's does; torch's pinning reaches the tensors, not
    mmdet's data samples)."""
    if device.type != "cuda" or not cfg.get("train_dataloader", {}).get("pin_memory", False):
        return batch
    return {**batch, "inputs": [image.pin_memory() for image in batch["inputs"]]}


def make_optim_wrapper(model, cfg, precision: str):
    from mmengine.optim import build_optim_wrapper

    optim_cfg = copy.deepcopy(cfg.optim_wrapper)
    if PRECISIONS[precision]:
        optim_cfg.type = "AmpOptimWrapper"
        optim_cfg.loss_scale = "dynamic"
        optim_cfg.dtype = PRECISIONS[precision]
    return build_optim_wrapper(model, optim_cfg)


def time_loop(step, iters: int, device: torch.device) -> list[float]:
    """Milliseconds per synchronised step."""
    return [us / 1e3 for us in bench_common.host_wall_per_call(step, device, calls=1, repeats=iters, warmup=0)]


@dataclass(frozen=True)
class TraceEvent:
    """The part of a profiler event the breakdown needs (tests build these by hand)."""

    name: str
    on_device: bool  # a GPU activity (kernel, copy, fill); else a host event (op, runtime call, range)
    start_us: float
    duration_us: float


def iteration_breakdown(events: list[TraceEvent], msda_kernels: re.Pattern = MSDA_KERNELS) -> dict:
    """Per-iteration GPU kernel time, kernels, launches, host synchronisations, scalar reads and
    MSDA share, from a trace whose iterations are each inside a STEP_RANGE range. Host events
    outside those ranges (the profiler's own synchronisation at the end) are not counted."""
    steps = [(e.start_us, e.start_us + e.duration_us) for e in events if e.name == STEP_RANGE and not e.on_device]
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} ranges in the trace")
    in_steps = [e for e in events if not e.on_device and any(start <= e.start_us <= end for start, end in steps)]
    host = Counter(e.name for e in in_steps)
    kernels = [e for e in events if e.on_device and not e.name.startswith(COPY_OR_FILL)]
    kernel_us = sum(k.duration_us for k in kernels)
    msda_us = sum(k.duration_us for k in kernels if msda_kernels.search(k.name))
    n = len(steps)
    syncs = {name: host[name] / n for name in HOST_SYNC_CALLS}
    return {
        "gpu_kernel_ms": kernel_us / 1e3 / n,
        "gpu_kernels": len(kernels) / n,
        "kernel_launches": sum(count for name, count in host.items() if name.startswith(LAUNCH_PREFIXES)) / n,
        "graph_launches": sum(count for name, count in host.items() if name.startswith(GRAPH_LAUNCH)) / n,
        "host_syncs": sum(syncs.values()),
        "sync_calls": syncs,
        "sync_wait_ms": sync_wait_ms(in_steps) / n,
        "scalar_reads": host[SCALAR_READ] / n,
        "msda_share_pct": 100.0 * msda_us / kernel_us if kernel_us else None,
        "host_phases": phase_breakdown(events, steps),
    }


def sync_wait_ms(events) -> float:
    """Host milliseconds spent inside synchronising calls: the host waiting for the GPU (a
    synchronous copy's transfer included, microseconds for the scalars these are)."""
    return sum(e.duration_us for e in events if e.name in HOST_SYNC_CALLS) / 1e3


def host_counts(events) -> dict:
    events = list(events)
    return {
        "launches": sum(e.name.startswith(LAUNCH_PREFIXES) for e in events),
        "syncs": sum(e.name in HOST_SYNC_CALLS for e in events),
        "wait_ms": sync_wait_ms(events),
        "scalar_reads": sum(e.name == SCALAR_READ for e in events),
    }


def phase_breakdown(events: list[TraceEvent], steps: list[tuple[float, float]]) -> dict:
    """Per iteration, for each phase range (PHASE_PREFIX) and for the rest of the step ('other'):
    host ms, and the launches, synchronisations (their count, and the ms the host waited in them)
    and scalar reads that started inside it. A range
    covers every thread's events in its time span (the backward's launches run on autograd's).
    Profiling slows the host, so the times are larger than un-profiled ones; the shares hold."""
    host = sorted((e for e in events if not e.on_device and not e.name.startswith((STEP_RANGE, PHASE_PREFIX))), key=lambda e: e.start_us)
    starts = [e.start_us for e in host]

    def inside(start: float, end: float) -> list[TraceEvent]:
        return host[bisect.bisect_left(starts, start) : bisect.bisect_right(starts, end)]

    n = len(steps)
    phases: dict[str, dict] = {}
    top_level_spans = []
    for e in events:
        if e.on_device or not e.name.startswith(PHASE_PREFIX):
            continue
        label = e.name[len(PHASE_PREFIX):]
        end = e.start_us + e.duration_us
        totals = phases.setdefault(label, {"host_ms": 0.0, "calls": 0, **host_counts([])})
        totals["host_ms"] += e.duration_us / 1e3
        totals["calls"] += 1
        for key, value in host_counts(inside(e.start_us, end)).items():
            totals[key] += value
        if label not in NESTED_PHASES:
            top_level_spans.append((e.start_us, end))
    if not phases:
        return {}
    step_ms = sum(end - start for start, end in steps) / 1e3
    other = {"host_ms": step_ms - sum(v["host_ms"] for k, v in phases.items() if k not in NESTED_PHASES), "calls": n}
    in_phases = Counter()
    for start, end in top_level_spans:
        in_phases.update(host_counts(inside(start, end)))
    for key, value in host_counts(e for start, end in steps for e in inside(start, end)).items():
        other[key] = value - in_phases[key]
    phases["other"] = other
    return {label: {key: value / n for key, value in totals.items()} for label, totals in phases.items()}


def phase_targets(model, optim_wrapper) -> list[tuple[str, object, str]]:
    """(label, object, method name) of the training step's phases this model has: mmdet's
    detectors call these through attribute lookups, so wrapping them on the instance times them."""
    head = getattr(model, "bbox_head", None) or getattr(model, "panoptic_head", None)
    candidates = [
        ("data preprocessor", getattr(model, "data_preprocessor", None), "forward"),
        ("backbone + neck", model, "extract_feat"),
        ("transformer", model, "forward_transformer"),
        ("head + loss", head, "loss"),
        ("targets", head, "get_targets"),  # mmdet's or the fast path's batched (the assigner inside)
        ("targets", head, "get_dn_targets"),  # DINO's denoising targets
        ("assigner", getattr(head, "assigner", None), "assign"),
        ("backward", optim_wrapper, "backward"),
        ("optimizer step", optim_wrapper, "step"),
        ("zero grad", optim_wrapper, "zero_grad"),
    ]
    return [(label, obj, name) for label, obj, name in candidates if obj is not None and callable(getattr(obj, name, None))]


@contextlib.contextmanager
def phase_ranges(targets: list[tuple[str, object, str]]):
    """Wraps each target method, on its instance only, in a record_function range."""
    from torch.profiler import record_function

    patched = []
    try:
        for label, obj, name in targets:
            original = getattr(obj, name)

            def timed(*args, _original=original, _range=PHASE_PREFIX + label, **kwargs):
                with record_function(_range):
                    return _original(*args, **kwargs)

            had_own = name in vars(obj)
            patched.append((obj, name, had_own, vars(obj).get(name)))
            setattr(obj, name, timed)
        yield
    finally:
        for obj, name, had_own, own in reversed(patched):
            if had_own:
                setattr(obj, name, own)
            else:
                delattr(obj, name)


def trace_events(function_events) -> list[TraceEvent]:
    """TraceEvents of a profile's `events()`, without the GPU copies of record_function ranges
    (gpu_user_annotation: they span kernels, they are not kernels)."""
    from torch.autograd import DeviceType

    events = []
    for e in function_events:
        on_device = e.device_type != DeviceType.CPU
        if not (on_device and getattr(e, "is_user_annotation", False)):
            events.append(TraceEvent(e.name, on_device, e.time_range.start, e.time_range.elapsed_us()))
    return events


def profile_iterations(
    step, iters: int, device: torch.device, msda_kernels: re.Pattern = MSDA_KERNELS, phases: list | None = None
) -> dict:
    """iteration_breakdown of `iters` profiled steps, with the host time of `phases`
    (phase_targets); on the CPU only the host counts mean anything."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with phase_ranges(phases or []), profile(activities=activities) as prof:
        for _ in range(iters):
            with record_function(STEP_RANGE):
                step()
        bench_common.synchronize(device)
    breakdown = iteration_breakdown(trace_events(prof.events()), msda_kernels)
    if device.type != "cuda":  # no device: no kernels, launches or synchronisations to count
        breakdown.update(
            gpu_kernel_ms=None, gpu_kernels=None, kernel_launches=None, graph_launches=None, host_syncs=None, sync_calls={},
            sync_wait_ms=None,
        )
    return breakdown


@dataclass
class Result:
    backend: str
    precision: str
    fast: bool = False  # the fast training path (tools/train.py --fast)
    repeat: int = 0  # which round of the interleaved runs
    compile_mode: str | None = None  # the fast path's torch.compile mode, scope and shapes
    compile_scope: str | None = None
    compile_shapes: str | None = None  # 'automatic' (torch's automatic dynamic shapes) or 'static'
    targets: str | None = None  # the head's targets: 'batched' (the fast path's) or 'mmdet' (per image)
    train_ms: dict = field(default_factory=dict)
    infer_ms: dict = field(default_factory=dict)
    images_per_s: float | None = None
    peak_memory_mb: float | None = None
    # the caching allocator's peak reservation: CUDA-graph pools included, which the peak of
    # allocated tensors above misses (graph replays allocate nothing)
    peak_reserved_mb: float | None = None
    msda_share_pct: float | None = None
    # per training iteration, from the profiled iterations (see iteration_breakdown)
    gpu_kernel_ms: float | None = None
    gpu_kernels: float | None = None
    kernel_launches: float | None = None
    graph_launches: float | None = None
    host_syncs: float | None = None
    sync_calls: dict = field(default_factory=dict)
    sync_wait_ms: float | None = None  # host time blocked in those synchronisations
    scalar_reads: float | None = None
    # per timed training iteration: the cyclic garbage collector's host time, and its collections of
    # the oldest generation (bench_common.GcMeter)
    gc_ms: float | None = None
    gc_full_collections: float | None = None
    host_phases: dict = field(default_factory=dict)  # label -> host_ms, launches, syncs, wait_ms, scalar_reads
    gpu_over_wall_pct: float | None = None
    compiled_graphs: int | None = None  # fast rows: graphs torch.compile made over the whole run
    bound: str | None = None  # 'host' or 'GPU'
    losses: list = field(default_factory=list)
    max_loss_rel_diff_vs_mmcv: float | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        if not self.fast:
            return self.backend
        return fast_label(self.backend, self.compile_mode, self.compile_scope, self.compile_shapes, self.targets)


COMPILE_SHAPES = ("automatic", "static")  # torch.compile(dynamic=None) or dynamic=False
TARGETS = ("batched", "mmdet")  # the fast path's batched head targets, or mmdet's per image


def fast_label(
    backend: str, mode: str | None, scope: str | None, shapes: str | None = None, targets: str | None = None
) -> str:
    """'auto+fast' on the fast path's defaults, else with the mode, scope, shapes and targets that differ."""
    from mmdeform_tma.integrations.fast_training import DEFAULT_COMPILE_MODE, DEFAULT_COMPILE_SCOPE

    defaults = (
        (mode, DEFAULT_COMPILE_MODE),
        (scope, DEFAULT_COMPILE_SCOPE),
        (shapes, COMPILE_SHAPES[0]),
        (targets, TARGETS[0]),
    )
    differ = [f"{v}-targets" if v in TARGETS else v for v, default in defaults if v and v != default]
    return f"{backend}+fast" + (f"[{','.join(differ)}]" if differ else "")


def run_one(
    args,
    backend: str,
    precision: str,
    device: torch.device,
    fast: tuple[str, str, str, str] | None = None,
    repeat: int = 0,
) -> Result:
    """One variant: `fast` is None (eager) or the fast path's (compile mode, scope, shapes, targets)."""
    mode, scope, shapes, targets = fast or (None, None, None, None)
    result = Result(backend, precision, fast is not None, repeat, mode, scope, shapes, targets)
    fast_options = dict(
        mode=mode,
        scope=scope,
        batched_targets=targets != "mmdet",
        **({"backend": args.compile_backend} if args.compile_backend else {}),
    )
    if shapes == "static":
        fast_options["dynamic"] = False
    if fast:
        from torch._dynamo.utils import counters

        counters.clear()  # compiled_graphs below counts this run's graphs
    model, cfg = build_model(args.config, backend, device, args.seed, fast_options if fast else None)
    sizes = args.image_sizes
    batches = [
        as_loaded(batch_for_config(cfg, args.batch, *sizes[i % len(sizes)], device, args.seed + i), cfg, device)
        for i in range(max(args.parity_steps, len(sizes)))
    ]
    optim_wrapper = make_optim_wrapper(model, cfg, precision)
    model.train()
    torch.manual_seed(args.seed)  # dropout draws the same numbers for every backend
    for batch in batches[: args.parity_steps]:  # loss parity: the first steps, from the same init and batches
        losses = model.train_step(batch, optim_wrapper)
        result.losses.append(float(losses["loss"]))
    rotation = itertools.cycle(batches[: len(sizes)])  # one batch per image size, in turn
    train_step = training_step(model, optim_wrapper, rotation)
    for _ in range(args.warmup * len(sizes)):  # each size: compiled, then graphed, then warm
        train_step()
    frozen = fast is not None and args.gc_freeze
    set_heap_frozen(frozen)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with bench_common.GcMeter() as gc_meter:
        result.train_ms = bench_common.summarize(time_loop(train_step, args.iters, device))
    result.gc_ms = gc_meter.ms / args.iters
    result.gc_full_collections = gc_meter.collections[2] / args.iters
    if device.type == "cuda":
        result.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
        result.peak_reserved_mb = torch.cuda.max_memory_reserved(device) / 2**20
    msda_kernels = REFERENCE_MSDA_KERNELS if backend == "pytorch" else MSDA_KERNELS
    phases = phase_targets(model, optim_wrapper)
    breakdown = profile_iterations(train_step, min(args.profile_iters, args.iters), device, msda_kernels, phases)
    for key, value in breakdown.items():
        setattr(result, key, value)
    if result.gpu_kernel_ms is not None:
        result.gpu_over_wall_pct = 100.0 * result.gpu_kernel_ms / result.train_ms["median_ms"]
        result.bound = "GPU" if result.gpu_over_wall_pct >= 100 * BOUND_THRESHOLD else "host"

    model.eval()
    infer_step = inference_step(model, rotation, precision, device)
    for _ in range(args.warmup * len(sizes)):
        infer_step()
    set_heap_frozen(frozen)  # again: the profiler, or a library, may have frozen or unfrozen it since
    result.infer_ms = bench_common.summarize(time_loop(infer_step, args.iters, device))
    result.images_per_s = args.batch / (result.infer_ms["median_ms"] / 1e3)
    if fast:
        result.compiled_graphs = counters["stats"]["unique_graphs"]
    return result


def set_heap_frozen(frozen: bool) -> None:
    """The heap as a timed loop of this row must see it: frozen as the fast path's hook leaves it once
    warm (`gc.freeze`; main unfreezes after the row), or unfrozen. Set before each timed loop, not
    once: on the H100 image (torch 2.11) something between the training and the inference timing
    froze the heap of stock rows too (tests/tools/test_benchmark_tools.py, 2026-11-24)."""
    if frozen:
        from mmdeform_tma.integrations import fast_training

        fast_training.freeze_long_lived_objects()
    else:
        gc.unfreeze()


def training_step(model, optim_wrapper, rotation):
    def step():
        model.train_step(next(rotation), optim_wrapper)

    return step


def inference_step(model, rotation, precision: str, device: torch.device):
    amp_dtype = getattr(torch, PRECISIONS[precision] or "float32")

    def step():
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=PRECISIONS[precision] is not None):
            model.test_step(next(rotation))

    return step


def run_paired(args, backends: list[str], precision: str, device: torch.device):
    """Eager variants measured side by side, for a host whose speed drifts between runs (on the
    H100 machine one stock configuration's separate runs spread 245-317 ms). Every variant's model
    is built once and held; then each of `args.paired` rounds times a block of `args.iters` training
    steps of every variant, then a block of inference steps, the order rotating from round to
    round. A drift slower than a round hits the variants of that round alike, so the per-round
    ratio to stock (paired_ratios) is far tighter than the ratio of separate runs. Yields each
    round's Results, one per variant, without the profiled breakdown (which would perturb the rounds)."""
    held = []
    for backend in backends:
        model, cfg = build_model(args.config, backend, device, args.seed)
        batches = [
            batch_for_config(cfg, args.batch, h, w, device, args.seed + i) for i, (h, w) in enumerate(args.image_sizes)
        ]
        optim_wrapper = make_optim_wrapper(model, cfg, precision)
        rotation = itertools.cycle(batches)
        held.append((backend, model, training_step(model, optim_wrapper, rotation),
                     inference_step(model, rotation, precision, device)))
    for _, model, train_step, infer_step in held:
        model.train()
        for _ in range(args.warmup * len(args.image_sizes)):
            train_step()
        model.eval()
        for _ in range(args.warmup * len(args.image_sizes)):
            infer_step()
    for round_ in range(args.paired):
        order = held[round_ % len(held):] + held[: round_ % len(held)]
        timed = {backend: Result(backend, precision, repeat=round_) for backend, *_ in held}
        for backend, model, train_step, _ in order:
            model.train()
            timed[backend].train_ms = bench_common.summarize(time_loop(train_step, args.iters, device))
        for backend, model, _, infer_step in order:
            model.eval()
            timed[backend].infer_ms = bench_common.summarize(time_loop(infer_step, args.iters, device))
            timed[backend].images_per_s = args.batch / (timed[backend].infer_ms["median_ms"] / 1e3)
        yield [timed[backend] for backend, *_ in held]


def paired_ratios(results: list[Result]) -> list[dict]:
    """Per variant and precision: each round's median time over stock's in the same round, for
    training and inference; the median of those ratios and their smallest and largest."""
    rows = []
    for label, precision in dict.fromkeys((r.label, r.precision) for r in results if r.label != "stock"):
        ratios = {"train": [], "infer": []}
        for r in results:
            if (r.label, r.precision) != (label, precision) or r.error:
                continue
            stock = next(
                (s for s in results if (s.label, s.precision, s.repeat) == ("stock", precision, r.repeat) and not s.error),
                None,
            )
            for kind in ratios:
                mine, base = getattr(r, f"{kind}_ms"), getattr(stock, f"{kind}_ms", None) if stock else None
                if mine and base:
                    ratios[kind].append(mine["median_ms"] / base["median_ms"])
        if ratios["train"] or ratios["infer"]:
            row = dict(label=label, precision=precision, rounds=len(ratios["train"]))
            for kind, values in ratios.items():
                row[f"{kind}_ratio"] = statistics.median(values) if values else None
                row[f"{kind}_ratio_min"] = min(values) if values else None
                row[f"{kind}_ratio_max"] = max(values) if values else None
                row[f"{kind}_rounds_slower"] = sum(v > 1.0 for v in values)
            rows.append(row)
    return rows


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'800x1216' or '800x1216,640x1024,...': the sizes the runs rotate through."""
    try:
        sizes = [tuple(int(x) for x in size.split("x")) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(size) != 2 or min(size) <= 0 for size in sizes):
        raise ValueError(f"image sizes must be HxW[,HxW...], got {text!r}")
    return sizes


def default_image_size(config_path: str, gpu: bool) -> str:
    """800x1216 on a GPU (128x128 on the CPU), or the config's fixed training pad size where it
    has one (Mask2Former's 1024x1024), so training and inference see the same images."""
    from mmengine.config import Config
    from synthetic_batches import fixed_pad_size

    fixed = fixed_pad_size(Config.fromfile(config_path)) if gpu else None
    return f"{fixed[0]}x{fixed[1]}" if fixed else ("800x1216" if gpu else "128x128")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="mmdet config (default: synthetic Deformable DETR; tiny on CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--backends", nargs="*", help="default: stock plus every available backend; none given: fast rows only")
    p.add_argument(
        "--fast-backends", nargs="*", default=None,
        help="backends also run on the fast training path (default on a GPU: auto; none on the CPU)",
    )
    p.add_argument("--compile-mode", nargs="+", default=None, help="torch.compile mode(s) of the fast path")
    p.add_argument(
        "--compile-scope", nargs="+", default=None, help="what the fast path compiles: layers, network, network+decoder (one row each)"
    )
    p.add_argument(
        "--compile-shapes", nargs="+", choices=COMPILE_SHAPES, default=[COMPILE_SHAPES[0]],
        help="automatic: torch's automatic dynamic shapes (the fast path's); static: dynamic=False (one row each)",
    )
    p.add_argument(
        "--fast-targets", nargs="+", choices=TARGETS, default=[TARGETS[0]],
        help="batched: the fast path's head targets, all images at once; mmdet: mmdet's, per image (one row each)",
    )
    p.add_argument("--compile-backend", default=None, help=argparse.SUPPRESS)  # tests trace with aot_eager on the CPU
    p.add_argument("--precisions", nargs="*", choices=list(PRECISIONS), default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--image-size", default=None,
        help="HxW (default 800x1216 on GPU, 128x128 on CPU), or HxW,HxW,... to rotate through several "
        "(what multi-scale training does to compiled graphs: each size is warmed up first)",
    )
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--parity-steps", type=int, default=None)
    p.add_argument("--profile-iters", type=int, default=3, help="profiled iterations for the per-iteration breakdown")
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="fast rows: leave the heap unfrozen after warm-up (the fast path freezes it: gc.freeze)",
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds of all runs, interleaved; the table gives the spread")
    p.add_argument(
        "--paired", type=int, default=0, metavar="ROUNDS",
        help="eager --backends side by side: every model held at once, ROUNDS rounds each timing a block of "
        "--iters steps per variant, the order rotating; reports each round's ratio to stock (needs 'stock')",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/e2e"))
    args = p.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = args.device.type == "cuda"
    args.config = args.config or DEFAULT_CONFIG[args.device.type]
    args.precisions = args.precisions or (list(PRECISIONS) if gpu else ["fp32"])
    if args.paired:
        if args.fast_backends:
            p.error("--paired holds every model at once and measures eager backends; run the fast path's rows without it")
        if not args.backends or "stock" not in args.backends or len(args.backends) < 2:
            p.error("--paired needs 'stock' and at least one other eager backend in --backends")
        args.fast_backends = []
    args.fast_backends = args.fast_backends if args.fast_backends is not None else (["auto"] if gpu else [])
    from mmdeform_tma.integrations import fast_training

    args.compile_mode = args.compile_mode or [fast_training.DEFAULT_COMPILE_MODE]
    args.compile_scope = args.compile_scope or [fast_training.DEFAULT_COMPILE_SCOPE]
    for mode in args.compile_mode:
        fast_training.check_choice("mode", mode, fast_training.COMPILE_MODES)
    for scope in args.compile_scope:
        fast_training.check_choice("scope", scope, fast_training.COMPILE_SCOPES)
    args.batch = args.batch or (2 if gpu else 1)
    args.image_sizes = parse_image_sizes(args.image_size or default_image_size(args.config, gpu))
    args.iters = args.iters or (20 if gpu else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.parity_steps = args.parity_steps or (10 if gpu else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.type != "cuda":
        print(f"no GPU: running {args.config} on the CPU with the reference backend", file=sys.stderr)
    backends = args.backends if args.backends is not None else ["stock", *mmdeform_tma.available_backends(device)]
    env = bench_common.environment(device)
    env.update(
        config=args.config, batch=args.batch, image_size=",".join(f"{h}x{w}" for h, w in args.image_sizes),
        compile_mode=args.compile_mode, compile_scope=args.compile_scope, compile_shapes=args.compile_shapes,
        fast_targets=args.fast_targets,
        repeats=args.repeats, paired_rounds=args.paired, fast_rows_gc_frozen=args.gc_freeze,
    )
    if args.paired:
        results = []
        for precision in args.precisions:
            try:
                for round_results in run_paired(args, backends, precision, device):
                    results.extend(round_results)
                    write_outputs(args.out, env, results)  # after every round: a timeout keeps what was measured
            except Exception as exc:  # noqa: BLE001 - reported as error rows, like the separate runs'
                print(f"e2e: paired {precision} failed:\n{traceback.format_exc()}", file=sys.stderr)
                results.extend(Result(b, precision, error=f"{type(exc).__name__}: {str(exc)[:300]}") for b in backends)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_outputs(args.out, env, results)
        print(format_table(results))
        print(f"\nwrote {args.out}.json, {args.out}.md, {args.out}.png  ({env['device']}, commit {env['commit']})")
        return 0
    results: list[Result] = []
    fast_options = [
        (m, s, d, t)
        for m in args.compile_mode
        for s in args.compile_scope
        for d in args.compile_shapes
        for t in args.fast_targets
    ]
    variants = [(b, None) for b in backends] + [(b, f) for b in args.fast_backends for f in fast_options]
    # round-robin: each round runs every variant once, so drift of the machine hits all alike
    jobs = [(r, b, f, p) for r in range(args.repeats) for b, f in variants for p in args.precisions]
    for repeat, backend, fast, precision in bench_common.progress(jobs, len(jobs), "e2e"):
        try:
            results.append(run_one(args, backend, precision, device, fast, repeat))
        except Exception as exc:  # noqa: BLE001 - one variant's failure is a row of the table, not the run's end
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"e2e: {backend} {precision} fast={fast} failed:\n{traceback.format_exc()}", file=sys.stderr)
            results.append(Result(backend, precision, fast is not None, repeat, *(fast or ()), error=message))
        gc.unfreeze()  # the next variant starts from an unfrozen heap, and this one's garbage is collectable
        if fast is not None:
            torch._dynamo.reset()  # also CUDA-graph trees: global state the next variant must not inherit
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model is gone with run_one's frame
        compare_losses(results)
        write_outputs(args.out, env, results)  # after every run: a timeout keeps what was measured
    print(format_table(results))
    print(f"\nwrote {args.out}.json, {args.out}.md, {args.out}.png  ({env['device']}, commit {env['commit']})")
    return 0


def compare_losses(results: list[Result]) -> None:
    """Each run's largest relative loss difference against stock (else the mmcv backend)."""
    for r in results:
        base = next((b for b in results if b.label == "stock" and b.precision == r.precision and b.losses), None)
        base = base or next((b for b in results if b.label == "mmcv" and b.precision == r.precision and b.losses), None)
        if base and r.losses:
            r.max_loss_rel_diff_vs_mmcv = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, base.losses))


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_runs(results: list[Result]) -> list[dict]:
    """One row per (variant, precision): medians over the repeats, the spread of the training and
    inference times, and their ratios to stock mmcv's of the same precision."""
    keys = list(dict.fromkeys((r.label, r.precision) for r in results))
    rows = []
    for label, precision in keys:
        runs = [r for r in results if (r.label, r.precision) == (label, precision)]
        good = [r for r in runs if not r.error]
        if not good:
            rows.append(dict(label=label, precision=precision, error=runs[0].error))
            continue
        train = [r.train_ms["median_ms"] for r in good]
        infer = [r.infer_ms["median_ms"] for r in good]
        row = dict(
            label=label, precision=precision, error=None, runs=len(good),
            train_ms=statistics.median(train), train_min=min(train), train_max=max(train),
            train_p90=median_or_none([r.train_ms["p90_ms"] for r in good]),
            infer_ms=statistics.median(infer), infer_min=min(infer), infer_max=max(infer),
            images_per_s=median_or_none([r.images_per_s for r in good]),
        )
        for key in (
            "gpu_kernel_ms", "gpu_over_wall_pct", "kernel_launches", "graph_launches", "host_syncs", "sync_wait_ms", "scalar_reads",
            "gc_ms", "gc_full_collections", "compiled_graphs", "peak_memory_mb", "peak_reserved_mb", "msda_share_pct", "max_loss_rel_diff_vs_mmcv",
        ):
            row[key] = median_or_none([getattr(r, key) for r in good])
        labels = list(dict.fromkeys(label for r in good for label in r.host_phases))
        row["host_phases"] = {
            label: {
                key: median_or_none([r.host_phases[label][key] for r in good if label in r.host_phases])
                for key in ("host_ms", "launches", "syncs", "wait_ms", "scalar_reads")
            }
            for label in labels
        }
        row["bound"] = None if row["gpu_over_wall_pct"] is None else (
            "GPU" if row["gpu_over_wall_pct"] >= 100 * BOUND_THRESHOLD else "host"
        )
        rows.append(row)
    for row in rows:
        stock = next((s for s in rows if s["label"] == "stock" and s["precision"] == row["precision"] and not s["error"]), None)
        ok = stock is not None and not row["error"]
        row["train_vs_stock"] = row["train_ms"] / stock["train_ms"] if ok else None
        row["infer_vs_stock"] = row["infer_ms"] / stock["infer_ms"] if ok else None
    return rows


def table(results: list[Result]) -> tuple[list[str], list[list[object]]]:
    header = [
        "variant", "precision", "train ms/iter", "p90", "spread", "vs stock", "GPU kernel ms/iter", "GPU/wall %", "bound",
        "launches/iter", "graph replays/iter", "syncs/iter", "sync wait ms/iter", "scalar reads/iter", "GC ms/iter",
        "infer ms/batch", "infer vs stock", "images/s", "peak MB", "reserved MB", "compiled graphs", "MSDA %", "loss diff vs mmcv",
    ]
    rows = []
    for r in summarize_runs(results):
        if r["error"]:
            rows.append([r["label"], r["precision"], r["error"][:70], *[""] * (len(header) - 3)])
            continue
        rows.append(
            [
                r["label"], r["precision"], fmt(r["train_ms"], ".1f"), fmt(r["train_p90"], ".1f"),
                f"{r['train_min']:.1f}-{r['train_max']:.1f}",
                fmt(r["train_vs_stock"], ".2f"), fmt(r["gpu_kernel_ms"], ".1f"), fmt(r["gpu_over_wall_pct"], ".0f"),
                r["bound"] or "-", fmt(r["kernel_launches"], ".0f"), fmt(r["graph_launches"], ".0f"), fmt(r["host_syncs"], ".0f"),
                fmt(r["sync_wait_ms"], ".1f"), fmt(r["scalar_reads"], ".0f"), fmt(r["gc_ms"], ".2f"),
                fmt(r["infer_ms"], ".1f"), fmt(r["infer_vs_stock"], ".2f"), fmt(r["images_per_s"], ".1f"), fmt(r["peak_memory_mb"], ".0f"), fmt(r["peak_reserved_mb"], ".0f"),
                fmt(r["compiled_graphs"], ".0f"), fmt(r["msda_share_pct"], ".0f"), fmt(r["max_loss_rel_diff_vs_mmcv"], ".1e"),
            ]
        )
    return header, rows


def phase_table(results: list[Result]) -> tuple[list[str], list[list[object]]]:
    """Host time per training iteration by phase: 'ms (launches / syncs, wait ms)' per variant."""
    summary = [r for r in summarize_runs(results) if not r["error"] and r.get("host_phases")]
    labels = list(dict.fromkeys(label for r in summary for label in r["host_phases"]))
    if not labels:
        return [], []
    header = ["variant", "precision", *labels]
    rows = []
    for r in summary:
        cells = []
        for label in labels:
            phase = r["host_phases"].get(label)
            cells.append("-" if phase is None else phase_cell(phase))
        rows.append([r["label"], r["precision"], *cells])
    return header, rows


def phase_cell(phase: dict) -> str:
    wait = phase.get("wait_ms")  # absent from results written before it was measured
    waited = "" if wait is None else f", wait {wait:.1f}"
    return f"{phase['host_ms']:.1f} ({phase['launches']:.0f} / {phase['syncs']:.0f}{waited})"


def format_table(results: list[Result]) -> str:
    text = bench_common.console_table(*table(results))
    header, rows = phase_table(results)
    if rows:
        text += "\n\nHost ms per iteration by phase (launches / syncs, ms waiting in syncs), profiled:\n" + bench_common.console_table(
            header, rows
        )
    return text


def write_outputs(prefix: Path, env: dict, results: list[Result]) -> None:
    paired = paired_ratios(results) if env.get("paired_rounds") else []
    bench_common.write_json(
        prefix.with_suffix(".json"),
        {"environment": env, "results": [asdict(r) for r in results], **({"paired_ratios": paired} if paired else {})},
    )
    header, rows = table(results)
    rounds = (
        f"The variants ran side by side (--paired): every model held at once, {env.get('paired_rounds')} rounds, each "
        "timing a block of training steps of every variant and then a block of inference steps, the order "
        "rotating; times are the median over the rounds of each round's median, 'spread' the smallest and largest "
        "round. No profiled breakdown (it would perturb the rounds)."
        if paired else
        f"Each variant ran {env.get('repeats', 1)} time(s), the rounds interleaved; times are the median over the "
        "runs of each run's median, 'spread' the smallest and largest run, 'vs stock' the ratio to stock's "
        "median of the same precision."
    )
    prefix.with_suffix(".md").write_text(
        "\n".join(
            [
                f"# End-to-end benchmark ({env['device']})",
                "",
                f"{env['config']}, batch {env['batch']}, {env['image_size']} images; date {env['date']}, commit {env['commit']}, "
                f"torch {env['torch']}, mmcv {env.get('mmcv')}, mmdet {env.get('mmdet')}.",
                "",
                "'stock' is mmcv's own MultiScaleDeformableAttention; '+fast' the fast training path (tools/train.py "
                "--fast: compiled network with CUDA graphs, fused optimizer, image-size buckets), '+fast[mode,scope]' with "
                "another torch.compile mode or scope. 'loss diff' is the largest relative difference of the training "
                "loss over the first steps (same seed and batches) against stock; compiled rows draw other dropout "
                "masks than eager, so theirs is not a parity measure (tools/compare_loss_curves.py over 100 "
                "iterations is).",
                "",
                rounds,
                "",
                "Per training iteration, from a profiler trace of a few iterations: 'GPU kernel ms' is the sum of "
                "kernel durations, 'launches' the cudaLaunch*/cuLaunch*/cudaGraphLaunch calls ('graph replays' the last "
                "alone), 'syncs' the host waits "
                "(cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy), "
                "'sync wait ms' the host time spent blocked inside them, waiting for the GPU, "
                "'scalar reads' the aten::_local_scalar_dense calls (.item() and friends). 'GPU/wall' is the kernel "
                f"time over the un-profiled median iteration; below {BOUND_THRESHOLD:.0%} the iteration is host-bound: "
                "the GPU waits for the host. 'peak MB' is the peak of allocated tensors over the timed iterations, "
                "'reserved MB' the allocator's peak reservation, which also holds the CUDA-graph pools of "
                "reduce-overhead (graph replays allocate nothing, so 'peak MB' misses them). 'p90' is the 90th "
                "percentile of the timed iterations, 'GC ms' the host time Python's cyclic garbage collector took "
                "per timed iteration (un-profiled): every iteration does the same work, so a p90 far above the "
                "median is a stall in some of them. "
                + (
                    "Fast rows froze the heap (gc.freeze) after their warm-up, as the fast path does."
                    if env.get("fast_rows_gc_frozen", False)
                    else "Fast rows left the heap unfrozen (--no-gc-freeze)."
                ),
                "",
                bench_common.markdown_table(header, rows),
                *paired_section(paired),
                *phase_section(results),
            ]
        )
        + "\n"
    )
    plot(prefix.with_suffix(".png"), env, results)


def paired_section(paired: list[dict]) -> list[str]:
    if not paired:
        return []
    header = ["variant", "precision", "rounds", "train vs stock", "range", "rounds slower", "infer vs stock", "range", "rounds slower"]
    rows = [
        [
            p["label"], p["precision"], p["rounds"],
            fmt(p["train_ratio"], ".3f"), f"{fmt(p['train_ratio_min'], '.3f')}-{fmt(p['train_ratio_max'], '.3f')}",
            p["train_rounds_slower"],
            fmt(p["infer_ratio"], ".3f"), f"{fmt(p['infer_ratio_min'], '.3f')}-{fmt(p['infer_ratio_max'], '.3f')}",
            p["infer_rounds_slower"],
        ]
        for p in paired
    ]
    return [
        "",
        "## Paired rounds: each round against stock's in the same round",
        "",
        "The median of the per-round ratios, their smallest and largest, and in how many rounds the variant "
        "was the slower.",
        "",
        bench_common.markdown_table(header, rows),
    ]


def phase_section(results: list[Result]) -> list[str]:
    header, rows = phase_table(results)
    if not rows:
        return []
    return [
        "",
        "## Where the host's iteration goes",
        "",
        "Host milliseconds per training iteration in each phase, with the kernel launches and host "
        "synchronisations issued inside it and the milliseconds the host waited in those synchronisations "
        "for the GPU ('wait'; the rest of a phase's time is host work), from the profiled iterations (the profiler slows the host, so "
        "these times exceed the un-profiled ones; the shares hold). 'targets' (the head's matching and "
        "training targets, DINO's denoising ones too) is part of 'head + loss', and 'assigner' (mmdet's "
        "per-image matching; the batched targets call none) part of 'targets'; "
        "'other' is the rest of the step (mmdet's train_step around the phases).",
        "",
        bench_common.markdown_table(header, rows),
    ]


def plot(path: Path, env: dict, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in summarize_runs(results) if not r["error"]]
    if not good:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [f"{r['label']}\n{r['precision']}" for r in good]
    positions = range(len(good))
    wall, gpu = [r["train_ms"] for r in good], [r["gpu_kernel_ms"] or 0.0 for r in good]
    spread = [[r["train_ms"] - r["train_min"] for r in good], [r["train_max"] - r["train_ms"] for r in good]]
    axes[0].bar([x - 0.2 for x in positions], wall, 0.4, yerr=spread, color="tab:blue", label="wall (spread)")
    axes[0].bar([x + 0.2 for x in positions], gpu, 0.4, color="tab:green", label="GPU kernels")
    axes[0].set_xticks(list(positions))
    axes[0].set_xticklabels(labels)
    axes[0].set_ylabel("train ms / iteration")
    axes[0].legend(fontsize=7, title="a gap = host-bound", title_fontsize=7)
    axes[1].bar(labels, [r["infer_ms"] for r in good], color="tab:orange")
    axes[1].set_ylabel("inference ms / batch")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{Path(env['config']).name}, bs {env['batch']}, {env['image_size']} ({env['device']}, {env['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
