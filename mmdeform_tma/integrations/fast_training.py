"""The opt-in fast training path: `tools/train.py --fast`, or `fast_training_config(cfg)` in code.

A DETR-family training step is host-bound: the GPU finishes its kernels long before Python has
launched the next ones (docs/benchmarks.md). This path cuts host work with existing engines only:

- `torch.compile` of every transformer layer (mmdet's `DetrTransformerEncoderLayer` and
  `DetrTransformerDecoderLayer` and their subclasses: Deformable DETR, DINO, Mask2Former), with
  `fullgraph=True` so a graph break is an error, not a silent slowdown. Layers, not whole
  encoders: mmdet builds each encoder's reference points by iterating a device tensor of level
  shapes, a host synchronisation per level that would split the graph anyway. Modules are compiled
  in place (`nn.Module.compile`), so parameter names and checkpoints are unchanged.
- the backbone and the neck too (`compile_scope='network'`; 'layers' compiles the transformer
  layers only): a ResNet's convolutions keep cuDNN, its frozen batch norms, activations and AMP
  casts fuse.
- Deformable DETR's and DINO's decoder whole (`compile_scope='network+decoder'`, the default):
  between its layers the decoder refines the reference points (sine embedding, an MLP, the box
  branch, inverse sigmoid), about 35 small kernels per layer forward by a count of the source,
  more backward, each launched from Python. Compiled with the layers, the decoder is one graph. The encoder stays
  compiled per layer (its reference points iterate the level shapes on the host).
- CUDA graphs (`mode='reduce-overhead'`, the default): each compiled module's forward and
  backward replay from a graph, a few launches where there were hundreds; one graph is recorded
  per image-size bucket (below). Each of the model's train, val and test steps first marks a new
  CUDA-graph iteration (`torch.compiler.cudagraph_mark_step_begin`): with several compiled
  regions per step, torch's own guess of where an iteration starts failed (the backbone's graph
  outputs were taken for pending work and overwritten). On an H100 (2026-11-23, commit 88fd07b)
  this made a Deformable DETR bs 2 AMP iteration 113 ms against 193 ms compiled without graphs
  and 246 ms stock (docs/benchmarks.md, session 6).
- the encoder's reference points from the feature maps' shapes, which the host knows, not from
  the device tensor of level shapes that mmdet reads back level by level
  (`host_shaped_encoder_reference_points`): 16 fewer scalar reads per forward with four levels.
- the optimizer's fused CUDA kernel (`fused=True`, torch's Adam/AdamW/SGD), which also lets AMP's
  GradScaler skip its per-step `found_inf.item()` synchronisation.
- `MergedParamGroupsConstructor`: mmengine's default constructor with `paramwise_cfg` (every
  DETR-family config: lower lr for the backbone and the sampling offsets) gives each parameter a
  group of its own, and torch's foreach and fused optimizers launch per group: about 2,400 launches
  per AdamW step of Deformable DETR (900 fused). Groups with equal settings are merged, so the
  optimizer works on a few groups; each parameter keeps its learning rate and weight decay.
  Resuming across the switch is refused by torch (the optimizer state has other groups); model
  weights load either way.
- `BatchBucketPad`: pads each batch up to the next multiple of `step` in height and width, so
  multi-scale training sees a bounded set of input shapes (Deformable DETR's COCO pipeline at bs 2
  and 128 px: about 56 in an epoch, by simulation) and records one CUDA graph per shape. Compiled
  graphs follow torch's automatic dynamic shapes: after a module's second input size it is
  recompiled once with symbolic sizes, so the buckets do not each cost a compilation (the MSDA
  op's planning guards on power-of-two ranges of the query count, not on its value). Padding is
  what mmdet's `BatchFixedSizePad` does: masked out by the DETR models' padding masks.

- the head's training targets built for all images at once (`batched_targets`,
  `batch_detr_targets`): mmdet matches and builds targets image by image for every decoder layer,
  about 120 launches and 11 host synchronisations per image; batched, one read-back per layer (and
  the one in mmdet's `bbox_overlaps`) and the same targets, bitwise. DINO's denoising targets too.

What stays on the host is mmdet's: the SciPy solve per image and decoder layer, the losses'
average factors read back with `.item()`, and mmengine's logging of every loss value.
"""

from __future__ import annotations

import functools
import gc
import inspect
import math

