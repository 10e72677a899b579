"""A detector's whole network, forward and backward, replayed from CUDA graphs, checked against eager.

    python tools/cuda_graph_train_step.py                       # synthetic Deformable DETR, tma_ws, bs 2, 800x1216
    python tools/cuda_graph_train_step.py --backend cuda --steps 5 --image-size 512x640

Two copies of the detector start from the same weights. One trains eagerly (`model.loss`), the
other through `torch.cuda.make_graphed_callables`: backbone, neck, transformer encoder and decoder
(with their MSDA kernels) and the detection head run as one captured forward graph and one captured
backward graph. Between them, eagerly and in both copies alike: the data preprocessor, the Hungarian
assignment with the losses (scipy on the host, by design), and the optimizer step from the config.
Both see the same batches; the tool prints each step's loss for both and the iteration times, and
exits 1 if the losses differ by more than --rtol.

Dropout is switched off in both copies: eager and replayed dropout draw different masks, which
would hide any real difference.

mmdet 3.3's DETR code reads level shapes on the host twice per forward, which a graph cannot
capture: `pre_transformer` copies each level's shape to the GPU (`torch._shape_as_tensor(feat)[2:]
.to(device)`), and the encoder's `get_encoder_reference_points` iterates the GPU `spatial_shapes` tensor to
size its `linspace`. A graph fixes every shape anyway, so `static_level_geometry` answers both from
the shapes measured before capture. Two-stage models also do it in `gen_encoder_output_proposals`;
they are refused with that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_e2e import build_model, make_optim_wrapper  # noqa: E402
from synthetic_batches import synthetic_batch  # noqa: E402

import mmdeform_tma  # noqa: E402,F401  (MultiScaleDeformableAttention takes backend=)

DEFAULT_CONFIG = "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py"


def unsupported_reason(detector) -> str | None:
    if getattr(detector, "as_two_stage", False):
        return "two-stage detectors read level shapes on the host in gen_encoder_output_proposals"
    if not hasattr(detector, "forward_transformer") or not hasattr(detector, "encoder"):
        return f"{type(detector).__name__} is not one of mmdet's DETR-family detectors"
    return None


@contextlib.contextmanager
def static_level_geometry(detector, level_shapes: list[tuple[int, int]]):
    """Answer mmdet's two host-side reads of the level shapes: `level_shapes` is each level's (H, W),
    and every shape `torch._shape_as_tensor` is asked for must have been asked for before capture."""
    device = next(detector.parameters()).device
    original_shape_as_tensor = torch._shape_as_tensor
    encoder = detector.encoder
    original_reference_points = encoder.get_encoder_reference_points
    shapes_on_device: dict[tuple[int, ...], torch.Tensor] = {}

    def capturing() -> bool:
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def shape_as_tensor(t):
        if t.device != device:
            return original_shape_as_tensor(t)
        key = tuple(t.shape)
        if key not in shapes_on_device:  # made outside capture, so mmdet's `.to(device)` is a no-op
            if capturing():
                raise RuntimeError(f"static_level_geometry: shape {key} was not seen before capture")
            shapes_on_device[key] = torch.tensor(key, device=device)
        return shapes_on_device[key]

    def encoder_reference_points(spatial_shapes, valid_ratios, device):
        if not capturing() and spatial_shapes.tolist() != [list(s) for s in level_shapes]:
            raise RuntimeError(f"static_level_geometry: level shapes {spatial_shapes.tolist()} are not {level_shapes}")
        return original_reference_points(list(level_shapes), valid_ratios, device=device)

    torch._shape_as_tensor = shape_as_tensor
    encoder.get_encoder_reference_points = encoder_reference_points
    try:
        yield
    finally:
        torch._shape_as_tensor = original_shape_as_tensor
        del encoder.get_encoder_reference_points  # back to the class's staticmethod


class DetrNetwork(torch.nn.Module):
    """Preprocessed images -> the head's per-layer class scores and boxes, for one fixed batch geometry."""

    def __init__(self, detector, data_samples):
        super().__init__()
        self.detector = detector
        self.data_samples = data_samples  # only their shapes are read: they are the same for every batch

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.detector.extract_feat(images)
        head_inputs = self.detector.forward_transformer(features, self.data_samples)
        return self.detector.bbox_head(head_inputs["hidden_states"], head_inputs["references"])


