# The multi-GPU check: the same global batch of 4 on one GPU, or as 2 per GPU on two, must give
# the same loss curve.
#   python tools/train.py CONFIG --work-dir work_dirs/parity_1gpu
#   bash tools/dist_train.sh CONFIG 2 --work-dir work_dirs/parity_2gpu --cfg-options train_dataloader.batch_size=2
#   python tools/compare_loss_curves.py work_dirs/parity_1gpu work_dirs/parity_2gpu
# Everything that would let the two runs draw different numbers is off: random flips, dropout,
# aspect-ratio grouping (it forms batches per rank) and mixed image sizes (padding depends on the
# batch's members). `global_loss` is the loss averaged over ranks, logged every iteration.
_base_ = './deformable-detr_r50_synthetic_tma-ws.py'
custom_imports = dict(imports=['mmdeform_tma', 'mmdeform_tma.integrations.mmengine_hooks'], allow_failed_imports=False)

no_dropout_msda = dict(dropout=0.0)
model = dict(
    encoder=dict(layer_cfg=dict(self_attn_cfg=no_dropout_msda, ffn_cfg=dict(ffn_drop=0.0))),
    decoder=dict(
        layer_cfg=dict(
            self_attn_cfg=dict(dropout=0.0),
            cross_attn_cfg=no_dropout_msda,
            ffn_cfg=dict(ffn_drop=0.0))))

parity_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale={{_base_.synthetic_image_scale}}, keep_ratio=False),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(
    batch_size=4,
    sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
    batch_sampler=None,
    dataset=dict(pipeline=parity_pipeline))

max_epochs = 1
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = []
randomness = dict(seed=0)
custom_hooks = [dict(type='LossOverRanksHook')]
default_hooks = dict(logger=dict(type='LoggerHook', interval=1), checkpoint=dict(type='CheckpointHook', interval=max_epochs + 1, save_last=False))
log_processor = dict(window_size=1)
val_cfg = val_dataloader = val_evaluator = None  # training curves only
