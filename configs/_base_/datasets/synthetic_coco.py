# The offline detection set written by `python tools/make_synthetic_coco.py`: coloured circles,
# squares and triangles on textured backgrounds, in COCO format. Model configs take these values
# with {{_base_.synthetic_*}} (mmdet's DETR configs already define train_dataloader & co., and
# mmengine forbids the same key in two bases).
synthetic_data_root = 'data/synthetic_coco/'
synthetic_metainfo = dict(
    classes=('circle', 'square', 'triangle'),
    palette=[(220, 20, 60), (0, 128, 0), (0, 0, 142)])
synthetic_num_classes = 3
synthetic_image_scale = (320, 320)

synthetic_train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=synthetic_image_scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
synthetic_test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=synthetic_image_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(
        type='PackDetInputs',
        meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
synthetic_train_dataloader = dict(
    _delete_=True,
    batch_size=4,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    batch_sampler=dict(type='AspectRatioBatchSampler'),
    dataset=dict(
        type='CocoDataset',
        data_root=synthetic_data_root,
        metainfo=synthetic_metainfo,
        ann_file='annotations/instances_train.json',
        data_prefix=dict(img='train/'),
        filter_cfg=dict(filter_empty_gt=False),
        pipeline=synthetic_train_pipeline))
synthetic_val_dataloader = dict(
    _delete_=True,
    batch_size=4,
    num_workers=2,
    persistent_workers=True,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CocoDataset',
        data_root=synthetic_data_root,
        metainfo=synthetic_metainfo,
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'),
        test_mode=True,
        pipeline=synthetic_test_pipeline))
synthetic_val_evaluator = dict(
    _delete_=True,
    type='CocoMetric',
    ann_file=synthetic_data_root + 'annotations/instances_val.json',
    metric='bbox',
    format_only=False)