import torch
from mmdet.models.data_preprocessors.data_preprocessor import BatchFixedSizePad
from mmdet.models.detectors import DeformableDETR
from mmdet.models.layers.transformer import (
    DeformableDetrTransformerDecoder,
    DeformableDetrTransformerEncoder,
    DetrTransformerDecoderLayer,
    DetrTransformerEncoderLayer,
    DinoTransformerDecoder,
)
from mmdet.registry import MODELS, OPTIM_WRAPPER_CONSTRUCTORS
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import HOOKS

from .batched_targets import batch_detr_targets

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
DEFAULT_COMPILE_MODE = "reduce-overhead"
# what is compiled: the transformer layers; also the backbone and the neck; also the decoder whole
COMPILE_SCOPES = ("layers", "network", "network+decoder")
DEFAULT_COMPILE_SCOPE = "network+decoder"
NETWORK_PARTS = ("backbone", "neck")
DEFAULT_BUCKET_STEP = 128
# Training iterations before the fast path freezes the heap (`freeze_long_lived_objects`): by then the
# modules are compiled, their CUDA graphs recorded and the first buckets met.
DEFAULT_GC_FREEZE_AFTER = 20
UNBUCKETED_SHAPE = "batch_shape_before_bucket_pad"  # metainfo key BatchBucketPad adds
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD")
# compiled graphs kept per module class: train and eval, static and dynamic, and any specialisations
DYNAMO_CACHE_SIZE_LIMIT = 64
THIS_MODULE = __name__
TRANSFORMER_LAYERS = (DetrTransformerEncoderLayer, DetrTransformerDecoderLayer)
WHOLE_DECODERS = (DeformableDetrTransformerDecoder, DinoTransformerDecoder)  # traced whole, CPU-tested


def bucket_size(height: int, width: int, step: int) -> tuple[int, int]:
    return math.ceil(height / step) * step, math.ceil(width / step) * step


@MODELS.register_module()
class BatchBucketPad(BatchFixedSizePad):
    """Pads a batch (images, and instance masks / semantic maps when asked) up to the next multiple
    of `step` in each side; `BatchFixedSizePad`'s arguments otherwise."""

    def __init__(self, step: int = DEFAULT_BUCKET_STEP, **kwargs) -> None:
        if step <= 0:
            raise ValueError(f"BatchBucketPad: step must be positive, got {step}")
        super().__init__(size=(step, step), **kwargs)
        self.step = step

    def forward(self, inputs, data_samples=None):
        # the parent pads to self.size; it is set per batch (one preprocessor per process thread)
        self.size = bucket_size(*inputs.shape[-2:], self.step)
        for sample in data_samples or ():
            # what the batch was without buckets: the two-stage guard keeps proposals inside it
            sample.set_metainfo({UNBUCKETED_SHAPE: tuple(inputs.shape[-2:])})
        return super().forward(inputs, data_samples)


@functools.lru_cache(maxsize=4096)
def kept_extent(unbucketed: int, padded: int, level_size: int) -> int:
    """How many leading rows (or columns) of a feature level of `level_size` lie inside the first
    `unbucketed` of `padded` input pixels, by the nearest-neighbour resize that mmdet's DETRs use
    to derive each level's padding mask from the input's (so the same cells as their masks)."""
    inside = torch.zeros(1, 1, padded, 1)
    inside[:, :, :unbucketed] = 1
    return int(torch.nn.functional.interpolate(inside, size=(level_size, 1)).sum())


def _crop_levels(flat: torch.Tensor, level_shapes, kept) -> torch.Tensor:
    """(batch, sum h*w, ...) -> (batch, sum r*c, ...): each level's leading r rows and c columns."""
    parts, start = [], 0
    for (h, w), (r, c) in zip(level_shapes, kept):
        level = flat[:, start : start + h * w]
        grid = level.reshape(flat.shape[0], h, w, *flat.shape[2:])
        parts.append(grid[:, :r, :c].reshape(flat.shape[0], r * c, *flat.shape[2:]))
        start += h * w
    return torch.cat(parts, 1)