def disable_dropout(model) -> None:
    """Every dropout: the modules, and torch's MultiheadAttention, which drops attention weights
    through its `dropout` float (mmcv's MultiheadAttention wraps it with attn_drop=0.1)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        elif isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0


def geometry_of(sample) -> tuple:
    return tuple(sample.batch_input_shape), tuple(sample.img_shape)


def graph_network(detector, images: torch.Tensor, data_samples):
    """The detector's network as a graphed callable: forward and backward replay CUDA graphs."""
    if reason := unsupported_reason(detector):
        raise RuntimeError(f"cannot graph {type(detector).__name__}: {reason}")
    with torch.no_grad():
        level_shapes = [tuple(f.shape[-2:]) for f in detector.extract_feat(images)]
    network = DetrNetwork(detector, data_samples)
    with static_level_geometry(detector, level_shapes):
        return torch.cuda.make_graphed_callables(network, (images,), num_warmup_iters=3, allow_unused_input=True)


def graphed_losses(detector, network, batch) -> dict:
    cls_scores, bbox_preds = network(batch["inputs"])
    samples = batch["data_samples"]
    return detector.bbox_head.loss_by_feat(
        cls_scores, bbox_preds, None, None, [s.gt_instances for s in samples], [s.metainfo for s in samples]
    )


def train(detector, optim_wrapper, batches, losses_of) -> tuple[list[float], list[float]]:
    """One optimizer step per batch; each step's total loss and wall time (ms, synchronised)."""
    losses, times = [], []
    for batch in batches:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss, _ = detector.parse_losses(losses_of(batch))
        optim_wrapper.update_params(loss)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return losses, times


def compare(config: str, backend: str, batch_size: int, height: int, width: int, steps: int, seed: int = 0) -> dict:
    """Train `steps` steps eagerly and from graphs, same init and batches; losses and median step times."""
    device = torch.device("cuda")
    eager, cfg = build_model(config, backend, device, seed)
    graphed = copy.deepcopy(eager)
    num_classes = cfg.model.bbox_head.num_classes
    batches = []
    for step in range(steps):
        raw = synthetic_batch(batch_size, height, width, num_classes, device, seed + step)
        batches.append(eager.data_preprocessor(raw, training=True))
    if len({geometry_of(s) for b in batches for s in b["data_samples"]}) != 1:
        raise RuntimeError("every batch must have one image geometry: a graph fixes the shapes")
    for model in (eager, graphed):
        disable_dropout(model)
        model.train()
    eager_optim = make_optim_wrapper(eager, cfg, "fp32")
    graphed_optim = make_optim_wrapper(graphed, cfg, "fp32")
    network = graph_network(graphed, batches[0]["inputs"].clone(), batches[0]["data_samples"])

    eager_losses, eager_ms = train(eager, eager_optim, batches, lambda b: eager.loss(b["inputs"], b["data_samples"]))
    graph_losses, graph_ms = train(graphed, graphed_optim, batches, lambda b: graphed_losses(graphed, network, b))
    return {
        "eager_losses": eager_losses,
        "graphed_losses": graph_losses,
        "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(graph_losses, eager_losses)),
        # the first step of each includes one-time work (cuBLAS handles, autotuning, the graphs' pools)
        "eager_step_ms": statistics.median(eager_ms[1:] or eager_ms),
        "graphed_step_ms": statistics.median(graph_ms[1:] or graph_ms),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--backend", default="tma_ws", help="MSDA backend of every MultiScaleDeformableAttention")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--image-size", default="800x1216", help="HxW")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference accepted")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_train_step: needs a CUDA GPU (CUDA graphs); none is visible", file=sys.stderr)
        return 2
    height, width = (int(x) for x in args.image_size.split("x"))
    result = compare(args.config, args.backend, args.batch, height, width, args.steps)
    print(f"{args.config}, backend {args.backend}, bs {args.batch}, {height}x{width}, {torch.cuda.get_device_name()}")
    print("step  eager loss     graphed loss")
    for step, (a, b) in enumerate(zip(result["eager_losses"], result["graphed_losses"])):
        print(f"{step:4d}  {a:.6f}  {b:.6f}")
    print(f"largest relative difference {result['max_rel_diff']:.2e} (limit {args.rtol:g})")
    print(f"median step: eager {result['eager_step_ms']:.1f} ms, graphed {result['graphed_step_ms']:.1f} ms")
    return 0 if result["max_rel_diff"] <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
