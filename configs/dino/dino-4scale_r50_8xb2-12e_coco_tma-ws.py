# mmdet's DINO-4scale with every MultiScaleDeformableAttention on mmdeform_tma's `tma_ws` kernels.
_base_ = 'mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py'
custom_imports = dict(imports=['mmdeform_tma'], allow_failed_imports=False)
model = dict(
    encoder=dict(layer_cfg=dict(self_attn_cfg=dict(backend='tma_ws'))),
    decoder=dict(layer_cfg=dict(cross_attn_cfg=dict(backend='tma_ws'))))
