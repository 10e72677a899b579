"""Batched training targets for DETR heads, on the fast path: mmdet's Hungarian matching and target
building for every image of a batch at once, with mmdet's results.

mmdet's `DETRHead.get_targets` works image by image, for every decoder layer. Per image,
`HungarianAssigner.assign` issues about 80 kernel launches and five host synchronisations (each
match cost's kernels, the L1 cost's image size copied to the GPU, the cost matrix copied back, the
two match index arrays copied over, `bbox_overlaps` copying its eps), and the target building six
more (`nonzero` and `unique` twice each, the image size again, a scalar assigned into the box
weights): 11 per image, 528 per Deformable DETR bs 8 iteration of 48 matchings (H100, commit
84188f7, docs/benchmarks.md, session 18), where the assigner alone had taken 157 profiled host ms of
an iteration of 327 (commit 0d33360, session 11). DINO's denoising targets are built
the same way, image by image and layer by layer, without a solve.

Here, per decoder layer:
- the image sizes, and each ground-truth box's image size, reach the GPU in one copy that does not
  wait (pinned, non-blocking);
- the match costs are the assigner's own cost objects, each called once on every prediction of the
  batch against every ground-truth box of the batch. Blocks off the diagonal pair a prediction with
  another image's boxes and are never read: wasted work on a matrix of a few hundred kilobytes,
  bounded by `max_cost_elements` (images are matched in groups beyond it). `BBoxL1Cost` alone
  normalises by one image's size; it is computed here, with each row's and column's own image
  size, in mmdet's operations;
- the cost matrices come back to the host together, one synchronisation (`IoUCost`'s
  `bbox_overlaps` adds one of its own: it copies its eps to the GPU), and SciPy solves each
  image's block as mmdet does;
- the matches go to the GPU in one copy that does not wait, and the targets of all images are built
  in a few launches; the positive and negative counts are known on the host.
Each value goes through the same floating-point operations as in mmdet, so the matches and targets
are mmdet's bitwise (tests/integrations/test_batched_targets.py).

The cost types supported are those of mmdet's DETR-family configs: `FocalLossCost` (of class
labels), `ClassificationCost`, `BBoxL1Cost` and `IoUCost`. A head with another cost, another
assigner, or its own `get_targets` keeps mmdet's, and the reasons are logged.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from mmdet.models.dense_heads import DETRHead, DINOHead
from mmdet.models.task_modules.assigners import HungarianAssigner
from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, ClassificationCost, FocalLossCost, IoUCost
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy, bbox_xyxy_to_cxcywh
from mmengine.model import is_model_wrapper
from mmengine.structures import InstanceData
from scipy.optimize import linear_sum_assignment

SUPPORTED_COSTS = (FocalLossCost, ClassificationCost, BBoxL1Cost, IoUCost)  # exactly these classes
# Predictions x ground-truth boxes per cost matrix. Each cost's intermediates are of this size
# (IoUCost's GIoU holds several): 4 M elements stay in tens of MB. Deformable DETR at bs 8 with 7 boxes
# per image needs 0.13 M, DINO at bs 16 with 50 per image 11.5 M (matched in two groups).
MAX_COST_ELEMENTS = 1 << 22
BATCHED_MARK = "_mmdeform_tma_batched"


def unsupported_reasons(head) -> list[str]:
    """Why `head`'s targets cannot be batched here (empty: they can)."""
    if not isinstance(head, DETRHead):
        return [f"the head is a {type(head).__name__}, not an mmdet DETRHead"]
    reasons = [
        f"{type(head).__name__} overrides DETRHead.{name}"
        for name in ("get_targets", "_get_targets_single")
        if getattr(type(head), name) is not getattr(DETRHead, name)
    ]
    assigner = getattr(head, "assigner", None)
    if type(assigner) is not HungarianAssigner:
        reasons.append(f"its assigner is a {type(assigner).__name__}, not a HungarianAssigner")
        return reasons
    for cost in assigner.match_costs:
        if type(cost) not in SUPPORTED_COSTS:
            names = ", ".join(c.__name__ for c in SUPPORTED_COSTS)
            reasons.append(f"match cost {type(cost).__name__} is none of {names}")
        elif isinstance(cost, FocalLossCost) and cost.binary_input:
            reasons.append("FocalLossCost with binary_input=True matches masks, not labels")
    return reasons


