"""tools/synthetic_batches.py: batches that repeat with their seed, panoptic ground truth that agrees
with itself (masks, boxes, gt_sem_seg) and with what Mask2Former's head expects, and one CPU
training and test step of Mask2Former on them."""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mmdet")
from mmengine.config import Config  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402

import mmdeform_tma  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from synthetic_batches import (  # noqa: E402
    VOID,
    batch_for_config,
    fixed_pad_size,
    is_panoptic_model,
    num_classes_of,
    synthetic_batch,
    synthetic_panoptic_batch,
)

MASK2FORMER = ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py"
DEFORMABLE_DETR = ROOT / "configs/deformable_detr/deformable-detr_r50_16xb2-50e_coco_tma-ws.py"
DINO = ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_tma-ws.py"
CPU = torch.device("cpu")
THINGS, STUFF = 80, 53  # COCO panoptic


def fields(batch) -> list:
    """Everything a batch holds, as tensors or arrays, in a fixed order."""
    out = list(batch["inputs"])
    for sample in batch["data_samples"]:
        out += [sample.gt_instances.bboxes, sample.gt_instances.labels]
        if "masks" in sample.gt_instances:
            out.append(sample.gt_instances.masks.masks)
        if "gt_sem_seg" in sample:
            out.append(sample.gt_sem_seg.sem_seg)
    return out


def identical(a, b) -> bool:
    fa, fb = fields(a), fields(b)
    return len(fa) == len(fb) and all(
        x.shape == y.shape and x.dtype == y.dtype and bool((np.asarray(x) == np.asarray(y)).all())
        for x, y in zip(fa, fb)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: synthetic_batch(3, 64, 96, 80, CPU, seed),
        lambda seed: synthetic_panoptic_batch(3, 64, 96, THINGS, STUFF, CPU, seed),
    ],
    ids=["detection", "panoptic"],
)
def test_same_seed_same_batch_other_seed_other_batch(make):
    assert identical(make(7), make(7))
    assert not identical(make(7), make(8))


def box_of(mask: np.ndarray) -> list[float]:
    rows, cols = np.nonzero(mask)
    return [cols.min(), rows.min(), cols.max() + 1, rows.max() + 1]


def test_panoptic_ground_truth_is_one_consistent_segmentation():
    height, width = 80, 112
    batch = synthetic_panoptic_batch(8, height, width, THINGS, STUFF, CPU, seed=3)
    seen_stuff = seen_void = 0
    for image, sample in zip(batch["inputs"], batch["data_samples"]):
        assert image.shape == (3, height, width) and image.dtype == torch.uint8
        gt = sample.gt_instances
        masks = gt.masks.masks
        assert masks.dtype == np.uint8 and masks.shape == (len(gt.labels), height, width)
        assert len(gt.labels) >= 1 and gt.labels.dtype == torch.int64
        assert ((gt.labels >= 0) & (gt.labels < THINGS)).all()
        assert (masks.reshape(len(masks), -1).sum(1) > 0).all()
        assert masks.sum(0).max() <= 1  # a pixel belongs to one thing at most
        assert gt.bboxes.dtype == torch.float32
        assert gt.bboxes.tolist() == [box_of(m) for m in masks]
        sem_seg = sample.gt_sem_seg.sem_seg
        assert sem_seg.shape == (1, height, width) and sem_seg.dtype == torch.int32
        sem = sem_seg[0].numpy()
        assert (((sem >= 0) & (sem < THINGS + STUFF)) | (sem == VOID)).all()
        for mask, label in zip(masks.astype(bool), gt.labels.tolist()):
            assert (sem[mask] == label).all()
        background = sem[masks.sum(0) == 0]
        assert (background >= THINGS).all()  # stuff or void where no thing is
        seen_stuff += int(((background >= THINGS) & (background != VOID)).any())
        seen_void += int((background == VOID).any())
    assert seen_stuff and seen_void


def test_without_stuff_classes_there_is_no_semantic_map():
    """Mask2Former's instance configs (num_stuff_classes=0) load no gt_sem_seg."""
    batch = synthetic_panoptic_batch(2, 64, 96, THINGS, 0, CPU, seed=0)
    assert all("gt_sem_seg" not in s and len(s.gt_instances.masks) >= 1 for s in batch["data_samples"])


