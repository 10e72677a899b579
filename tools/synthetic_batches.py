"""Synthetic batches for the end-to-end models, in the form mmdet's pipelines give them to
`model.train_step(batch, optim_wrapper)` and `model.test_step(batch)`: uint8 CHW images and
DetDataSamples whose images are not normalised or padded (the model's own data preprocessor does
that, as with a real dataloader). Everything is drawn on the CPU from a torch.Generator seeded
with `seed`, so the same arguments give the same batch.

- detectors (Deformable DETR, DINO, ...): `synthetic_batch`, random boxes on noise images.
- MaskFormer / Mask2Former (a `panoptic_head`): `synthetic_panoptic_batch`, stuff bands, void
  areas and overlapping rectangle / ellipse "things" painted into one segment map, from which the
  masks, boxes and `gt_sem_seg` are all read, as LoadPanopticAnnotations and PackDetInputs do.

`batch_for_config(cfg, ...)` picks the one the config's model trains on.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

VOID = 255  # LoadPanopticAnnotations' ignore label in gt_sem_seg


def _sample(height: int, width: int):
    from mmdet.structures import DetDataSample

    shape = (height, width)
    return DetDataSample(metainfo=dict(img_shape=shape, ori_shape=shape, pad_shape=shape, scale_factor=(1.0, 1.0)))


def synthetic_batch(batch: int, height: int, width: int, num_classes: int, device: torch.device, seed: int) -> dict:
    """Detection batch: noise images with 3-8 random boxes each. `device` is where the model runs;
    the tensors stay on the CPU, as a dataloader hands them over, and the preprocessor moves them."""
    from mmengine.structures import InstanceData

    g = torch.Generator().manual_seed(seed)
    inputs, samples = [], []
    for _ in range(batch):
        inputs.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g))
        n = int(torch.randint(3, 9, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * torch.tensor([width * 0.8, height * 0.8])
        wh = (torch.rand(n, 2, generator=g) * 0.3 + 0.05) * torch.tensor([width, height])
        sample = _sample(height, width)
        sample.gt_instances = InstanceData(
            bboxes=torch.cat([xy, (xy + wh).clamp(max=torch.tensor([width, height]))], 1),
            labels=torch.randint(0, num_classes, (n,), generator=g),
        )
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


def _random_shape(height: int, width: int, g: torch.Generator) -> torch.Tensor:
    """A filled rectangle or ellipse, 6-40 % of the image's sides, centred anywhere in the image (it
    may leave it). At least 2 pixels across, so that it always covers a pixel centre."""
    size = (torch.tensor([height, width]) * (torch.rand(2, generator=g) * 0.34 + 0.06)).clamp(min=2)
    centre = torch.rand(2, generator=g) * torch.tensor([height, width])
    rows = torch.arange(height, dtype=torch.float32)[:, None] + 0.5
    cols = torch.arange(width, dtype=torch.float32)[None, :] + 0.5
    dy, dx = (rows - centre[0]) / (size[0] / 2), (cols - centre[1]) / (size[1] / 2)
    if bool(torch.rand(1, generator=g) < 0.5):
        return (dy.abs() <= 1) & (dx.abs() <= 1)
    return dy.square() + dx.square() <= 1


def _panoptic_image(height: int, width: int, num_things: int, num_stuff: int, g: torch.Generator):
    """One image's segment map: stuff classes in 1-3 horizontal bands (one of them sometimes void),
    then 2-6 things painted over it in order, later ones hiding earlier ones as in a panoptic PNG.
    Returns the thing masks (visible parts), their labels and the semantic map (things, stuff, VOID)."""
    semantic = torch.full((height, width), VOID, dtype=torch.int64)
    if num_stuff:
        cuts = torch.sort(torch.randint(1, height, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g)).values
        bounds = [0, *cuts.tolist(), height]
        bands = len(bounds) - 1
        # half the images of two or three bands have a void one (no band of that index: no void)
        void_band = int(torch.randint(0, 2 * bands, (1,), generator=g)) if bands > 1 else bands
        for band, (top, bottom) in enumerate(itertools.pairwise(bounds)):
            if band != void_band:
                semantic[top:bottom] = num_things + int(torch.randint(0, num_stuff, (1,), generator=g))
    owner = torch.full((height, width), -1, dtype=torch.int64)  # which thing each pixel shows
    n = int(torch.randint(2, 7, (1,), generator=g))
    labels = torch.randint(0, num_things, (n,), generator=g)
    for index in range(n):
        owner[_random_shape(height, width, g)] = index
    masks = torch.stack([owner == index for index in range(n)])
    visible = masks.flatten(1).any(1)  # a thing hidden entirely by later ones has no segment
    masks, labels = masks[visible], labels[visible]
    for mask, label in zip(masks, labels):
        semantic[mask] = label
    return masks, labels, semantic


def _mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """x1, y1, x2, y2 of each mask's pixels, x2 and y2 exclusive (COCO's bbox of a segment)."""
    boxes = torch.zeros(len(masks), 4)
    for i, mask in enumerate(masks):
        rows, cols = mask.any(1).nonzero()[:, 0], mask.any(0).nonzero()[:, 0]
        boxes[i] = torch.tensor([cols[0], rows[0], cols[-1] + 1, rows[-1] + 1], dtype=torch.float32)
    return boxes


def synthetic_panoptic_batch(
    batch: int, height: int, width: int, num_things: int, num_stuff: int, device: torch.device, seed: int
) -> dict:
    """Panoptic batch as LoadPanopticAnnotations + PackDetInputs give it: gt_instances of the
    things (bboxes float32, labels int64, masks BitmapMasks of uint8) and gt_sem_seg, a PixelData
    whose sem_seg is (1, H, W) int32 (rgb2id's dtype) with things in [0, num_things), stuff in
    [num_things, num_things + num_stuff) and VOID elsewhere. With no stuff classes (Mask2Former's
    instance configs) there is no gt_sem_seg, as with LoadAnnotations. Each segment's pixels take
    one colour plus noise, so the image shows what the labels say. `device`: as synthetic_batch."""
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData, PixelData

    g = torch.Generator().manual_seed(seed)
    inputs, samples = [], []
    for _ in range(batch):
        masks, labels, semantic = _panoptic_image(height, width, num_things, num_stuff, g)
        palette = torch.randint(0, 256, (num_things + num_stuff + 1, 3), generator=g)
        colour_index = torch.where(semantic == VOID, num_things + num_stuff, semantic)
        noise = torch.randint(-24, 25, (3, height, width), generator=g)
        inputs.append((palette[colour_index].permute(2, 0, 1) + noise).clamp(0, 255).to(torch.uint8))
        sample = _sample(height, width)
        sample.gt_instances = InstanceData(
            bboxes=_mask_boxes(masks),
            labels=labels,
            masks=BitmapMasks(masks.numpy().astype(np.uint8), height, width),
        )
        if num_stuff:
            sample.gt_sem_seg = PixelData(sem_seg=semantic[None].to(torch.int32))
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


def is_panoptic_model(cfg) -> bool:
    """MaskFormer and Mask2Former, panoptic or instance: they train on masks, not boxes."""
    return "panoptic_head" in cfg.model


def thing_and_stuff_classes_of(cfg) -> tuple[int, int]:
    head = cfg.model.panoptic_head
    return head.num_things_classes, head.num_stuff_classes


def num_classes_of(cfg) -> int:
    """The classes the model's head predicts: things plus stuff for a panoptic head, else the
    detection head's num_classes (bbox_head, or Co-DETR's query_head)."""
    if is_panoptic_model(cfg):
        return sum(thing_and_stuff_classes_of(cfg))
    for head in ("bbox_head", "query_head"):
        if head in cfg.model and "num_classes" in cfg.model[head]:
            return cfg.model[head].num_classes
    raise ValueError(f"no panoptic_head, bbox_head or query_head with num_classes in the {cfg.model.type} config")


def fixed_pad_size(cfg) -> tuple[int, int] | None:
    """The (height, width) that a BatchFixedSizePad batch augment pads every training batch to
    (Mask2Former's LSJ configs: 1024x1024), or None."""
    preprocessor = cfg.model.get("data_preprocessor") or {}
    for augment in preprocessor.get("batch_augments") or []:
        if augment.get("type") == "BatchFixedSizePad":
            return tuple(augment["size"])
    return None


def batch_for_config(cfg, batch: int, height: int, width: int, device: torch.device, seed: int) -> dict:
    """The synthetic batch that the config's model trains on. Images larger than a fixed pad size
    are refused: mmdet's BatchFixedSizePad cannot pad their masks (the LSJ pipeline crops every
    image to that size first), and would record a wrong batch_input_shape."""
    pad = fixed_pad_size(cfg)
    if pad and (height > pad[0] or width > pad[1]):
        raise ValueError(
            f"{height}x{width} images do not fit the {pad[0]}x{pad[1]} that this config's BatchFixedSizePad "
            f"pads every training batch to; use at most {pad[0]}x{pad[1]} (the size it trains at)"
        )
    if is_panoptic_model(cfg):
        num_things, num_stuff = thing_and_stuff_classes_of(cfg)
        return synthetic_panoptic_batch(batch, height, width, num_things, num_stuff, device, seed)
    return synthetic_batch(batch, height, width, num_classes_of(cfg), device, seed)