def dn_unsupported_reasons(head) -> list[str]:
    """Why `head`'s denoising targets cannot be batched here (empty: they can)."""
    if not isinstance(head, DINOHead):
        return [f"the head is a {type(head).__name__}, not an mmdet DINOHead"]
    return [
        f"{type(head).__name__} overrides DINOHead.{name}"
        for name in ("get_dn_targets", "_get_dn_targets_single")
        if getattr(type(head), name) is not getattr(DINOHead, name)
    ]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to a GPU through pinned memory, so the copy does not wait for the
    GPU's queue (a pageable one would)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def image_factors(batch_img_metas, gt_counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's (w, h, w, h), and each ground-truth box's image's, float32 on `device`, in one copy."""
    per_image = np.array([[w, h, w, h] for h, w in (meta["img_shape"] for meta in batch_img_metas)], np.float32)
    per_box = per_image[np.repeat(np.arange(len(gt_counts)), gt_counts)]
    factors = to_device(np.concatenate([per_image, per_box]), device)
    return factors[: len(gt_counts)], factors[len(gt_counts) :]


def l1_cost(cost: BBoxL1Cost, pred_xyxy, pred_factors, gt_xyxy, gt_factors) -> torch.Tensor:
    """BBoxL1Cost, each row and column normalised by its own image's size (mmdet's: by one image's)."""
    if cost.box_format == "xywh":
        gt_xyxy, pred_xyxy = bbox_xyxy_to_cxcywh(gt_xyxy), bbox_xyxy_to_cxcywh(pred_xyxy)
    # mmdet's factor is made like the ground truth's boxes, in their dtype
    gt_boxes = gt_xyxy / gt_factors.to(gt_xyxy.dtype)
    pred_boxes = pred_xyxy / pred_factors.to(gt_xyxy.dtype)
    return torch.cdist(pred_boxes, gt_boxes, p=1) * cost.weight


def cost_matrix(assigner, scores, pred_xyxy, pred_factors, gt_labels, gt_xyxy, gt_factors) -> torch.Tensor:
    """The assigner's summed match costs of every prediction row against every ground-truth column."""
    preds = InstanceData(scores=scores, bboxes=pred_xyxy)
    gts = InstanceData(labels=gt_labels, bboxes=gt_xyxy)
    costs = [
        l1_cost(cost, pred_xyxy, pred_factors, gt_xyxy, gt_factors)
        if isinstance(cost, BBoxL1Cost)
        else cost(pred_instances=preds, gt_instances=gts)  # no image size in these
        for cost in assigner.match_costs
    ]
    return torch.stack(costs).sum(dim=0)


def image_groups(num_queries: int, gt_counts: list[int], max_cost_elements: int) -> list[range]:
    """Consecutive images whose predictions x boxes stay within `max_cost_elements` (one image at least)."""
    groups, start, boxes = [], 0, 0
    for i, count in enumerate(gt_counts):
        if i > start and (i + 1 - start) * num_queries * (boxes + count) > max_cost_elements:
            groups.append(range(start, i))
            start, boxes = i, 0
        boxes += count
    groups.append(range(start, len(gt_counts)))
    return groups


