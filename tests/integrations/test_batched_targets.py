"""Batched DETR targets (mmdeform_tma/integrations/batched_targets.py) against mmdet's own
`get_targets` and `get_dn_targets`, on the CPU: the same matches and targets, bitwise, on random
batches (boxes per image from none to more than there are queries, images of different sizes,
fp32 and fp16 predictions), without the per-image `nonzero`, `unique` and scalar reads that are
host synchronisations on a GPU; and a Deformable DETR and a DINO that train on them exactly as on
mmdet's. On a GPU the same, and one host synchronisation per batched matching."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmdet")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from synthetic_configs import DETR_R50, DINO, ROOT, TINY  # noqa: E402

from mmdeform_tma.integrations import batched_targets as bt  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))

DETR_COSTS = [
    dict(type="FocalLossCost", weight=2.0),
    dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
    dict(type="IoUCost", iou_mode="giou", weight=2.0),
]
NUM_CLASSES = 8


def head(kind="DeformableDETRHead", costs=DETR_COSTS):
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    init_default_scope("mmdet")
    return MODELS.build(
        dict(
            type=kind,
            num_classes=NUM_CLASSES,
            embed_dims=32,
            sync_cls_avg_factor=True,
            loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
            if kind != "DETRHead"
            else dict(type="CrossEntropyLoss", bg_cls_weight=0.1, use_sigmoid=False, loss_weight=1.0, class_weight=1.0),
            train_cfg=dict(assigner=dict(type="HungarianAssigner", match_costs=costs)),
        )
    )


def random_batch(gt_counts, num_queries=30, dtype=torch.float32, seed=0, channels=NUM_CLASSES):
    """Per image: logits, normalised (cx, cy, w, h) predictions, boxes (x1, y1, x2, y2) in pixels
    inside the image, labels, and the image's meta with its own size, up to 3000 px: beyond 2048 an
    fp16 image size rounds, and mmdet makes each size factor in its own dtype."""
    from mmengine.structures import InstanceData

    g = torch.Generator().manual_seed(seed)
    num_imgs = len(gt_counts)
    scores = torch.randn(num_imgs, num_queries, channels, generator=g).to(dtype)
    preds = (torch.rand(num_imgs, num_queries, 4, generator=g) * 0.8 + 0.1).to(dtype)
    gts, metas = [], []
    for count in gt_counts:
        h, w = (int(v) for v in torch.randint(100, 3000, (2,), generator=g))
        corner = torch.rand(count, 2, generator=g) * torch.tensor([w, h]) * 0.7
        size = torch.rand(count, 2, generator=g) * torch.tensor([w, h]) * 0.3 + 1
        gts.append(
            InstanceData(
                bboxes=torch.cat([corner, corner + size], 1),
                labels=torch.randint(NUM_CLASSES, (count,), generator=g),
            )
        )
        metas.append(dict(img_shape=(h, w)))
    return list(scores), list(preds), gts, metas


def assert_same_targets(expected, got):
    *expected_lists, expected_pos, expected_neg = expected
    *got_lists, got_pos, got_neg = got
    assert (got_pos, got_neg) == (expected_pos, expected_neg)
    for want_list, have_list in zip(expected_lists, got_lists):
        assert len(want_list) == len(have_list)
        for want, have in zip(want_list, have_list):
            assert have.dtype == want.dtype and have.shape == want.shape
            assert torch.equal(have, want)  # bitwise: the same operations on the same values


GT_COUNTS = [[3, 0, 7, 1], [0, 0], [40, 5], [12]]  # no boxes; more boxes (40) than queries (30)


@pytest.mark.parametrize("gt_counts", GT_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_cost_elements", [bt.MAX_COST_ELEMENTS, 1])  # one group, one per image
def test_batched_targets_are_mmdet_s(gt_counts, dtype, max_cost_elements):
    from mmdet.models.dense_heads import DETRHead

    h = head()
    batch = random_batch(gt_counts, dtype=dtype, seed=len(gt_counts))
    expected = DETRHead.get_targets(h, *batch)
    assert_same_targets(expected, bt.batched_get_targets(h, *batch, max_cost_elements=max_cost_elements))


@pytest.mark.parametrize("box_format", ["xywh", "xyxy"])
def test_batched_targets_with_detr_s_softmax_cost(box_format):
    """DETR's own costs: ClassificationCost (softmax over classes and the background)."""
    from mmdet.models.dense_heads import DETRHead

    costs = [
        dict(type="ClassificationCost", weight=1.0),
        dict(type="BBoxL1Cost", weight=5.0, box_format=box_format),
        dict(type="IoUCost", iou_mode="iou", weight=2.0),
    ]
    h = head("DETRHead", costs)
    batch = random_batch([4, 9, 2], channels=NUM_CLASSES + 1, seed=3)
    assert_same_targets(DETRHead.get_targets(h, *batch), bt.batched_get_targets(h, *batch))


