"""mmcv's MultiScaleDeformableAttention with backend=: construction, state dicts, outputs, AMP dtypes."""

import pytest
import torch

pytest.importorskip("mmcv.ops")
from mmcv.ops import MultiScaleDeformableAttention  # noqa: E402

import mmdeform_tma  # noqa: E402,F401
from mmdeform_tma.integrations import mmcv as integration  # noqa: E402

SHAPES = [(6, 8), (3, 4), (2, 2), (1, 1)]


def module_inputs(batch=2, queries=7, embed=64, levels=4, generator=None):
    g = generator or torch.Generator().manual_seed(0)
    shapes = torch.tensor(SHAPES[:levels], dtype=torch.long)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    keys = int((shapes[:, 0] * shapes[:, 1]).sum())
    return dict(
        query=torch.randn(batch, queries, embed, generator=g),
        value=torch.randn(batch, keys, embed, generator=g),
        query_pos=torch.randn(batch, queries, embed, generator=g),
        reference_points=torch.rand(batch, queries, levels, 2, generator=g),
        spatial_shapes=shapes,
        level_start_index=starts,
    )


def make(backend=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    return MultiScaleDeformableAttention(embed_dims=64, num_heads=8, num_levels=4, num_points=2, batch_first=True, dropout=0.0, backend=backend, **kwargs)


def test_patch_is_in_place_and_idempotent():
    assert MultiScaleDeformableAttention._mmdeform_tma_installed
    integration.install()
    from mmcv.cnn.bricks.transformer import MultiScaleDeformableAttention as same

    assert same is MultiScaleDeformableAttention


def test_unknown_backend_fails_at_construction_with_valid_names():
    with pytest.raises(ValueError, match="from its backend argument: unknown backend 'triton'; valid names: auto, tma_ws, cuda"):
        make("triton")


def test_a_retired_backend_fails_at_construction_with_its_replacement(monkeypatch):
    monkeypatch.setenv("MMDEFORM_TMA_BACKEND", "tma")
    with pytest.raises(ValueError, match="from MMDEFORM_TMA_BACKEND: backend 'tma' no longer exists: .* use 'tma_ws'"):
        make("tma_ws")


def test_no_backend_keeps_mmcvs_forward():
    module = make(None)
    assert module.backend is None
    inputs = module_inputs()
    out = module(**inputs)
    # mmcv's own forward host-checks num_keys with an assert; ours does not reach it
    bad = dict(inputs, value=inputs["value"][:, :-1])
    with pytest.raises(AssertionError):
        module(**bad)
    assert out.shape == (2, 7, 64)


def test_state_dict_keys_and_init_are_unchanged():
    stock, plugged = make(None, seed=3), make("pytorch", seed=3)
    assert list(stock.state_dict()) == list(plugged.state_dict())
    for key, tensor in stock.state_dict().items():
        assert torch.equal(tensor, plugged.state_dict()[key]), key
    plugged.load_state_dict(stock.state_dict())
    stock.load_state_dict(plugged.state_dict())


@pytest.mark.parametrize("batch_first", [True, False])
def test_pytorch_backend_matches_stock_mmcv(batch_first):
    stock, plugged = make(None, seed=1), make("pytorch", seed=1)
    stock.batch_first = plugged.batch_first = batch_first
    for m in (stock, plugged):  # non-trivial sampling offsets and attention logits
        torch.manual_seed(2)
        torch.nn.init.normal_(m.sampling_offsets.weight, std=0.05)
        torch.nn.init.normal_(m.attention_weights.weight, std=0.05)
    inputs = module_inputs()
    if not batch_first:
        inputs = {k: (v.transpose(0, 1) if k in ("query", "value", "query_pos") else v) for k, v in inputs.items()}
    torch.testing.assert_close(plugged(**inputs), stock(**inputs), rtol=1e-5, atol=1e-6)


def test_residual_keyword_and_box_reference_points():
    stock, plugged = make(None, seed=4), make("pytorch", seed=4)
    inputs = module_inputs()
    boxes = torch.cat([inputs["reference_points"], torch.rand(2, 7, 4, 2) * 0.3], -1)
    identity = torch.randn(2, 7, 64)
    inputs = dict(inputs, reference_points=boxes)
    with pytest.warns(Warning):
        got = plugged(**inputs, residual=identity)
    torch.testing.assert_close(got, stock(**inputs, identity=identity), rtol=1e-5, atol=1e-6)


def test_three_dimensional_reference_is_rejected():
    inputs = module_inputs()
    inputs["reference_points"] = torch.rand(2, 7, 4, 3)
    with pytest.raises(ValueError, match="Last dim of reference_points must be 2 or 4"):
        make("pytorch")(**inputs)


def test_registry_and_mmdet_layer_paths():
    from mmengine.registry import MODELS

    built = MODELS.build(dict(type="MultiScaleDeformableAttention", embed_dims=64, num_heads=8, backend="pytorch"))
    assert isinstance(built, MultiScaleDeformableAttention) and built.backend == "pytorch"
    layers = pytest.importorskip("mmdet.models.layers.transformer.deformable_detr_layers")
    layer = layers.DeformableDetrTransformerEncoderLayer(self_attn_cfg=dict(embed_dims=256, backend="auto"))
    assert layer.self_attn.backend == "auto"


def test_environment_variable_decides_every_module(monkeypatch):
    monkeypatch.setenv(integration.ENV_VAR, "pytorch")
    assert make(None).backend == "pytorch"
    assert make("tma_ws").backend == "pytorch"  # the process-wide switch wins over the config
    monkeypatch.setenv(integration.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="from MMDEFORM_TMA_BACKEND: unknown backend 'nope'"):
        make(None)


def test_forced_backend_that_cannot_run_raises_at_forward():
    module = make("tma_ws")
    with pytest.raises(mmdeform_tma.BackendUnavailableError, match="runs on cuda, not cpu"):
        module(**module_inputs())


def test_locations_and_weights_stay_float32_under_autocast(monkeypatch):
    seen = {}
    original = integration.backend_forward.__globals__.get("multi_scale_deformable_attn")

    def spy(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, **kwargs):
        seen.update(value=value.dtype, loc=sampling_locations.dtype, attn=attention_weights.dtype)
        return mmdeform_tma.multi_scale_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, **kwargs)

    import mmdeform_tma.functional as functional

    monkeypatch.setattr(functional, "multi_scale_deformable_attn", spy)
    assert original is None  # imported inside the function, so the patch above is what it calls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = make("pytorch")(**module_inputs())
    assert seen == {"value": torch.bfloat16, "loc": torch.float32, "attn": torch.float32}
    assert torch.isfinite(out).all()


def test_module_compiles_fullgraph_with_the_reference_backend():
    torch._dynamo.reset()
    module = make("pytorch").eval()
    inputs = module_inputs()
    with torch.no_grad():
        eager = module(**inputs)
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")(**inputs)
    torch.testing.assert_close(compiled, eager)