def test_the_config_picks_the_batch_and_the_class_count():
    mask2former, detr, dino = (Config.fromfile(str(p)) for p in (MASK2FORMER, DEFORMABLE_DETR, DINO))
    assert is_panoptic_model(mask2former) and num_classes_of(mask2former) == THINGS + STUFF
    assert not is_panoptic_model(detr) and num_classes_of(detr) == 80 and num_classes_of(dino) == 80
    panoptic = batch_for_config(mask2former, 2, 64, 96, CPU, seed=1)
    assert identical(panoptic, synthetic_panoptic_batch(2, 64, 96, THINGS, STUFF, CPU, seed=1))
    assert identical(batch_for_config(detr, 2, 64, 96, CPU, seed=1), synthetic_batch(2, 64, 96, 80, CPU, seed=1))
    with pytest.raises(ValueError, match="num_classes"):
        num_classes_of(Config(dict(model=dict(type="SomeSegmentor", decode_head=dict()))))


def test_images_larger_than_the_lsj_pad_size_are_refused():
    """benchmark_e2e's default 800x1216 would fail inside mmdet's BatchFixedSizePad (1024x1024)."""
    mask2former = Config.fromfile(str(MASK2FORMER))
    assert fixed_pad_size(mask2former) == (1024, 1024)
    assert fixed_pad_size(Config.fromfile(str(DEFORMABLE_DETR))) is None
    with pytest.raises(ValueError, match="at most 1024x1024"):
        batch_for_config(mask2former, 1, 800, 1216, CPU, seed=0)
    assert len(batch_for_config(mask2former, 1, 1024, 1024, CPU, seed=0)["inputs"]) == 1


def small_mask2former(pixel_decoder_backend="pytorch", seed=0):
    """Mask2Former R50 from the tma_ws config, whole, made cheap for the CPU by leaving out the
    padding of every batch to 1024x1024 (BatchFixedSizePad), and by small images."""
    from mmdet.registry import MODELS
    from mmengine.optim import build_optim_wrapper

    cfg = Config.fromfile(str(MASK2FORMER))
    init_default_scope("mmdet")
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    model_cfg.data_preprocessor.batch_augments = None
    model_cfg.panoptic_head.pixel_decoder.encoder.layer_cfg.self_attn_cfg.backend = pixel_decoder_backend
    torch.manual_seed(seed)
    model = MODELS.build(model_cfg)
    model.init_weights()
    return model, cfg, build_optim_wrapper(model, cfg.optim_wrapper)


def test_mask2former_head_reads_the_panoptic_batch_as_the_real_pipeline_gives_it():
    model, cfg, _ = small_mask2former()
    batch = batch_for_config(cfg, 2, 64, 96, CPU, seed=4)
    data = model.data_preprocessor(batch, True)
    samples = data["data_samples"]
    targets = model.panoptic_head.preprocess_gt([s.gt_instances for s in samples], [s.gt_sem_seg for s in samples])
    for target, sample in zip(targets, samples):
        sem = sample.gt_sem_seg.sem_seg[0]
        stuff = sorted(set(sem.unique().tolist()) - {VOID} - set(range(THINGS)))
        assert stuff  # every image of this seed has a stuff band
        assert target.labels.tolist() == sample.gt_instances.labels.tolist() + stuff
        assert target.masks.shape == (len(target.labels), *data["inputs"].shape[-2:])
        for mask, label in zip(target.masks[-len(stuff):], stuff):
            assert torch.equal(mask, sem == label)


def test_mask2former_trains_and_predicts_on_the_cpu():
    model, cfg, optim_wrapper = small_mask2former()
    model.train()
    losses = model.train_step(batch_for_config(cfg, 2, 64, 96, CPU, seed=0), optim_wrapper)
    assert {"loss_cls", "loss_mask", "loss_dice", "d0.loss_mask"} <= set(losses)
    assert all(torch.isfinite(v).all() for v in losses.values())
    model.eval()
    with torch.no_grad():
        results = model.test_step(batch_for_config(cfg, 2, 64, 96, CPU, seed=1))
    assert len(results) == 2 and results[0].pred_panoptic_seg.sem_seg.shape == (1, 64, 96)
