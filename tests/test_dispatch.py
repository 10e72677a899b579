"""Backend selection: 'auto' takes the fastest able backend per direction; a named one runs or raises its reasons."""

import json

import pytest
import torch

import mmdeform_tma
from mmdeform_tma import _extension, dispatch, library
from mmdeform_tma.backends import BACKENDS
from mmdeform_tma.inputs import validate
from fake_gpu import H100, cuda_like, on_cuda, pretend_gpu
from msda_cases import make_problem


@pytest.fixture
def inputs(generator):
    problem = make_problem([(4, 3), (2, 2)], dtype=torch.float32, generator=generator)
    return validate(*problem.args())


def test_auto_on_cpu_picks_pytorch(inputs):
    assert dispatch.select_backend("auto", inputs).name == "pytorch"


@pytest.mark.parametrize("name", ["cuda", "tma_ws", "mmcv"])
def test_forced_backend_that_cannot_run_raises_with_reasons(inputs, name):
    with pytest.raises(mmdeform_tma.BackendUnavailableError, match=rf"backend '{name}' cannot run .*\n  - runs on cuda, not cpu"):
        dispatch.select_backend(name, inputs)


def test_unknown_backend_lists_valid_names(inputs):
    with pytest.raises(ValueError, match="unknown backend 'triton'; valid names: auto, tma_ws, cuda, mmcv, pytorch"):
        dispatch.select_backend("triton", inputs)


def test_a_retired_backend_says_so_and_what_replaces_it(inputs):
    with pytest.raises(ValueError, match=r"backend 'tma' no longer exists: .*retired in 0\.2\.0.*use 'tma_ws', or 'auto'"):
        dispatch.select_backend("tma", inputs)
    assert "tma" not in dispatch.BACKEND_CHOICES


def test_every_backend_declares_its_capabilities():
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert backend.devices and backend.dtypes and backend.summary
        assert isinstance(backend.deterministic, bool)
        assert backend.min_compute_capability is None or len(backend.min_compute_capability) == 2


def test_compiled_backends_say_not_built_without_cuda(inputs):
    if mmdeform_tma.build_info().with_cuda:
        pytest.skip("this build has CUDA kernels")
    for name in ("cuda", "tma_ws"):
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


class TestAutoOnAGpu:
    """'auto' on CUDA-like inputs of a pretended H100 whose table is a synthetic one."""

    @pytest.fixture(autouse=True)
    def gpu(self, monkeypatch, tmp_path):
        entries = [
            {"key": key, "backend": backend, "direction": direction, "best": [{"config": "c0", "ms": ms}]}
            for key, times in {
                # decoder-sized: tma_ws forward, cuda backward; encoder-sized: cuda forward, tma_ws backward
                "float16/h2/c32/l2/p2/w4": {("tma_ws", "forward"): 0.02, ("cuda", "forward"): 0.03, ("tma_ws", "backward"): 0.09, ("cuda", "backward"): 0.08},
                "float16/h2/c32/l2/p2/w16": {
                    ("tma_ws", "forward"): 0.4, ("cuda", "forward"): 0.2, ("tma_ws", "backward"): 1.0, ("cuda", "backward"): 1.1,
                    ("tma_ws", "backward-deterministic"): 7.0, ("cuda", "backward-deterministic"): 6.7,
                },
            }.items()
            for (backend, direction), ms in times.items()
        ]
        table = tmp_path / "h100.json"
        table.write_text(json.dumps({"format": 1, "device": H100[0], "capability": list(H100[1]), "entries": entries}))
        monkeypatch.setattr(dispatch.tuning, "TABLE_DIR", tmp_path / "none")
        monkeypatch.setenv("MMDEFORM_TMA_TUNING_TABLE", str(table))
        pretend_gpu(monkeypatch)
        monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: ("c0",))
        yield
        dispatch.clear_caches()

    @staticmethod
    def select(generator, queries, requires_grad=True, channels=32):
        p = make_problem([(6, 5), (3, 3)], batch=1, queries=queries, heads=2, channels=channels, points=2, dtype=torch.float16, generator=generator)
        with cuda_like():
            value, shapes, starts, loc, attn = on_cuda(*p.args())
            inputs = validate(value.requires_grad_(requires_grad), shapes, starts, loc, attn)
            forward, backward = dispatch.select("auto", inputs)
        return forward.name, backward.name

    def test_each_direction_takes_its_fastest_backend(self, generator):
        assert self.select(generator, queries=10) == ("tma_ws", "cuda")  # w4, measured
        assert self.select(generator, queries=40000) == ("cuda", "tma_ws")  # w16, measured

    def test_the_deterministic_backward_takes_its_own_fastest(self, generator):
        before = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            assert self.select(generator, queries=40000) == ("cuda", "cuda")  # 6.7 against 7.0 deterministic
            assert self.select(generator, queries=10) == ("tma_ws", "cuda")  # the nearest deterministic times
        finally:
            torch.use_deterministic_algorithms(before)
        assert self.select(generator, queries=40000) == ("cuda", "tma_ws")

    def test_without_a_backward_the_backward_is_the_forward_s(self, generator):
        assert self.select(generator, queries=10, requires_grad=False) == ("tma_ws", "tma_ws")

    def test_an_unmeasured_shape_takes_the_nearest_not_the_static_order(self, generator):
        assert dispatch.AUTO_PRIORITY[0] == "tma_ws"
        assert self.select(generator, queries=20000) == ("cuda", "tma_ws")  # w15: the encoder's times
        assert self.select(generator, queries=30) == ("tma_ws", "cuda")  # w5: the decoder's

    def test_never_a_backend_that_cannot_run(self, generator):
        # 4 fp16 channels are 8-byte rows: no TMA layout. The table's favourite cannot be taken.
        assert self.select(generator, queries=10, channels=4) == ("cuda", "cuda")

    def test_the_call_carries_the_backward_choice_to_the_op(self, generator, monkeypatch):
        calls = []
        monkeypatch.setattr(library, "forward_op", lambda: lambda *args: calls.append(args[5:]))
        p = make_problem([(6, 5), (3, 3)], batch=1, queries=10, heads=2, channels=32, points=2, dtype=torch.float16, generator=generator)
        with cuda_like():
            value, shapes, starts, loc, attn = on_cuda(*p.args())
            mmdeform_tma.multi_scale_deformable_attn(value.requires_grad_(), shapes, starts, loc, attn, backend="auto")
        assert calls == [("tma_ws", 0, "cuda", 0)]  # each direction's measured config, c0

    def test_a_named_backend_still_raises_its_reasons(self, generator):
        p = make_problem([(6, 5), (3, 3)], batch=1, queries=10, heads=2, channels=4, points=2, dtype=torch.float16, generator=generator)
        with cuda_like():
            inputs = validate(*on_cuda(*p.args()))
            with pytest.raises(mmdeform_tma.BackendUnavailableError, match="backend 'tma_ws' cannot run .*\n  - a head's channels"):
                dispatch.select("tma_ws", inputs)


def test_info_report_says_how_auto_chooses():
    from mmdeform_tma.info import report

    text = report(torch.device("cpu"), [torch.float32])
    assert "'auto' picks the forward and the backward backend separately" in text
    assert "pytorch" in text and "available" in text