def guard_two_stage_selection(model: torch.nn.Module) -> bool:
    """Keep bucket padding out of a two-stage DETR's proposal selection; True if `model` is one.

    DINO and two-stage Deformable DETR rank every encoder cell for the top-k proposals, padded
    cells included: their memory is zeroed, so all of them score the same, and at initialisation
    that score can outrank the image. Bucket padding adds thousands of such cells, and DINO's first
    iterations then train on proposals in the padding (H100, 2026-11-23, commit 766d741: loss_bbox
    8.2 against eager's 1.08 at iteration 1; the same on the CPU). The guard hands `pre_decoder` only the cells
    inside the batch as it was before bucket padding, the cells eager ranks; the decoder still
    attends over the whole padded memory, which its masks make equal to eager's."""
    if is_model_wrapper(model):
        model = model.module
    if not (isinstance(model, DeformableDETR) and model.as_two_stage):
        return False
    if getattr(model.pre_decoder, "_guards_two_stage_selection", False):
        return True
    pre_transformer, pre_decoder = model.pre_transformer, model.pre_decoder
    crops = []  # the current forward's crop: set by pre_transformer, taken by pre_decoder

    def guarded_pre_transformer(mlvl_feats, batch_data_samples=None):
        crops.clear()
        meta = batch_data_samples[0].metainfo if batch_data_samples else {}
        if UNBUCKETED_SHAPE in meta:
            level_shapes = [tuple(feat.shape[-2:]) for feat in mlvl_feats]
            sides = list(zip(meta[UNBUCKETED_SHAPE], meta["batch_input_shape"]))
            kept = [
                tuple(kept_extent(before, padded, size) for (before, padded), size in zip(sides, shape))
                for shape in level_shapes
            ]
            if kept != level_shapes:
                crops.append((level_shapes, kept))
        return pre_transformer(mlvl_feats, batch_data_samples)

    def guarded_pre_decoder(memory, memory_mask, spatial_shapes, *args, **kwargs):
        if not crops:
            return pre_decoder(memory, memory_mask, spatial_shapes, *args, **kwargs)
        level_shapes, kept = crops.pop()
        if sum(h * w for h, w in level_shapes) != memory.shape[1]:
            raise RuntimeError(f"two-stage guard: memory has {memory.shape[1]} cells, the levels {level_shapes}")
        decoder_inputs, head_inputs = pre_decoder(
            _crop_levels(memory, level_shapes, kept),
            None if memory_mask is None else _crop_levels(memory_mask, level_shapes, kept),
            # on the host: mmdet's proposal loop reads each level's size, and a device tensor
            # (and copying one there) would make each read a wait for the GPU
            torch.tensor(kept, dtype=spatial_shapes.dtype),
            *args,
            **kwargs,
        )
        if "memory" in decoder_inputs:
            decoder_inputs["memory"] = memory  # the decoder samples the padded maps, as in eager
        return decoder_inputs, head_inputs

    guarded_pre_decoder._guards_two_stage_selection = True
    model.pre_transformer, model.pre_decoder = guarded_pre_transformer, guarded_pre_decoder
    return True


@functools.lru_cache(maxsize=64)
def _reference_grid(level_shapes: tuple, device: torch.device, inference: bool):
    """Per encoder cell, level by level as mmdet flattens them: its centre (x, y) in cells, made by
    the linspace and meshgrid mmdet makes; its level; and its level's (width, height). `inference`
    only keys the cache: tensors made under inference mode cannot enter training's autograd."""
    centres, levels, sizes = [], [], []
    for level, (h, w) in enumerate(level_shapes):
        ref_y, ref_x = torch.meshgrid(
            torch.linspace(0.5, h - 0.5, h, dtype=torch.float32, device=device),
            torch.linspace(0.5, w - 0.5, w, dtype=torch.float32, device=device),
            indexing="ij",
        )
        centres.append(torch.stack((ref_x.reshape(-1), ref_y.reshape(-1)), -1))
        levels.append(torch.full((h * w,), level, dtype=torch.long, device=device))
        sizes.append(torch.tensor([[w, h]], dtype=torch.float32, device=device).expand(h * w, 2))
    return torch.cat(centres), torch.cat(levels), torch.cat(sizes)


