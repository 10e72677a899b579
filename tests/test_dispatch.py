"""Backend selection: 'auto' takes the first able backend; a named one runs or raises its reasons."""

import pytest
import torch

import mmdeform_tma
from mmdeform_tma import dispatch
from mmdeform_tma.backends import BACKENDS
from mmdeform_tma.inputs import validate
from msda_cases import make_problem


@pytest.fixture
def inputs(generator):
    problem = make_problem([(4, 3), (2, 2)], dtype=torch.float32, generator=generator)
    return validate(*problem.args())


def test_auto_on_cpu_picks_pytorch(inputs):
    assert dispatch.select_backend("auto", inputs).name == "pytorch"


@pytest.mark.parametrize("name", ["cuda", "tma", "tma_ws", "mmcv"])
def test_forced_backend_that_cannot_run_raises_with_reasons(inputs, name):
    with pytest.raises(mmdeform_tma.BackendUnavailableError, match=rf"backend '{name}' cannot run .*\n  - runs on cuda, not cpu"):
        dispatch.select_backend(name, inputs)


def test_unknown_backend_lists_valid_names(inputs):
    with pytest.raises(ValueError, match="unknown backend 'triton'; valid names: auto, tma_ws, tma, cuda, mmcv, pytorch"):
        dispatch.select_backend("triton", inputs)


def test_every_backend_declares_its_capabilities():
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert backend.devices and backend.dtypes and backend.summary
        assert isinstance(backend.deterministic, bool)
        assert backend.min_compute_capability is None or len(backend.min_compute_capability) == 2


def test_compiled_backends_say_not_built_without_cuda(inputs):
    if mmdeform_tma.build_info().with_cuda:
        pytest.skip("this build has CUDA kernels")
    for name in ("cuda", "tma", "tma_ws"):
        reasons = BACKENDS[name].not_supported_reasons(inputs)
        assert any(r.startswith("not built") and "pip install -e . --no-build-isolation" in r for r in reasons), reasons


def test_auto_failure_lists_every_backend(inputs):
    half_on_meta = validate(*[t.to("meta") for t in (inputs.value.half(), inputs.spatial_shapes, inputs.level_start_index, inputs.sampling_locations, inputs.attention_weights)])
    with pytest.raises(mmdeform_tma.BackendUnavailableError) as info:
        dispatch.select_backend("auto", half_on_meta)
    for name in dispatch.AUTO_PRIORITY:
        assert f"  - {name}: " in str(info.value)


def test_available_backends_on_cpu():
    assert mmdeform_tma.available_backends("cpu") == ["pytorch"]


def test_determinism_rules(inputs):
    pytorch = BACKENDS["pytorch"]
    grad_inputs = validate(inputs.value.requires_grad_(), inputs.spatial_shapes, inputs.level_start_index, inputs.sampling_locations, inputs.attention_weights)
    torch.use_deterministic_algorithms(True)
    assert pytorch.not_supported_reasons(grad_inputs) == []  # grid_sample's CPU backward is deterministic
    assert any("not deterministic" in r for r in BACKENDS["mmcv"].not_supported_reasons(grad_inputs))
    assert not any("not deterministic" in r for r in BACKENDS["cuda"].not_supported_reasons(grad_inputs))
    with torch.no_grad():  # no backward will run: determinism does not constrain the choice
        no_grad = validate(*[t.detach() for t in (inputs.value, inputs.spatial_shapes, inputs.level_start_index, inputs.sampling_locations, inputs.attention_weights)])
        assert not any("not deterministic" in r for r in BACKENDS["mmcv"].not_supported_reasons(no_grad))


def test_auto_follows_tuning_table_order(inputs, monkeypatch):
    monkeypatch.setattr(dispatch.tuning, "preferred_backends", lambda _: ("cuda", "tma_ws"))
    cuda_inputs = validate(*[t.to("meta") for t in (inputs.value, inputs.spatial_shapes, inputs.level_start_index, inputs.sampling_locations, inputs.attention_weights)])
    monkeypatch.setattr(type(cuda_inputs), "device", property(lambda self: torch.device("cuda")))
    assert dispatch.auto_order(cuda_inputs)[:3] == ("cuda", "tma_ws", "tma")