def hungarian_matches(
    assigner, scores, pred_xyxy, pred_factors, gt_labels, gt_xyxy, gt_factors, gt_counts, max_cost_elements
):
    """Per image, SciPy's (rows, columns) on its block of the cost matrix, as mmdet's assigner solves
    it; the column is the box's index within its image. One host synchronisation in all."""
    num_queries = pred_xyxy.size(1)
    offsets = np.concatenate([[0], np.cumsum(gt_counts)])
    pending = []  # (group, its cost matrix on its way to the host)
    for group in image_groups(num_queries, gt_counts, max_cost_elements):
        first_box, end_box = offsets[group.start], offsets[group.stop]
        if first_box == end_box:
            continue  # no boxes: mmdet assigns every prediction to the background without a cost
        rows = slice(group.start * num_queries, group.stop * num_queries)
        cost = cost_matrix(
            assigner,
            scores.flatten(0, 1)[rows],
            pred_xyxy.flatten(0, 1)[rows],
            pred_factors[:, None].expand(-1, num_queries, -1).flatten(0, 1)[rows],
            gt_labels[first_box:end_box],
            gt_xyxy[first_box:end_box],
            gt_factors[first_box:end_box],
        )
        pending.append((group, cost.detach().to("cpu", non_blocking=True)))
    if pending and pred_xyxy.device.type == "cuda":
        torch.cuda.current_stream(pred_xyxy.device).synchronize()
    matches = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(gt_counts)
    for group, cost in pending:
        for i in group:
            if gt_counts[i]:
                rows = slice((i - group.start) * num_queries, (i - group.start + 1) * num_queries)
                cols = slice(offsets[i] - offsets[group.start], offsets[i + 1] - offsets[group.start])
                matches[i] = linear_sum_assignment(cost[rows, cols])
    return matches


