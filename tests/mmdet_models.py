"""Building mmdet models from configs in tests: offline (no backbone weights), seeded, and with
every MultiScaleDeformableAttention switched to one backend if asked."""

from __future__ import annotations

import copy

import torch


def build_model(cfg, backend: str | None = "keep", seed: int = 0):
    """The config's model, initialised from `seed`; `backend='keep'` leaves the config's choice,
    None selects mmcv's own forward."""
    from mmcv.ops import MultiScaleDeformableAttention
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    import mmdeform_tma  # noqa: F401  (MultiScaleDeformableAttention takes backend=)

    init_default_scope("mmdet")
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    torch.manual_seed(seed)
    model = MODELS.build(model_cfg)
    model.init_weights()
    if backend != "keep":
        for module in model.modules():
            if isinstance(module, MultiScaleDeformableAttention):
                module.backend = backend
    return model


def switch_off_dropout(model: torch.nn.Module) -> None:
    """Every dropout: the nn.Dropout modules, and nn.MultiheadAttention's own attention dropout
    (a float, not a module; mmcv's MultiheadAttention passes `attn_drop` there). Compiled graphs
    draw dropout masks from other random numbers than eager, so comparisons need both off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0