def host_shaped_encoder_reference_points(model: torch.nn.Module) -> bool:
    """Give a Deformable DETR / DINO encoder its reference points without host syncs; True if
    `model` has such an encoder.

    mmdet builds them level by level from the level shapes in a device tensor: `linspace` needs
    each height and width on the host, four reads of device memory per level (16 with four levels,
    counted on the CPU), each a wait for the GPU; an H100 profile (2026-11-23, commit 1503b8e) had
    20 host syncs per iteration in Deformable DETR's fast transformer phase, 4 without them (commit
    0d33360). The sizes are the feature maps' shapes, which the host knows: the
    detector's `pre_transformer` records them, and the encoder builds the same points from them, a
    cached cell grid divided by the valid ratios, the same float32 operations, no host read
    (bitwise equal, CPU test). A call without a recorded shape (the encoder run on its own) takes
    mmdet's own path."""
    if is_model_wrapper(model):
        model = model.module
    encoder = getattr(model, "encoder", None)
    if not (isinstance(model, DeformableDETR) and type(encoder) is DeformableDetrTransformerEncoder):
        return False
    if getattr(encoder.get_encoder_reference_points, "_uses_host_shapes", False):
        return True
    pre_transformer, mmdet_reference_points = model.pre_transformer, encoder.get_encoder_reference_points
    recorded = []  # the current forward's level shapes: set by pre_transformer, taken by the encoder

    def recording_pre_transformer(mlvl_feats, batch_data_samples=None):
        recorded[:] = [tuple(tuple(feat.shape[-2:]) for feat in mlvl_feats)]
        return pre_transformer(mlvl_feats, batch_data_samples)

    def reference_points(spatial_shapes, valid_ratios, device):
        if not recorded or len(recorded[0]) != spatial_shapes.shape[0]:
            return mmdet_reference_points(spatial_shapes, valid_ratios, device)
        grid_key = (recorded.pop(), torch.device(device), torch.is_inference_mode_enabled())
        centres, levels, sizes = _reference_grid(*grid_key)
        # mmdet: centre / (valid ratio of the level * level size), then times every level's valid ratio
        points = centres[None] / (valid_ratios[:, levels] * sizes)
        return points[:, :, None] * valid_ratios[:, None]

    reference_points._uses_host_shapes = True
    model.pre_transformer, encoder.get_encoder_reference_points = recording_pre_transformer, reference_points
    return True


def merge_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class and defaults whose groups are `optimizer`'s merged by
    equal settings, in order of first appearance. Call it before the first step (no state yet)."""
    if optimizer.state:
        raise ValueError("merge_param_groups: the optimizer has state already; merge before the first step")
    merged: dict[tuple, dict] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        key = tuple(sorted((k, repr(v)) for k, v in settings.items()))
        merged.setdefault(key, {**settings, "params": []})["params"].extend(group["params"])
    # the constructor's own arguments only (torch's AdamW defaults hold Adam's decoupled_weight_decay)
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(list(merged.values()), **{k: v for k, v in optimizer.defaults.items() if k in accepted})


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class MergedParamGroupsConstructor(DefaultOptimWrapperConstructor):
    """mmengine's default constructor, then `merge_param_groups` on its optimizer."""

    def __call__(self, model: torch.nn.Module):
        optim_wrapper = super().__call__(model)
        optim_wrapper.optimizer = merge_param_groups(optim_wrapper.optimizer)
        return optim_wrapper


def transformer_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's DETR-style transformer layers, by name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TRANSFORMER_LAYERS)]


