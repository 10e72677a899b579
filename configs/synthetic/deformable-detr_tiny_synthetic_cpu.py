# A tiny Deformable DETR for CPU smoke tests: ResNet-18, one encoder and one decoder layer,
# 64-wide embeddings (8 heads x 8 channels), 128 px images; the `pytorch` reference backend.
_base_ = './deformable-detr_r50_synthetic_tma-ws.py'
embed_dims = 64
msda = dict(embed_dims=embed_dims, num_heads=8, num_levels=4, num_points=2, backend='pytorch')
model = dict(
    num_queries=50,
    backbone=dict(depth=18, init_cfg=None),
    neck=dict(in_channels=[128, 256, 512], out_channels=embed_dims, norm_cfg=dict(type='GN', num_groups=8)),
    encoder=dict(
        num_layers=1,
        layer_cfg=dict(
            self_attn_cfg=msda,
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128))),
    decoder=dict(
        num_layers=1,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=8),
            cross_attn_cfg=msda,
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128))),
    positional_encoding=dict(num_feats=embed_dims // 2),
    bbox_head=dict(embed_dims=embed_dims))
tiny_scale = (128, 128)
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(pipeline=[
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True),
        dict(type='Resize', scale=tiny_scale, keep_ratio=True),
        dict(type='PackDetInputs'),
    ]))
val_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(pipeline=[
        dict(type='LoadImageFromFile'),
        dict(type='Resize', scale=tiny_scale, keep_ratio=True),
        dict(type='LoadAnnotations', with_bbox=True),
        dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
    ]))
test_dataloader = val_dataloader
