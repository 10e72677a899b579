# mmdet's panoptic Mask2Former with every MultiScaleDeformableAttention on `tma_ws`: they are the
# pixel decoder's encoder layers (the transformer decoder uses plain MultiheadAttention).
_base_ = 'mmdet::mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic.py'
custom_imports = dict(imports=['mmdeform_tma'], allow_failed_imports=False)
model = dict(
    panoptic_head=dict(
        pixel_decoder=dict(
            encoder=dict(layer_cfg=dict(self_attn_cfg=dict(backend='tma_ws'))))))