@pytest.mark.parametrize("gt_counts", [[3, 0, 5], [0], [6, 6]])
def test_batched_denoising_targets_are_mmdet_s(gt_counts):
    from mmdet.models.dense_heads import DINOHead

    h = head("DINOHead")
    _, _, gts, metas = random_batch(gt_counts, seed=7)
    groups = 3
    dn_meta = dict(num_denoising_queries=groups * 2 * max(max(gt_counts), 1), num_denoising_groups=groups)
    expected = DINOHead.get_dn_targets(h, gts, metas, dn_meta)
    assert_same_targets(expected, bt.batched_get_dn_targets(h, gts, metas, dn_meta))


def test_image_groups_bound_the_cost_matrix():
    assert bt.image_groups(10, [3, 0, 7, 1], 10**6) == [range(0, 4)]
    assert bt.image_groups(10, [3, 0, 7, 1], 1) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # 2 images x 10 queries x 3 boxes = 60 fits, 3 images x 10 x 10 = 300 does not
    assert bt.image_groups(10, [3, 0, 7, 1], 100) == [range(0, 2), range(2, 3), range(3, 4)]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


HOST_SYNCING_OPS = {"nonzero", "_unique2", "unique_dim", "_local_scalar_dense"}  # on a GPU each waits for it


def test_batched_targets_read_nothing_back_per_image():
    """mmdet's target building runs `nonzero` and `unique` per image (host synchronisations on a
    GPU); the batched one runs none, and its one read-back of the cost matrices is a copy."""
    from mmdet.models.dense_heads import DETRHead, DINOHead

    h = head("DINOHead")
    batch = random_batch([3, 5, 2])
    dn_meta = dict(num_denoising_queries=30, num_denoising_groups=3)
    with OpCounter() as mmdet_ops:
        DETRHead.get_targets(h, *batch)
        DINOHead.get_dn_targets(h, batch[2], batch[3], dn_meta)
    with OpCounter() as batched_ops:
        bt.batched_get_targets(h, *batch)
        bt.batched_get_dn_targets(h, batch[2], batch[3], dn_meta)
    assert HOST_SYNCING_OPS & set(mmdet_ops.names)  # the counter sees them
    assert not HOST_SYNCING_OPS & set(batched_ops.names)
    assert len(batched_ops.names) < len(mmdet_ops.names) / 2


def test_heads_that_cannot_be_batched_say_why():
    class OwnTargets(type(head())):
        def _get_targets_single(self, *args):
            raise AssertionError("not called")

    h = head(costs=[*DETR_COSTS, dict(type="DiceCost", weight=1.0)])
    assert bt.unsupported_reasons(h) == [
        "match cost DiceCost is none of FocalLossCost, ClassificationCost, BBoxL1Cost, IoUCost"
    ]
    h = head(costs=[dict(type="FocalLossCost", weight=2.0, binary_input=True)])
    assert "binary_input" in bt.unsupported_reasons(h)[0]
    h = head()
    h.__class__ = OwnTargets
    assert bt.unsupported_reasons(h) == ["OwnTargets overrides DETRHead._get_targets_single"]
    assert bt.unsupported_reasons(torch.nn.Linear(2, 2)) == ["the head is a Linear, not an mmdet DETRHead"]
    assert bt.dn_unsupported_reasons(head()) == ["the head is a DeformableDETRHead, not an mmdet DINOHead"]
    assert bt.unsupported_reasons(head()) == [] and bt.dn_unsupported_reasons(head("DINOHead")) == []


