"""mmengine hooks for training runs. Import this module (a config's `custom_imports`) to register them.

`LossOverRanksHook` logs `global_loss`: the training loss averaged over all ranks. mmengine logs
rank 0's own loss, which under DDP is the loss of rank 0's share of the batch only, so it cannot be
set beside a single-GPU run of the same global batch; the average over ranks can (mmdet's DETR
heads already normalise each rank's loss by the number of boxes averaged over ranks).
"""

from __future__ import annotations

import torch
from mmengine import dist
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class LossOverRanksHook(Hook):
    priority = "NORMAL"  # after RuntimeInfoHook has stored the iteration's outputs, before LoggerHook

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if not outputs or "loss" not in outputs:
            return
        loss = torch.tensor(float(outputs["loss"]), dtype=torch.float64, device=dist.get_comm_device())
        dist.all_reduce(loss, op="mean")
        runner.message_hub.update_scalar("train/global_loss", float(loss))
