"""tools/cuda_graph_train_step.py on the CPU: the host-geometry shim changes no result and undoes
itself, unsupported models and a missing GPU are reported. The capture itself is a GPU test
(tests/integrations/test_mmdet_gpu.py)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmdet")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
TINY = str(ROOT / "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py")


@pytest.fixture(scope="module")
def tiny():
    from benchmark_e2e import build_model
    from synthetic_batches import synthetic_batch

    model, cfg = build_model(TINY, "pytorch", torch.device("cpu"), seed=0)
    model.eval()
    batch = model.data_preprocessor(synthetic_batch(2, 96, 128, 3, torch.device("cpu"), seed=0), training=False)
    return model, batch


def transformer_outputs(model, batch):
    with torch.no_grad():
        out = model.forward_transformer(model.extract_feat(batch["inputs"]), batch["data_samples"])
    return out["hidden_states"], out["references"]


def test_static_level_geometry_gives_the_same_forward_and_undoes_itself(tiny):
    from cuda_graph_train_step import static_level_geometry

    model, batch = tiny
    shape_as_tensor = torch._shape_as_tensor
    expected = transformer_outputs(model, batch)
    level_shapes = [tuple(f.shape[-2:]) for f in model.extract_feat(batch["inputs"])]
    with static_level_geometry(model, level_shapes):
        assert torch._shape_as_tensor is not shape_as_tensor
        got = transformer_outputs(model, batch)
        again = transformer_outputs(model, batch)  # answered from the cache this time
    hidden, references = got
    torch.testing.assert_close(hidden, expected[0], rtol=0, atol=0)
    for a, b in zip(references, expected[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(again[0], expected[0], rtol=0, atol=0)
    assert torch._shape_as_tensor is shape_as_tensor
    assert "get_encoder_reference_points" not in vars(model.encoder)


def test_static_level_geometry_rejects_other_level_shapes(tiny):
    from cuda_graph_train_step import static_level_geometry

    model, batch = tiny
    level_shapes = [(h + 1, w) for h, w in (tuple(f.shape[-2:]) for f in model.extract_feat(batch["inputs"]))]
    with static_level_geometry(model, level_shapes), pytest.raises(RuntimeError, match="level shapes"):
        transformer_outputs(model, batch)
    assert "get_encoder_reference_points" not in vars(model.encoder)


def test_unsupported_detectors_are_named(tiny):
    from cuda_graph_train_step import unsupported_reason

    model, _ = tiny
    assert unsupported_reason(model) is None
    model.as_two_stage = True
    try:
        assert "gen_encoder_output_proposals" in unsupported_reason(model)
    finally:
        model.as_two_stage = False
    assert "not one of mmdet's DETR-family" in unsupported_reason(torch.nn.Linear(1, 1))


def test_without_a_gpu_the_tool_says_so(monkeypatch, capsys):
    import cuda_graph_train_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_graph_train_step.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_disable_dropout_reaches_attention_dropout(tiny):
    from cuda_graph_train_step import disable_dropout

    model, _ = tiny
    mha = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert mha and any(m.dropout > 0 for m in mha)  # mmcv's decoder self-attention: attn_drop=0.1
    disable_dropout(model)
    assert all(m.dropout == 0 for m in mha)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