def test_install_replaces_the_head_s_methods_once_and_reports_the_rest():
    class Model(torch.nn.Module):
        def __init__(self, bbox_head):
            super().__init__()
            self.bbox_head = bbox_head

    dino = Model(head("DINOHead"))
    assert bt.batch_detr_targets(dino) == (["get_targets", "get_dn_targets"], [])
    assert bt.batch_detr_targets(dino) == ([], [])  # once
    batch = random_batch([2, 4])
    assert_same_targets(bt.batched_get_targets(dino.bbox_head, *batch), dino.bbox_head.get_targets(*batch))

    assert bt.batch_detr_targets(Model(head())) == (["get_targets"], [])
    dice = Model(head(costs=[dict(type="DiceCost", weight=1.0)]))
    replaced, reasons = bt.batch_detr_targets(dice)
    assert replaced == [] and "DiceCost" in reasons[0]
    assert not hasattr(dice.bbox_head.get_targets, bt.BATCHED_MARK)
    assert bt.batch_detr_targets(torch.nn.Linear(2, 2)) == ([], ["the head is a NoneType, not an mmdet DETRHead"])


def training_losses(config: str, steps: int, batched: bool, size=(128, 128), device="cpu", precision="fp32"):
    """Losses of `steps` training steps, every loss term, from the same initialisation and batches."""
    from benchmark_e2e import build_model, make_optim_wrapper
    from synthetic_batches import synthetic_batch

    device = torch.device(device)
    model, cfg = build_model(config, "pytorch" if device.type == "cpu" else "auto", device, seed=0)
    if batched:
        assert bt.batch_detr_targets(model)[0]
    optim = make_optim_wrapper(model, cfg, precision)
    model.train()
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        out = model.train_step(synthetic_batch(2, *size, 3, device, seed=step), optim)
        losses.append({k: float(v) for k, v in out.items()})
    return losses


@pytest.mark.parametrize("config, size", [(TINY, (128, 128)), (DINO, (256, 256))], ids=["deformable_detr", "dino"])
def test_models_train_on_batched_targets_exactly_as_on_mmdet_s(config, size):
    eager = training_losses(config, 2, batched=False, size=size)
    assert training_losses(config, 2, batched=True, size=size) == eager  # bitwise


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def host_syncs(function, *args) -> tuple[object, list[str]]:
    """`function(*args)` and where it made synchronising CUDA calls (torch's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = function(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gt_counts", [[3, 0, 7, 1], [40, 5]])
@pytest.mark.gpu
@needs_gpu
def test_on_the_gpu_batched_targets_are_mmdet_s_with_one_host_wait(dtype, gt_counts):
    from mmdet.models.dense_heads import DETRHead, DINOHead
    from mmengine.structures import InstanceData

    h = head("DINOHead").cuda()
    scores, preds, gts, metas = random_batch(gt_counts, dtype=dtype, seed=11)
    scores, preds = [s.cuda() for s in scores], [p.cuda() for p in preds]
    gts = [InstanceData(bboxes=g.bboxes.cuda(), labels=g.labels.cuda()) for g in gts]
    dn_meta = dict(num_denoising_queries=2 * 3 * max(gt_counts), num_denoising_groups=3)

    expected, mmdet_syncs = host_syncs(DETRHead.get_targets, h, scores, preds, gts, metas)
    got, syncs = host_syncs(bt.batched_get_targets, h, scores, preds, gts, metas)
    assert_same_targets(expected, got)
    # the read-back (a stream synchronisation), and mmdet's bbox_overlaps (IoUCost), which copies its eps
    # to the GPU; mmdet's: several per image
    assert sorted(where.split(":")[0] for where in syncs) == ["bbox_overlaps.py", "streams.py"], syncs
    assert len(mmdet_syncs) >= 9 * sum(1 for n in gt_counts if n)
    expected, _ = host_syncs(DINOHead.get_dn_targets, h, gts, metas, dn_meta)
    got, syncs = host_syncs(bt.batched_get_dn_targets, h, gts, metas, dn_meta)
    assert_same_targets(expected, got)
    assert syncs == []


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
@pytest.mark.parametrize("config", [DETR_R50, DINO], ids=["deformable_detr", "dino"])
@pytest.mark.gpu
@needs_gpu
def test_on_the_gpu_models_train_on_batched_targets_exactly_as_on_mmdet_s(config, precision):
    """One step, every loss term bitwise: later steps would also see the backward's atomics, whose
    order varies from run to run."""
    eager = training_losses(config, 1, batched=False, size=(512, 640), device="cuda", precision=precision)
    assert training_losses(config, 1, batched=True, size=(512, 640), device="cuda", precision=precision) == eager
