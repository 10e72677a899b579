# mmdet's Deformable DETR with box refinement, every MultiScaleDeformableAttention on `tma_ws`.
_base_ = 'mmdet::deformable_detr/deformable-detr-refine_r50_16xb2-50e_coco.py'
custom_imports = dict(imports=['mmdeform_tma'], allow_failed_imports=False)
model = dict(
    encoder=dict(layer_cfg=dict(self_attn_cfg=dict(backend='tma_ws'))),
    decoder=dict(layer_cfg=dict(cross_attn_cfg=dict(backend='tma_ws'))))