def check_choice(kind: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown compile {kind} {value!r}; valid: {', '.join(valid)}")


def whole_decoders(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's Deformable DETR and DINO decoders, by name: a loop of layers and reference-point
    refinement that traces into one graph. Exactly these classes: subclasses add host logic of
    their own (DDQ-DETR's decoder filters queries with NMS), and keep their layers compiled one by
    one."""
    return [(name, m) for name, m in model.named_modules() if type(m) in WHOLE_DECODERS]


def network_parts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's backbone and neck (those it has), by name. A part holding transformer layers
    is refused: they are compiled on their own, and a compiled parent would swallow them."""
    parts = [(name, getattr(model, name)) for name in NETWORK_PARTS if isinstance(getattr(model, name, None), torch.nn.Module)]
    for name, part in parts:
        if transformer_layers(part):
            raise ValueError(
                f"{type(model).__name__}.{name} holds transformer layers; the network compile scopes cannot take it"
            )
    return parts


def compile_fast_path_modules(
    model: torch.nn.Module, mode: str = DEFAULT_COMPILE_MODE, scope: str = DEFAULT_COMPILE_SCOPE, **compile_kwargs
) -> list[str]:
    """Compile each transformer layer in place, with scope 'network' the backbone and the neck too,
    and with 'network+decoder' also Deformable DETR's and DINO's decoder whole, in place of its
    layers; returns the compiled modules' names. Raises if the model has no transformer layer."""
    check_choice("mode", mode, COMPILE_MODES)
    check_choice("scope", scope, COMPILE_SCOPES)
    stepped = model  # a wrapper's own steps are what the runner calls (DDP does not call the module's)
    if is_model_wrapper(model):
        model = model.module
    layers = transformer_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no DetrTransformerEncoderLayer / DecoderLayer to compile")
    if scope == "network+decoder":
        decoders = whole_decoders(model)
        inside = {id(m) for _, decoder in decoders for m in decoder.modules()}
        layers = decoders + [(name, m) for name, m in layers if id(m) not in inside]
    modules = layers if scope == "layers" else network_parts(model) + layers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, DYNAMO_CACHE_SIZE_LIMIT)
    compile_kwargs.setdefault("fullgraph", True)
    # torch's automatic dynamic shapes: static graphs until a module meets a second input size, then
    # one graph with symbolic sizes (CUDA graphs still record once per size). Multi-scale training
    # meets dozens of buckets, and static graphs would recompile every module for each.
    compile_kwargs.setdefault("dynamic", None)
    if mode == "reduce-overhead":
        mark_cuda_graph_steps(stepped)
    if compile_kwargs.get("backend", "inductor") != "inductor":
        mode = None  # modes are inductor's; tests trace with 'aot_eager' on the CPU
    for _, module in modules:
        module.compile(mode=mode, **compile_kwargs)
    return [name for name, _ in modules]


STEP_METHODS = ("train_step", "val_step", "test_step")


def mark_cuda_graph_steps(model: torch.nn.Module) -> None:
    """Make each of the model's train, val and test steps begin a new CUDA-graph iteration, so
    graph outputs of the previous step are released rather than taken for pending work."""
    for name in STEP_METHODS:
        step = getattr(model, name, None)
        if step is None or getattr(step, "_marks_cuda_graph_steps", False):
            continue

        def marked(*args, _step=step, **kwargs):
            torch.compiler.cudagraph_mark_step_begin()
            return _step(*args, **kwargs)

        marked._marks_cuda_graph_steps = True
        setattr(model, name, marked)


def apply_fast_path(
    model: torch.nn.Module,
    mode: str = DEFAULT_COMPILE_MODE,
    scope: str = DEFAULT_COMPILE_SCOPE,
    batched_targets: bool = True,
    **compile_kwargs,
) -> tuple[list[str], str]:
    """What the fast path does to a built model, in place: compiles it (`compile_fast_path_modules`),
    gives its encoder reference points from host shapes, guards a two-stage model's proposals from
    the bucket padding and, with `batched_targets`, builds its head's training targets for all images
    at once (`batch_detr_targets`). Returns the compiled modules' names and a line saying what was done."""
    compiled = compile_fast_path_modules(model, mode, scope, **compile_kwargs)
    host_shaped_encoder_reference_points(model)
    summary = f"compiled {len(compiled)} modules (torch.compile mode={mode!r}, scope={scope!r})"
    if guard_two_stage_selection(model):
        summary += "; two-stage proposals kept off the bucket padding"
    if batched_targets:
        replaced, reasons = batch_detr_targets(model)
        if replaced:
            summary += f"; batched head targets ({', '.join(replaced)})"
        if reasons:
            summary += f"; mmdet's per-image targets kept where: {'; '.join(reasons)}"
    return compiled, summary


def freeze_long_lived_objects() -> int:
    """Collect once, then move every object Python's collector tracks into its permanent generation
    (`gc.freeze`); returns how many are frozen. A full collection walks every tracked object, 0.35-0.65
    s in a training process (perf_notes.md, session 11); frozen, the model, the optimizer and the
    compiled graphs are out of its walk. The price: a cycle among them that becomes garbage later is
    never collected, so freeze only what lives for the whole run."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@HOOKS.register_module()
class FastPathCompileHook(Hook):
    """Before the first train, val or test iteration, applies the fast path to the model
    (`apply_fast_path`: compiled modules, host-shaped reference points, the two-stage guard and,
    with `batched_targets`, the head's batched targets). After `gc_freeze_after` training
    iterations of this run (None: never) it freezes the heap (`freeze_long_lived_objects`)."""

    priority = "VERY_LOW"

    def __init__(
        self,
        mode: str = DEFAULT_COMPILE_MODE,
        scope: str = DEFAULT_COMPILE_SCOPE,
        gc_freeze_after: int | None = DEFAULT_GC_FREEZE_AFTER,
        batched_targets: bool = True,
        **compile_kwargs,
    ) -> None:
        check_choice("mode", mode, COMPILE_MODES)
        check_choice("scope", scope, COMPILE_SCOPES)
        check_gc_freeze_after(gc_freeze_after)
        self.mode = mode
        self.scope = scope
        self.batched_targets = batched_targets
        self.gc_freeze_after = gc_freeze_after
        self.compile_kwargs = compile_kwargs
        self.compiled: list[str] = []
        self.train_iters_seen = 0  # of this run: a resumed run compiles and records its graphs again
        self.frozen_objects: int | None = None

    def before_run(self, runner) -> None:
        if self.compiled:
            return
        self.compiled, summary = apply_fast_path(
            runner.model, self.mode, self.scope, self.batched_targets, **self.compile_kwargs
        )
        print_log(summary, logger="current")

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self.train_iters_seen += 1
        due = self.gc_freeze_after is not None and self.train_iters_seen >= self.gc_freeze_after
        if due and self.frozen_objects is None:
            self.frozen_objects = freeze_long_lived_objects()
            print_log(
                f"froze {self.frozen_objects} long-lived objects after {self.train_iters_seen} iterations (gc.freeze)",
                logger="current",
            )


def check_gc_freeze_after(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"gc_freeze_after must be a positive number of iterations or None, got {value!r}")


def fast_training_config(
    cfg,
    compile_mode: str = DEFAULT_COMPILE_MODE,
    bucket_step: int = DEFAULT_BUCKET_STEP,
    compile_scope: str = DEFAULT_COMPILE_SCOPE,
    gc_freeze_after: int | None = DEFAULT_GC_FREEZE_AFTER,
    batched_targets: bool = True,
):
    """`cfg` (an mmengine Config) switched to the fast path, in place; returns it.

    Adds the compile hook (which also freezes the heap after `gc_freeze_after` training iterations,
    None: never, and with `batched_targets` builds the head's targets for all images at once), the
    fused optimizer with merged parameter groups (unless the config names a constructor of its own),
    batches copied to the GPU without a host wait (pinned by the data loaders, copied `non_blocking`
    by the data preprocessor) and, unless the model pads to a fixed size already (Mask2Former's
    large-scale jitter), bucket padding. Raises for an optimizer
    without a fused kernel rather than quietly leaving it unfused."""
    check_choice("mode", compile_mode, COMPILE_MODES)
    check_choice("scope", compile_scope, COMPILE_SCOPES)
    check_gc_freeze_after(gc_freeze_after)
    imports = cfg.get("custom_imports", None) or dict(imports=[], allow_failed_imports=False)
    names = list(imports.get("imports", []))
    for name in ("mmdeform_tma", THIS_MODULE):
        if name not in names:
            names.append(name)
    imports["imports"] = names
    cfg.custom_imports = imports

    hooks = [h for h in cfg.get("custom_hooks", None) or [] if h.get("type") != "FastPathCompileHook"]
    hooks.append(
        dict(
            type="FastPathCompileHook",
            mode=compile_mode,
            scope=compile_scope,
            gc_freeze_after=gc_freeze_after,
            batched_targets=batched_targets,
        )
    )
    cfg.custom_hooks = hooks

    optimizer = cfg.optim_wrapper.optimizer
    if optimizer.get("type") not in FUSED_OPTIMIZERS:
        raise ValueError(
            f"--fast: optimizer {optimizer.get('type')!r} has no fused CUDA kernel in torch; "
            f"use one of {', '.join(FUSED_OPTIMIZERS)} or train without --fast"
        )
    optimizer.fused = True
    optimizer.pop("foreach", None)  # torch refuses fused together with foreach
    if cfg.optim_wrapper.get("constructor", "DefaultOptimWrapperConstructor") == "DefaultOptimWrapperConstructor":
        cfg.optim_wrapper.constructor = "MergedParamGroupsConstructor"  # a custom one is left alone

    # mmengine's preprocessor copies each image and each sample's boxes and labels to the GPU with
    # a host wait per copy. Non-blocking, a copy from pinned memory queues behind the GPU's work;
    # one from pageable memory (the samples' boxes) is staged by the driver before the call returns.
    # H100, 2026-11-23: 8 -> 2 host waits per Deformable DETR bs 2 iteration, 32 -> 8 at bs 8; the
    # one per image left is most likely mmengine's BGR->RGB list index, copied blocking.
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        if cfg.get(loader, None) is not None:
            cfg[loader].pin_memory = True
    preprocessor = cfg.model.get("data_preprocessor", None)
    if preprocessor is not None:
        preprocessor.non_blocking = True
        augments = list(preprocessor.get("batch_augments", None) or [])
        if not any(a.get("type") in ("BatchFixedSizePad", "BatchBucketPad") for a in augments):
            # no masks to pad: the DETR detectors have none, Mask2Former pads to a fixed size already
            augments.append(dict(type="BatchBucketPad", step=bucket_step))
            preprocessor.batch_augments = augments
    return cfg