def per_image(num_imgs: int, rows: int, *batched: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each tensor of all images' rows (`rows` per image) as mmdet returns it: a list of per-image views."""
    return [list(t.view(num_imgs, rows, *t.shape[1:]).unbind(0)) for t in batched]


def batched_get_targets(
    head, cls_scores_list, bbox_preds_list, batch_gt_instances, batch_img_metas, max_cost_elements=MAX_COST_ELEMENTS
) -> tuple:
    """DETRHead.get_targets for all images at once: the same outputs (per-image lists, here views of
    batch tensors, and the host counts of positives and negatives)."""
    scores, bbox_preds = torch.stack(cls_scores_list), torch.stack(bbox_preds_list)
    num_imgs, num_queries = bbox_preds.shape[:2]
    device = bbox_preds.device
    gt_counts = [len(gt) for gt in batch_gt_instances]
    gt_labels = torch.cat([gt.labels for gt in batch_gt_instances])
    gt_xyxy = torch.cat([gt.bboxes for gt in batch_gt_instances])
    factors, gt_factors = image_factors(batch_img_metas, gt_counts, device)
    # mmdet's factor is made like the predictions, in their dtype
    pred_factors, gt_pred_factors = factors.to(bbox_preds.dtype), gt_factors.to(bbox_preds.dtype)
    pred_xyxy = bbox_cxcywh_to_xyxy(bbox_preds) * pred_factors[:, None]

    matches = hungarian_matches(
        head.assigner, scores, pred_xyxy, factors, gt_labels, gt_xyxy, gt_factors, gt_counts, max_cost_elements
    )
    offsets = np.cumsum([0] + gt_counts[:-1])
    rows = np.concatenate([r + i * num_queries for i, (r, _) in enumerate(matches)]).astype(np.int64)
    cols = np.concatenate([c + offsets[i] for i, (_, c) in enumerate(matches)]).astype(np.int64)
    pos_rows, pos_cols = to_device(np.stack([rows, cols]), device)

    total = num_imgs * num_queries
    labels = gt_xyxy.new_full((total,), head.num_classes, dtype=torch.long)
    labels[pos_rows] = gt_labels[pos_cols]
    label_weights = gt_xyxy.new_ones(total)
    bbox_targets = gt_xyxy.new_zeros((total, 4))
    bbox_weights = gt_xyxy.new_zeros((total, 4))
    bbox_weights.index_fill_(0, pos_rows, 1.0)  # `[rows] = 1.0` would copy the 1.0 over, a host wait
    bbox_targets[pos_rows] = bbox_xyxy_to_cxcywh(gt_xyxy[pos_cols] / gt_pred_factors[pos_cols])
    num_pos = len(rows)
    targets = per_image(num_imgs, num_queries, labels, label_weights, bbox_targets, bbox_weights)
    return (*targets, num_pos, total - num_pos)


def batched_get_dn_targets(head, batch_gt_instances, batch_img_metas, dn_meta) -> tuple:
    """DINOHead.get_dn_targets for all images at once: the same outputs. Each box is a positive in
    every denoising group, at its index within the group; no solve, no host synchronisation."""
    num_groups = dn_meta["num_denoising_groups"]
    num_dn_queries = dn_meta["num_denoising_queries"]
    per_group = int(num_dn_queries / num_groups)
    gt_counts = [len(gt) for gt in batch_gt_instances]
    gt_labels = torch.cat([gt.labels for gt in batch_gt_instances])
    gt_xyxy = torch.cat([gt.bboxes for gt in batch_gt_instances])
    device = gt_xyxy.device
    _, gt_factors = image_factors(batch_img_metas, gt_counts, device)

    offsets = np.cumsum([0] + gt_counts[:-1])
    group_starts = np.arange(num_groups)[:, None] * per_group
    rows = [(group_starts + np.arange(n)).ravel() + i * num_dn_queries for i, n in enumerate(gt_counts)]
    cols = [np.tile(np.arange(n), num_groups) + offsets[i] for i, n in enumerate(gt_counts)]
    pos_rows, pos_cols = to_device(np.stack([np.concatenate(rows), np.concatenate(cols)]).astype(np.int64), device)

    total = len(gt_counts) * num_dn_queries
    labels = gt_xyxy.new_full((total,), head.num_classes, dtype=torch.long)
    labels[pos_rows] = gt_labels[pos_cols]
    label_weights = gt_xyxy.new_ones(total)
    bbox_targets = torch.zeros(total, 4, device=device)  # mmdet's: the default dtype
    bbox_weights = torch.zeros(total, 4, device=device)
    bbox_weights.index_fill_(0, pos_rows, 1.0)  # `[rows] = 1.0` would copy the 1.0 over, a host wait
    box_targets = bbox_xyxy_to_cxcywh(gt_xyxy / gt_factors.to(gt_xyxy.dtype))
    bbox_targets[pos_rows] = box_targets[pos_cols]
    num_pos = num_groups * sum(gt_counts)  # the negatives: each positive's query shifted by half a group
    targets = per_image(len(gt_counts), num_dn_queries, labels, label_weights, bbox_targets, bbox_weights)
    return (*targets, num_pos, num_pos)


def batch_detr_targets(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Give the model's DETR head (`bbox_head`) batched target building, in place: `get_targets`,
    and a DINO head's `get_dn_targets` too. Returns (the methods replaced, the reasons the others
    were not); calling it again replaces nothing more."""
    if is_model_wrapper(model):
        model = model.module
    head = getattr(model, "bbox_head", None)
    replaced, reasons = [], []
    for name, batched, why_not in (
        ("get_targets", batched_get_targets, unsupported_reasons),
        ("get_dn_targets", batched_get_dn_targets, dn_unsupported_reasons),
    ):
        if name == "get_dn_targets" and not isinstance(head, DINOHead):
            continue  # only DINO heads have denoising targets
        not_here = why_not(head)
        if not_here:
            reasons.extend(not_here)
        elif not getattr(getattr(head, name), BATCHED_MARK, False):
            method = functools.partial(batched, head)
            setattr(method, BATCHED_MARK, True)
            setattr(head, name, method)
            replaced.append(name)
    return replaced, reasons
