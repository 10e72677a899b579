# Deformable DETR (tma_ws kernels) on the offline synthetic set: trains with no download.
#   python tools/make_synthetic_coco.py && python tools/train.py configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py
_base_ = [
    '../deformable_detr/deformable-detr_r50_16xb2-50e_coco_tma-ws.py',
    '../_base_/datasets/synthetic_coco.py',
]
model = dict(
    backbone=dict(init_cfg=None),  # offline: no torchvision weights
    bbox_head=dict(num_classes={{_base_.synthetic_num_classes}}))
train_dataloader = {{_base_.synthetic_train_dataloader}}
val_dataloader = {{_base_.synthetic_val_dataloader}}
test_dataloader = val_dataloader
val_evaluator = {{_base_.synthetic_val_evaluator}}
test_evaluator = val_evaluator

max_epochs = 12
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=4)
param_scheduler = [dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[10], gamma=0.1)]
default_hooks = dict(logger=dict(type='LoggerHook', interval=10), checkpoint=dict(type='CheckpointHook', interval=4))
auto_scale_lr = dict(base_batch_size=4)
