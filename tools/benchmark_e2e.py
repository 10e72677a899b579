"""End-to-end benchmark: a real mmdet detector, built from its config, per MSDA backend and precision.

    python tools/benchmark_e2e.py                                   # synthetic Deformable DETR, bs 2, 800x1216
    python tools/benchmark_e2e.py --config configs/synthetic/dino-4scale_r50_synthetic_tma-ws.py
    python tools/benchmark_e2e.py --device cpu                      # tiny config, reference backend

For each backend ('stock' is mmcv's own, unpatched MultiScaleDeformableAttention.forward) and
precision (fp32, amp-fp16, amp-bf16) it reports the training iteration time (forward, backward and
optimizer step, synchronised), inference ms/batch and images/s, peak memory, the MSDA kernels'
share of GPU time (torch.profiler), and the loss over N steps from the same seed and batches,
compared with mmcv's. Inputs are synthetic batches (random boxes on random images) pushed through
the model's own data preprocessor. Writes JSON, Markdown and a PNG chart.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

import mmdeform_tma  # noqa: E402

PRECISIONS = {"fp32": None, "amp-fp16": "float16", "amp-bf16": "bfloat16"}
MSDA_KERNELS = re.compile(r"mmdeform_tma|portable::|tma_kernel|tma_ws_kernel|fixed_point|ms_deformable|grid_sampler")
DEFAULT_CONFIG = {
    "cuda": "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py",
    "cpu": "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py",
}


def build_model(config_path: str, backend: str, device: torch.device, seed: int):
    """The detector from its config, every MSDA module switched to `backend` (None: mmcv's own)."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmcv.ops import MultiScaleDeformableAttention

    from mmdet.registry import MODELS

    cfg = Config.fromfile(config_path)
    init_default_scope(cfg.get("default_scope", "mmdet"))
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None  # offline, and the same random init for every backend
    torch.manual_seed(seed)
    model = MODELS.build(model_cfg)
    model.init_weights()
    for module in model.modules():
        if isinstance(module, MultiScaleDeformableAttention):
            module.backend = None if backend == "stock" else backend
    return model.to(device), cfg


def synthetic_batch(batch: int, height: int, width: int, num_classes: int, device: torch.device, seed: int) -> dict:
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    g = torch.Generator().manual_seed(seed)
    inputs, samples = [], []
    for _ in range(batch):
        inputs.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g))
        n = int(torch.randint(3, 9, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * torch.tensor([width * 0.8, height * 0.8])
        wh = (torch.rand(n, 2, generator=g) * 0.3 + 0.05) * torch.tensor([width, height])
        sample = DetDataSample(
            metainfo=dict(img_shape=(height, width), ori_shape=(height, width), pad_shape=(height, width), scale_factor=(1.0, 1.0))
        )
        sample.gt_instances = InstanceData(
            bboxes=torch.cat([xy, (xy + wh).clamp(max=torch.tensor([width, height]))], 1),
            labels=torch.randint(0, num_classes, (n,), generator=g),
        )
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


def make_optim_wrapper(model, cfg, precision: str):
    from mmengine.optim import build_optim_wrapper

    optim_cfg = copy.deepcopy(cfg.optim_wrapper)
    if PRECISIONS[precision]:
        optim_cfg.type = "AmpOptimWrapper"
        optim_cfg.loss_scale = "dynamic"
        optim_cfg.dtype = PRECISIONS[precision]
    return build_optim_wrapper(model, optim_cfg)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(step, iters: int, device: torch.device) -> list[float]:
    samples = []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def msda_share(step, iters: int, device: torch.device) -> float | None:
    """Share of GPU kernel time spent in MSDA kernels over `iters` steps."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        synchronize(device)
    total = msda = 0.0
    for event in prof.key_averages():
        t = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if event.device_type.name != "CUDA" and not t:
            continue
        total += t
        if MSDA_KERNELS.search(event.key):
            msda += t
    return 100.0 * msda / total if total else None


@dataclass
class Result:
    backend: str
    precision: str
    train_ms: dict = field(default_factory=dict)
    infer_ms: dict = field(default_factory=dict)
    images_per_s: float | None = None
    peak_memory_mb: float | None = None
    msda_share_pct: float | None = None
    losses: list = field(default_factory=list)
    max_loss_rel_diff_vs_mmcv: float | None = None
    error: str | None = None


def run_one(args, backend: str, precision: str, device: torch.device) -> Result:
    result = Result(backend, precision)
    model, cfg = build_model(args.config, backend, device, args.seed)
    num_classes = cfg.model.bbox_head.num_classes
    batches = [synthetic_batch(args.batch, args.height, args.width, num_classes, device, args.seed + i) for i in range(args.parity_steps)]
    optim_wrapper = make_optim_wrapper(model, cfg, precision)
    model.train()
    torch.manual_seed(args.seed)  # dropout draws the same numbers for every backend
    for batch in batches:  # loss parity: the first steps, from the same init and batches
        losses = model.train_step(batch, optim_wrapper)
        result.losses.append(float(losses["loss"]))
    batch = batches[0]

    def train_step():
        model.train_step(batch, optim_wrapper)

    for _ in range(args.warmup):
        train_step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result.train_ms = bench_common.summarize(time_loop(train_step, args.iters, device))
    if device.type == "cuda":
        result.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
    result.msda_share_pct = msda_share(train_step, min(5, args.iters), device)

    model.eval()
    amp_dtype = getattr(torch, PRECISIONS[precision] or "float32")

    def infer_step():
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=PRECISIONS[precision] is not None):
            model.test_step(batch)

    for _ in range(args.warmup):
        infer_step()
    result.infer_ms = bench_common.summarize(time_loop(infer_step, args.iters, device))
    result.images_per_s = args.batch / (result.infer_ms["median_ms"] / 1e3)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="mmdet config (default: synthetic Deformable DETR; tiny on CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--backends", nargs="*", help="default: stock plus every available backend")
    p.add_argument("--precisions", nargs="*", choices=list(PRECISIONS), default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--image-size", default=None, help="HxW (default 800x1216 on GPU, 128x128 on CPU)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--parity-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/e2e"))
    args = p.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = args.device.type == "cuda"
    args.config = args.config or DEFAULT_CONFIG[args.device.type]
    args.precisions = args.precisions or (list(PRECISIONS) if gpu else ["fp32"])
    args.batch = args.batch or (2 if gpu else 1)
    args.height, args.width = (int(x) for x in (args.image_size or ("800x1216" if gpu else "128x128")).split("x"))
    args.iters = args.iters or (20 if gpu else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.parity_steps = args.parity_steps or (10 if gpu else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.type != "cuda":
        print(f"no GPU: running {args.config} on the CPU with the reference backend", file=sys.stderr)
    backends = args.backends or (["stock", *mmdeform_tma.available_backends(device)])
    env = bench_common.environment(device)
    env.update(config=args.config, batch=args.batch, image_size=f"{args.height}x{args.width}")
    results: list[Result] = []
    jobs = [(b, p) for b in backends for p in args.precisions]
    for backend, precision in bench_common.progress(jobs, len(jobs), "e2e"):
        try:
            results.append(run_one(args, backend, precision, device))
        except (mmdeform_tma.BackendUnavailableError, RuntimeError) as exc:
            results.append(Result(backend, precision, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model is gone with run_one's frame
    for r in results:
        base = next((b for b in results if b.backend == "stock" and b.precision == r.precision and b.losses), None)
        base = base or next((b for b in results if b.backend == "mmcv" and b.precision == r.precision and b.losses), None)
        if base and r.losses:
            r.max_loss_rel_diff_vs_mmcv = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, base.losses))
    write_outputs(args.out, env, results)
    print(format_table(results))
    print(f"\nwrote {args.out}.json, {args.out}.md, {args.out}.png  ({env['device']}, commit {env['commit']})")
    return 0


def table(results: list[Result]) -> tuple[list[str], list[list[object]]]:
    header = ["backend", "precision", "train ms/iter", "p90", "infer ms/batch", "images/s", "peak MB", "MSDA %", "loss diff vs mmcv"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.backend, r.precision, r.error[:70], "", "", "", "", "", ""])
            continue
        rows.append(
            [
                r.backend, r.precision, f"{r.train_ms['median_ms']:.1f}", f"{r.train_ms['p90_ms']:.1f}", f"{r.infer_ms['median_ms']:.1f}",
                f"{r.images_per_s:.1f}", "-" if r.peak_memory_mb is None else f"{r.peak_memory_mb:.0f}",
                "-" if r.msda_share_pct is None else f"{r.msda_share_pct:.0f}",
                "-" if r.max_loss_rel_diff_vs_mmcv is None else f"{r.max_loss_rel_diff_vs_mmcv:.1e}",
            ]
        )
    return header, rows


def format_table(results: list[Result]) -> str:
    return bench_common.console_table(*table(results))


def write_outputs(prefix: Path, env: dict, results: list[Result]) -> None:
    bench_common.write_json(prefix.with_suffix(".json"), {"environment": env, "results": [asdict(r) for r in results]})
    header, rows = table(results)
    prefix.with_suffix(".md").write_text(
        "\n".join(
            [
                f"# End-to-end benchmark ({env['device']})",
                "",
                f"{env['config']}, batch {env['batch']}, {env['image_size']} images; date {env['date']}, commit {env['commit']}, "
                f"torch {env['torch']}, mmcv {env.get('mmcv')}, mmdet {env.get('mmdet')}.",
                "",
                "'stock' is mmcv's own MultiScaleDeformableAttention; 'loss diff' is the largest relative difference of the "
                "training loss over the first steps (same seed and batches) against it.",
                "",
                bench_common.markdown_table(header, rows),
            ]
        )
        + "\n"
    )
    plot(prefix.with_suffix(".png"), env, results)


def plot(path: Path, env: dict, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if not r.error]
    if not good:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [f"{r.backend}\n{r.precision}" for r in good]
    axes[0].bar(labels, [r.train_ms["median_ms"] for r in good], color="tab:blue")
    axes[0].set_ylabel("train ms / iteration")
    axes[1].bar(labels, [r.infer_ms["median_ms"] for r in good], color="tab:orange")
    axes[1].set_ylabel("inference ms / batch")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{Path(env['config']).name}, bs {env['batch']}, {env['image_size']} ({env['device']}, {env['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
