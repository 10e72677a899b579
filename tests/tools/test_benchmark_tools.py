"""The benchmark and kernel tools run on the CPU: reference backend, tiny problems, all outputs."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


def test_benchmark_op_writes_json_markdown_png(tmp_path):
    import benchmark_op

    assert benchmark_op.main(["--device", "cpu", "--iters", "2", "--warmup", "1", "--out", str(tmp_path / "op")]) == 0
    data = json.loads((tmp_path / "op.json").read_text())
    assert data["environment"]["device"] and data["environment"]["torch"] == torch.__version__
    rows = data["results"]
    assert {r["direction"] for r in rows} == {"forward", "backward", "forward+backward"}
    assert all(r["backend"] == "pytorch" and r["timing"]["median_ms"] > 0 for r in rows)
    forward = next(r for r in rows if r["direction"] == "forward")
    assert forward["accuracy"]["rel_err_output"] < 1e-5
    assert "| preset |" in (tmp_path / "op.md").read_text()
    assert (tmp_path / "op.png").read_bytes()[:4] == b"\x89PNG"


def test_benchmark_op_explicit_shape(tmp_path):
    import benchmark_op

    args = ["--device", "cpu", "--batch", "1", "--spatial-size", "8x12", "--num-query", "5", "--num-heads", "2", "--channels", "4",
            "--num-levels", "2", "--num-points", "2", "--locality", "uniform", "--directions", "forward", "--iters", "1",
            "--out", str(tmp_path / "custom")]
    assert benchmark_op.main(args) == 0
    row = json.loads((tmp_path / "custom.json").read_text())["results"][0]
    assert row["shape"] == "bs1 nq=5 S=120 L2 P2 H2 C4"


def test_benchmark_op_keeps_the_rows_measured_before_a_crash(tmp_path, monkeypatch):
    import benchmark_op

    calls = []

    def failing_on_the_second_row(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 1

    monkeypatch.setattr(benchmark_op, "compulsory_bytes", failing_on_the_second_row)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        benchmark_op.main(["--device", "cpu", "--iters", "1", "--warmup", "1", "--out", str(tmp_path / "op")])
    data = json.loads((tmp_path / "op.json").read_text())
    assert [r["direction"] for r in data["results"]] == ["forward"]
    assert data["environment"]["incomplete"] == "stopped after 1 of 3 rows: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "**Incomplete run**" in (tmp_path / "op.md").read_text()


def test_compulsory_bytes_of_the_encoder_preset():
    import benchmark_op

    shape = benchmark_op.PRESETS["detr_enc_bs2"]
    assert shape.num_keys == 20197
    # value 20.7 MB + locations 41.4 MB + weights 20.7 MB + output 20.7 MB in bf16: about 35 us at 3 TB/s
    assert abs(benchmark_op.compulsory_bytes(shape, torch.bfloat16, "forward") / 3e12 * 1e6 - 34.5) < 0.5


def test_benchmark_e2e_cpu_smoke(tmp_path):
    pytest.importorskip("mmdet")
    import benchmark_e2e

    assert benchmark_e2e.main(["--device", "cpu", "--out", str(tmp_path / "e2e")]) == 0
    results = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert {r["backend"] for r in results} == {"stock", "pytorch"}
    for r in results:
        assert r["error"] is None and r["train_ms"]["median_ms"] > 0 and len(r["losses"]) == 2
        assert r["max_loss_rel_diff_vs_mmcv"] < 1e-6  # the reference is mmcv's own CPU path
        assert r["scalar_reads"] > 0  # mmdet's losses and assigner read scalars every iteration
        assert r["gc_ms"] >= 0 and r["gc_full_collections"] >= 0  # measured on every row, the CPU's included
        assert r["gpu_kernel_ms"] is None and r["host_syncs"] is None and r["bound"] is None  # no device on the CPU
        phases = r["host_phases"]
        assert {"data preprocessor", "backbone + neck", "transformer", "head + loss", "assigner", "backward", "other"} <= set(phases)
        assert phases["assigner"]["host_ms"] < phases["head + loss"]["host_ms"] and phases["head + loss"]["scalar_reads"] > 0
    markdown = (tmp_path / "e2e.md").read_text()
    assert (tmp_path / "e2e.png").exists() and "| variant |" in markdown and "GPU/wall %" in markdown
    assert "| train ms/iter | p90 | spread |" in markdown and "| GC ms/iter |" in markdown
    assert "Where the host's iteration goes" in markdown and "| variant | precision | data preprocessor | backbone + neck |" in markdown


def test_benchmark_e2e_fast_rows_and_interleaved_repeats(tmp_path):
    pytest.importorskip("mmdet")
    import benchmark_e2e

    argv = [
        "--device", "cpu", "--backends", "stock", "--fast-backends", "pytorch", "--compile-backend", "aot_eager",
        "--compile-scope", "layers", "network+decoder", "--repeats", "2", "--iters", "2", "--out", str(tmp_path / "e2e"),
    ]
    assert benchmark_e2e.main(argv) == 0
    results = json.loads((tmp_path / "e2e.json").read_text())["results"]
    # round-robin: round 0 of every variant before round 1 of any; one fast row per compile scope
    assert [(r["backend"], r["compile_scope"], r["repeat"]) for r in results] == [
        ("stock", None, 0), ("pytorch", "layers", 0), ("pytorch", "network+decoder", 0),
        ("stock", None, 1), ("pytorch", "layers", 1), ("pytorch", "network+decoder", 1),
    ]
    assert all(r["error"] is None for r in results)
    fast = [r for r in results if r["fast"]]
    assert all(r["max_loss_rel_diff_vs_mmcv"] < 1e-6 for r in fast)  # same weights, batches and dropout draws
    markdown = (tmp_path / "e2e.md").read_text()
    assert "| pytorch+fast | fp32 |" in markdown and "| stock | fp32 |" in markdown
    assert "| pytorch+fast[layers] | fp32 |" in markdown


@pytest.mark.parametrize("freeze", [True, False])
def test_benchmark_e2e_fast_rows_freeze_the_heap_after_warm_up_and_unfreeze_it(tmp_path, monkeypatch, freeze):
    pytest.importorskip("mmdet")
    import gc

    import benchmark_e2e

    from mmdeform_tma.integrations import fast_training

    frozen_during_timing = []
    real_time_loop = benchmark_e2e.time_loop

    def time_loop(*args, **kwargs):
        frozen_during_timing.append(gc.get_freeze_count() > 0)
        return real_time_loop(*args, **kwargs)

    monkeypatch.setattr(benchmark_e2e, "time_loop", time_loop)
    real_profile = benchmark_e2e.profile_iterations

    def profile_iterations(*args, **kwargs):  # as something on the H100 image did between the timings
        result = real_profile(*args, **kwargs)
        gc.freeze()
        return result

    monkeypatch.setattr(benchmark_e2e, "profile_iterations", profile_iterations)
    calls = []
    real_freeze = fast_training.freeze_long_lived_objects
    monkeypatch.setattr(fast_training, "freeze_long_lived_objects", lambda: calls.append(1) or real_freeze())
    gc.unfreeze()
    argv = [
        "--device", "cpu", "--backends", "stock", "--fast-backends", "pytorch", "--compile-backend", "aot_eager",
        "--compile-scope", "layers", "--iters", "1", "--out", str(tmp_path / "e2e"),
    ] + ([] if freeze else ["--no-gc-freeze"])
    try:
        assert benchmark_e2e.main(argv) == 0
        assert gc.get_freeze_count() == 0  # unfrozen for whatever runs next
    finally:
        gc.unfreeze()
    # time_loop times training, then inference, per row: stock's never frozen, the fast row's when asked
    assert frozen_during_timing == [False, False, freeze, freeze]
    assert calls == ([1, 1] if freeze else [])  # before the training and the inference timing
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data["environment"]["fast_rows_gc_frozen"] is freeze
    assert all(r["error"] is None for r in data["results"])


def fast_rows_built(tmp_path, monkeypatch, *options) -> tuple[list[dict], list[dict]]:
    """The fast options benchmark_e2e hands build_model for one fast row per variant of `options`
    (build_model stopped at once), and the result rows it writes."""
    pytest.importorskip("mmdet")
    import benchmark_e2e

    seen = []

    def build_model(config, backend, device, seed, fast=None):
        seen.append(fast)
        raise RuntimeError("stop here")

    monkeypatch.setattr(benchmark_e2e, "build_model", build_model)
    argv = [
        "--device", "cpu", "--backends", "--fast-backends", "pytorch", "--compile-backend", "aot_eager",
        *options, "--iters", "1", "--out", str(tmp_path / "e2e"),
    ]
    assert benchmark_e2e.main(argv) == 0
    return seen, json.loads((tmp_path / "e2e.json").read_text())["results"]


def test_benchmark_e2e_static_shapes_rows_compile_with_dynamic_false(tmp_path, monkeypatch):
    seen, results = fast_rows_built(tmp_path, monkeypatch, "--compile-shapes", "automatic", "static")
    assert [fast.get("dynamic", "torch's default") for fast in seen] == ["torch's default", False]
    assert [(r["compile_shapes"], r["error"]) for r in results] == [
        ("automatic", "RuntimeError: stop here"), ("static", "RuntimeError: stop here")
    ]


def test_benchmark_e2e_targets_rows_batch_the_head_s_targets_or_not(tmp_path, monkeypatch):
    import benchmark_e2e

    seen, results = fast_rows_built(tmp_path, monkeypatch, "--fast-targets", "batched", "mmdet")
    assert [fast["batched_targets"] for fast in seen] == [True, False]
    assert [r["targets"] for r in results] == ["batched", "mmdet"]
    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network+decoder", "automatic", "mmdet") == (
        "auto+fast[mmdet-targets]"
    )
    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network+decoder", "automatic", "batched") == "auto+fast"


def test_benchmark_e2e_paired_rounds_hold_every_model_and_rotate(tmp_path):
    pytest.importorskip("mmdet")
    import benchmark_e2e

    argv = [
        "--device", "cpu", "--backends", "stock", "pytorch", "--paired", "3", "--iters", "2", "--warmup", "0",
        "--out", str(tmp_path / "e2e"),
    ]
    assert benchmark_e2e.main(argv) == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    results = saved["results"]
    assert [(r["backend"], r["repeat"]) for r in results] == [
        ("stock", 0), ("pytorch", 0), ("stock", 1), ("pytorch", 1), ("stock", 2), ("pytorch", 2),
    ]
    assert all(r["error"] is None and r["train_ms"]["samples"] == 2 and r["infer_ms"]["samples"] == 2 for r in results)
    (ratio,) = saved["paired_ratios"]
    assert ratio["label"] == "pytorch" and ratio["rounds"] == 3
    assert ratio["train_ratio_min"] <= ratio["train_ratio"] <= ratio["train_ratio_max"]
    markdown = (tmp_path / "e2e.md").read_text()
    assert "## Paired rounds" in markdown and "| pytorch | fp32 | 3 |" in markdown


def test_paired_ratios_divide_by_stock_of_the_same_round():
    import benchmark_e2e

    def run(label, repeat, train, infer):
        return benchmark_e2e.Result(label, "amp-fp16", repeat=repeat, train_ms={"median_ms": train}, infer_ms={"median_ms": infer})

    results = [
        run("stock", 0, 300.0, 50.0), run("auto", 0, 270.0, 55.0),  # a slow round for both
        run("stock", 1, 200.0, 40.0), run("auto", 1, 180.0, 38.0),
        run("stock", 2, 250.0, 45.0), run("auto", 2, 260.0, 36.0),
    ]
    (row,) = benchmark_e2e.paired_ratios(results)
    assert row["rounds"] == 3
    assert row["train_ratio"] == pytest.approx(0.9) and row["train_ratio_max"] == pytest.approx(1.04)
    assert row["train_rounds_slower"] == 1
    assert row["infer_ratio"] == pytest.approx(0.95) and row["infer_ratio_max"] == pytest.approx(1.1)
    assert row["infer_rounds_slower"] == 1


def test_paired_mode_refuses_the_fast_path_and_needs_stock():
    import benchmark_e2e

    with pytest.raises(SystemExit):
        benchmark_e2e.parse_args(["--device", "cpu", "--backends", "stock", "auto", "--fast-backends", "auto", "--paired", "3"])
    with pytest.raises(SystemExit):
        benchmark_e2e.parse_args(["--device", "cpu", "--backends", "auto", "cuda", "--paired", "3"])
    assert benchmark_e2e.parse_args(["--device", "cpu", "--backends", "stock", "auto", "--paired", "3"]).fast_backends == []


def test_fast_labels_name_what_differs_from_the_defaults():
    import benchmark_e2e

    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network+decoder") == "auto+fast"  # the defaults
    assert benchmark_e2e.fast_label("auto", "default", "layers") == "auto+fast[default,layers]"
    assert benchmark_e2e.fast_label("auto", "default", "network+decoder") == "auto+fast[default]"
    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network") == "auto+fast[network]"
    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network+decoder", "static") == "auto+fast[static]"
    assert benchmark_e2e.fast_label("auto", "reduce-overhead", "network+decoder", "automatic") == "auto+fast"
    with pytest.raises(ValueError, match="compile scope"):
        benchmark_e2e.parse_args(["--device", "cpu", "--compile-scope", "everything"])


def test_summarize_runs_medians_spread_and_ratio_to_stock():
    import benchmark_e2e

    def run(label, fast, repeat, train, infer):
        return benchmark_e2e.Result(
            label, "amp-fp16", fast, repeat, train_ms={"median_ms": train, "p90_ms": train + 1},
            infer_ms={"median_ms": infer}, gpu_kernel_ms=50.0, gpu_over_wall_pct=100 * 50.0 / train,
        )

    results = [
        run("stock", False, 0, 200.0, 80.0), run("auto", True, 0, 100.0, 40.0),
        run("stock", False, 1, 220.0, 90.0), run("auto", True, 1, 130.0, 50.0),
        run("stock", False, 2, 240.0, 70.0), run("auto", True, 2, 110.0, 60.0),
        benchmark_e2e.Result("cuda", "amp-fp16", error="RuntimeError: no"),
    ]
    rows = {r["label"]: r for r in benchmark_e2e.summarize_runs(results)}
    assert rows["stock"]["train_ms"] == 220.0 and (rows["stock"]["train_min"], rows["stock"]["train_max"]) == (200.0, 240.0)
    assert rows["auto+fast"]["train_ms"] == 110.0 and rows["auto+fast"]["train_vs_stock"] == pytest.approx(0.5)
    assert rows["auto+fast"]["infer_vs_stock"] == pytest.approx(50.0 / 80.0)
    assert rows["stock"]["bound"] == "host" and rows["cuda"]["error"] == "RuntimeError: no"


def test_phase_table_shows_the_wait_in_synchronisations_beside_launches_and_syncs():
    import benchmark_e2e

    phases = {
        "head + loss": {"host_ms": 90.4, "calls": 1, "launches": 2038, "syncs": 192, "wait_ms": 31.25, "scalar_reads": 80},
        "backward": {"host_ms": 62.9, "calls": 1, "launches": 1220, "syncs": 0, "wait_ms": 0.0, "scalar_reads": 0},
    }
    result = benchmark_e2e.Result(
        "auto", "amp-fp16", True, train_ms={"median_ms": 140.0, "p90_ms": 150.0}, infer_ms={"median_ms": 20.0},
        host_phases=phases, sync_wait_ms=31.25, host_syncs=192,
    )
    header, rows = benchmark_e2e.phase_table([result])
    assert header == ["variant", "precision", "head + loss", "backward"]
    assert rows == [["auto+fast", "amp-fp16", "90.4 (2038 / 192, wait 31.2)", "62.9 (1220 / 0, wait 0.0)"]]
    header, (row,) = benchmark_e2e.table([result])
    assert row[header.index("sync wait ms/iter")] == "31.2"
    # phases of results saved before the wait was measured print without it
    assert benchmark_e2e.phase_cell({"host_ms": 3.5, "launches": 3, "syncs": 0}) == "3.5 (3 / 0)"


def test_batches_are_pinned_as_the_config_s_loader_pins_them_on_a_gpu(monkeypatch):
    import benchmark_e2e
    from mmengine.config import Config

    batch = {"inputs": [torch.zeros(3, 4, 4, dtype=torch.uint8)], "data_samples": ["sample"]}
    pinning = Config(dict(train_dataloader=dict(pin_memory=True)))
    plain = Config(dict(train_dataloader=dict(batch_size=2)))
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert benchmark_e2e.as_loaded(batch, pinning, cpu) is batch  # nothing to pin for on the CPU
    assert benchmark_e2e.as_loaded(batch, plain, gpu) is batch  # stock configs do not pin
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())
    loaded = benchmark_e2e.as_loaded(batch, pinning, gpu)
    assert pinned == batch["inputs"] and loaded["data_samples"] is batch["data_samples"]
    assert loaded["inputs"][0] is not batch["inputs"][0] and torch.equal(loaded["inputs"][0], batch["inputs"][0])


def trace(name, start, duration, on_device=False):
    import benchmark_e2e

    return benchmark_e2e.TraceEvent(name, on_device, start, duration)


def test_iteration_breakdown_counts_per_step_inside_the_step_ranges():
    import benchmark_e2e

    step = benchmark_e2e.STEP_RANGE
    events = [trace(step, 0, 100), trace(step, 200, 100)]
    for start in (0, 200):  # per step: 3 launches, 1 stream sync, 1 async copy, 2 scalar reads (each under an item)
        events += [trace("cudaLaunchKernel", start + 1, 1), trace("cudaLaunchKernelExC", start + 2, 1), trace("cuLaunchKernel", start + 3, 1)]
        events += [trace("cudaStreamSynchronize", start + 4, 5), trace("cudaMemcpyAsync", start + 10, 1)]
        events += [trace("aten::item", start + 20, 3), trace("aten::_local_scalar_dense", start + 21, 1)] * 2
    events += [trace("cudaMemcpy", 250, 2)]  # a synchronous copy in the second step
    events += [trace("cudaGraphLaunch", 260, 1)]  # a CUDA-graph replay in the second step
    events += [trace("cudaDeviceSynchronize", 400, 50)]  # the profiler loop's own, after the steps
    events += [trace("void portable::msda_forward<float>(...)", 10, 30, True), trace("volta_sgemm_128x64_nn", 50, 90, True)]
    events += [trace("at::native::elementwise_kernel", 220, 40, True), trace("Memcpy DtoH (Device -> Pageable)", 230, 500, True)]
    got = benchmark_e2e.iteration_breakdown(events)
    assert got["gpu_kernel_ms"] == pytest.approx((30 + 90 + 40) / 2 / 1e3)
    assert got["gpu_kernels"] == 1.5 and got["kernel_launches"] == 3.5 and got["graph_launches"] == 0.5
    assert got["sync_calls"] == {"cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 0, "cudaEventSynchronize": 0, "cudaMemcpy": 0.5}
    assert got["host_syncs"] == 1.5 and got["scalar_reads"] == 2
    # per step: the 5 us stream sync; the second also the 2 us synchronous copy; not the profiler's own sync
    assert got["sync_wait_ms"] == pytest.approx((5 + 5 + 2) / 2 / 1e3)
    assert got["msda_share_pct"] == pytest.approx(100 * 30 / 160)


def test_phase_breakdown_splits_the_host_iteration():
    import benchmark_e2e

    step, phase = benchmark_e2e.STEP_RANGE, benchmark_e2e.PHASE_PREFIX
    events = []
    for start in (0, 1000):  # per step (1000 us): head + loss 400 us with the assigner (100 us) inside, backward 300 us
        events += [trace(step, start, 1000), trace(phase + "head + loss", start + 100, 400), trace(phase + "assigner", start + 200, 100)]
        events += [trace(phase + "backward", start + 600, 300)]
        events += [trace("cudaLaunchKernel", start + 150, 1), trace("cudaStreamSynchronize", start + 250, 5)]  # assigner: 1 sync
        events += [trace("aten::_local_scalar_dense", start + 260, 1)]
        events += [trace("cudaLaunchKernel", start + 700 + i, 1) for i in range(3)]  # backward: 3 launches
        events += [trace("cudaLaunchKernel", start + 50, 1)]  # outside every phase: 'other'
    got = benchmark_e2e.phase_breakdown(events, [(0, 1000), (1000, 2000)])
    wait = 0.005  # the assigner's 5 us sync, in ms
    assert got["head + loss"] == {"host_ms": 0.4, "calls": 1, "launches": 1, "syncs": 1, "wait_ms": wait, "scalar_reads": 1}
    assert got["assigner"] == {"host_ms": 0.1, "calls": 1, "launches": 0, "syncs": 1, "wait_ms": wait, "scalar_reads": 1}
    assert got["backward"] == {"host_ms": 0.3, "calls": 1, "launches": 3, "syncs": 0, "wait_ms": 0, "scalar_reads": 0}
    # the nested assigner is not subtracted twice
    assert got["other"] == {
        "host_ms": pytest.approx(0.3), "calls": 1, "launches": 1, "syncs": 0, "wait_ms": 0, "scalar_reads": 0
    }
    assert benchmark_e2e.phase_breakdown(events[:1], [(0, 1000)]) == {}  # no phase ranges: nothing to split


def test_phase_ranges_time_instance_methods_and_restore_them():
    import benchmark_e2e

    class Head:
        def loss(self, x):
            return x.sum().item()

    head, other = Head(), Head()
    x = torch.ones(4)
    targets = [("head + loss", head, "loss")]
    got = benchmark_e2e.profile_iterations(lambda: head.loss(x), 2, torch.device("cpu"), phases=targets)
    assert got["host_phases"]["head + loss"]["calls"] == 1 and got["host_phases"]["head + loss"]["scalar_reads"] == 1
    assert got["host_phases"]["other"]["scalar_reads"] == 0
    assert "loss" not in vars(head) and head.loss(x) == 4.0 and other.loss(x) == 4.0  # the class method again


def test_phase_targets_of_a_detr_like_model():
    from types import SimpleNamespace

    import benchmark_e2e

    class Detector:
        data_preprocessor = SimpleNamespace(forward=lambda *a: a)
        bbox_head = SimpleNamespace(loss=lambda *a: a, assigner=SimpleNamespace(assign=lambda *a: a))

        def extract_feat(self, x):
            return x

    wrapper = SimpleNamespace(backward=lambda loss: None, step=lambda: None, zero_grad=lambda: None)
    labels = [label for label, _, _ in benchmark_e2e.phase_targets(Detector(), wrapper)]
    assert labels == ["data preprocessor", "backbone + neck", "head + loss", "assigner", "backward", "optimizer step", "zero grad"]


def test_trace_events_drop_the_gpu_copies_of_annotations():
    from types import SimpleNamespace

    import benchmark_e2e
    from torch.autograd import DeviceType

    def event(name, device_type, start, end, annotation=False):
        span = SimpleNamespace(start=start, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device_type, time_range=span, is_user_annotation=annotation)

    step = benchmark_e2e.STEP_RANGE
    events = benchmark_e2e.trace_events([
        event(step, DeviceType.CPU, 0, 100, annotation=True),
        event("cudaLaunchKernel", DeviceType.CPU, 1, 2),
        event(step, DeviceType.CUDA, 5, 200, annotation=True),  # gpu_user_annotation: spans the step's kernels
        event("Optimizer.step#AdamW.step", DeviceType.CUDA, 50, 150, annotation=True),
        event("vectorized_elementwise_kernel", DeviceType.CUDA, 10, 30),
    ])
    assert [(e.name, e.on_device) for e in events] == [(step, False), ("cudaLaunchKernel", False), ("vectorized_elementwise_kernel", True)]
    assert benchmark_e2e.iteration_breakdown(events)["gpu_kernel_ms"] == pytest.approx(0.02)


def test_iteration_breakdown_needs_step_ranges():
    import benchmark_e2e

    with pytest.raises(ValueError, match="train_step"):
        benchmark_e2e.iteration_breakdown([trace("cudaLaunchKernel", 0, 1)])


def test_profile_iterations_counts_scalar_reads_of_a_real_cpu_trace():
    import benchmark_e2e

    x = torch.ones(3)

    def step():
        return (x.sum().item(), bool(x.max() > 0))

    got = benchmark_e2e.profile_iterations(step, 3, torch.device("cpu"))
    assert got["scalar_reads"] == 2
    assert got["gpu_kernel_ms"] is None and got["kernel_launches"] is None and got["msda_share_pct"] is None


def test_autotune_tunes_the_layout_presets_on_request():
    import autotune
    import benchmark_op

    assert autotune.presets_to_tune(None, False) == autotune.STANDARD_PRESETS
    assert autotune.presets_to_tune(None, True) == benchmark_op.LAYOUT_PRESETS
    assert autotune.presets_to_tune(["detr_enc_bs2"], True) == ["detr_enc_bs2", *benchmark_op.LAYOUT_PRESETS]
    # layouts the DETR presets lack, kept out of the operator benchmark's default run
    layouts = {(benchmark_op.PRESETS[n].heads, benchmark_op.PRESETS[n].channels) for n in benchmark_op.LAYOUT_PRESETS}
    assert len(layouts) == len(benchmark_op.LAYOUT_PRESETS) and (8, 32) not in layouts
    assert not set(benchmark_op.LAYOUT_PRESETS) & set(benchmark_op.DEFAULT_GPU_PRESETS)


def test_autotune_partial_run_keeps_the_configs_it_did_not_time():
    import autotune

    timed = [{"config": "b", "median_ms": 0.5}, {"config": "d", "median_ms": 2.0}]
    previous = [{"config": "a", "ms": 1.0}, {"config": "b", "ms": 3.0}, {"config": "c", "ms": 4.0}]
    # a full run replaces the entry; a partial one (--configs) merges, the new time winning
    assert [b["config"] for b in autotune.best_configs(timed, previous, 3, False)] == ["b", "d"]
    merged = autotune.best_configs(timed, previous, 3, True)
    assert merged == [{"config": "b", "ms": 0.5}, {"config": "a", "ms": 1.0}, {"config": "d", "ms": 2.0}]


def test_autotune_checks_encoders_on_one_whole_image_and_decoders_on_a_query_subset():
    import autotune
    from benchmark_op import Shape, make_inputs

    levels = ((6, 5), (3, 3))
    encoder = make_inputs(Shape("enc", levels, 2, None, heads=2, channels=4, points=2), torch.float32, "local", torch.device("cpu"), 0)
    value, _, _, loc, _ = autotune.Checker(encoder, 7).args
    # still self-attention (one query per key): the pixel-block tiles that the timed calls take
    assert value.shape[0] == loc.shape[0] == 1 and loc.shape[1] == value.shape[1] == 39
    decoder = make_inputs(Shape("dec", levels, 2, 20, heads=2, channels=4, points=2), torch.float32, "local", torch.device("cpu"), 0)
    value, _, _, loc, attn = autotune.Checker(decoder, 7).args
    assert value.shape[0] == loc.shape[0] == 2 and loc.shape[1] == attn.shape[1] == 7


def test_autotune_digests_each_backends_own_sources(tmp_path):
    import autotune

    for folder in ("hopper", "cuda", "common"):
        (tmp_path / "mmdeform_tma" / "csrc" / folder).mkdir(parents=True)
        (tmp_path / "mmdeform_tma" / "csrc" / folder / "k.cu").write_text(folder)
    (tmp_path / "setup.py").write_text("flags")
    before = {b: autotune.sources_digest(b, tmp_path) for b in ("tma_ws", "cuda")}
    (tmp_path / "mmdeform_tma" / "csrc" / "cuda" / "k.cu").write_text("changed")
    after = {b: autotune.sources_digest(b, tmp_path) for b in ("tma_ws", "cuda")}
    assert after["tma_ws"] == before["tma_ws"] and after["cuda"] != before["cuda"]
    (tmp_path / "setup.py").write_text("other flags")
    assert autotune.sources_digest("tma_ws", tmp_path) != before["tma_ws"]


def test_autotune_entry_keeps_a_digest_only_when_every_kept_config_was_timed_on_those_sources():
    import autotune

    best = [{"config": "a", "ms": 1.0}, {"config": "b", "ms": 2.0}]
    assert autotune.entry_sources(best, {"a", "b", "c"}, {}, "new") == "new"
    # a partial run (--configs) that kept an earlier time: the earlier entry's digest decides
    assert autotune.entry_sources(best, {"a"}, {"sources": "new"}, "new") == "new"
    assert autotune.entry_sources(best, {"a"}, {"sources": "old"}, "new") is None
    assert autotune.entry_sources(best, {"a"}, {}, "new") is None


def test_autotune_lists_stale_entries_with_the_command_that_retunes_them(tmp_path, capsys):
    import autotune

    def entry(backend, direction, preset, sources=None):
        e = {"key": f"{preset}/{direction}", "backend": backend, "direction": direction, "preset": preset, "best": []}
        return {**e, "sources": sources} if sources else e

    digests = {"tma_ws": "t1", "cuda": "c1"}
    table = {"device": "GPU X", "entries": [
        entry("tma_ws", "forward", "detr_enc_bs2", "t1"),
        entry("tma_ws", "forward", "detr_enc_bs8", "t0"),
        entry("tma_ws", "forward", "detr_dec_bs2"),
        entry("cuda", "backward", "detr_enc_bs2", "c1"),
    ]}
    lines = autotune.stale_report(table, digests)
    assert lines[0] == "GPU X: 2 of 4 entries measured on other kernel sources"
    assert lines[1] == "  tma_ws forward: 2 (1 before digests were recorded); re-tune with"
    assert lines[2].endswith("--backends tma_ws --directions forward --presets detr_dec_bs2 detr_enc_bs8")
    assert len(lines) == 3
    # the command line digests this checkout's sources, and needs no GPU
    current = entry("tma_ws", "forward", "detr_enc_bs2", autotune.sources_digest("tma_ws"))
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "GPU Y", "entries": [current, entry("tma_ws", "forward", "detr_enc_bs8", "t0")]}))
    assert autotune.main(["--stale", "--table", str(path)]) == 0
    assert capsys.readouterr().out.startswith("GPU Y: 1 of 2 entries measured on other kernel sources")


def test_autotune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    import autotune

    assert autotune.main([]) == 2


def test_resource_report_parses_ptxas_output():
    import resource_report

    text = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers, 2048 bytes smem, 384 bytes cmem[0]"""
    (kernel,) = resource_report.parse_ptxas("x.cu", text)
    assert (kernel.arch, kernel.registers, kernel.shared_bytes, kernel.spill_stores, kernel.spill_loads) == ("sm_90a", 72, 2048, 4, 4)
    assert kernel.kernel == "foo(float*)"


def test_info_explains_every_backend():
    out = subprocess.run([sys.executable, "-m", "mmdeform_tma.info", "--device", "cpu"], capture_output=True, text=True, check=True).stdout
    for name in ("tma_ws", "cuda", "mmcv", "pytorch"):
        assert f"    {name} " in out
    assert "pytorch  available" in out
    assert "not built" in out or "runs on cuda, not cpu" in out


def test_profile_ncu_backward_configs_need_exactly_one_backend(capsys):
    import profile_ncu

    with pytest.raises(SystemExit):
        profile_ncu.main(["--backends", "tma_ws", "cuda", "--backward-configs", "c4_t32_s2_w16"])
    assert "exactly one" in capsys.readouterr().err


def test_profile_ncu_forward_configs_need_exactly_one_backend_and_direction(capsys):
    import profile_ncu

    with pytest.raises(SystemExit):
        profile_ncu.main(["--backends", "tma_ws", "cuda", "--forward-configs", "c4_t32_s2_w16"])
    assert "exactly one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_ncu.main(["--backends", "tma_ws", "--forward-configs", "c4_t32_s2_w16", "--backward-configs", "c4_t32_s2_w16"])
    assert "one direction per run" in capsys.readouterr().err


def test_profile_ncu_passes_the_sampling_to_the_profiled_process(monkeypatch, capsys):
    import profile_ncu

    seen = {}

    def fake_run(command, **kwargs):
        seen["command"] = command
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="no GPU here")

    monkeypatch.setattr(profile_ncu.shutil, "which", lambda name: "/opt/ncu/ncu")
    monkeypatch.setattr(profile_ncu.subprocess, "run", fake_run)
    assert profile_ncu.main(["--backends", "tma_ws", "--dtype", "float32", "--locality", "uniform"]) == 1
    child = seen["command"][seen["command"].index("--child"):]
    assert child[child.index("--locality") + 1] == "uniform"
    assert child[child.index("--dtype") + 1] == "float32"
    with pytest.raises(SystemExit):
        profile_ncu.main(["--backends", "tma_ws", "--locality", "everywhere"])
    assert "invalid choice" in capsys.readouterr().err


def test_benchmark_e2e_rotates_image_sizes_and_counts_compiled_graphs(tmp_path):
    """Several sizes, as multi-scale training feeds them: every step takes the next size (the second
    one makes the compiled modules recompile, 8 graphs for one size: 4 modules x train and eval)."""
    pytest.importorskip("mmdet")
    import benchmark_e2e

    argv = [
        "--device", "cpu", "--backends", "--fast-backends", "pytorch", "--compile-backend", "aot_eager",
        "--image-size", "128x128,128x192", "--iters", "2", "--warmup", "1", "--parity-steps", "1",
        "--out", str(tmp_path / "e2e"),
    ]
    assert benchmark_e2e.main(argv) == 0
    data = json.loads((tmp_path / "e2e.json").read_text())
    (result,) = data["results"]
    assert data["environment"]["image_size"] == "128x128,128x192" and result["error"] is None
    assert result["compiled_graphs"] > 8


def test_image_sizes_parse_and_refuse_malformed_ones():
    import benchmark_e2e

    assert benchmark_e2e.parse_image_sizes("800x1216") == [(800, 1216)]
    assert benchmark_e2e.parse_image_sizes("800x1216,640x1024") == [(800, 1216), (640, 1024)]
    for bad in ("800", "800x", "0x128", "800x1216,", "axb"):
        with pytest.raises(ValueError, match="HxW"):
            benchmark_e2e.parse_image_sizes(bad)


def test_benchmark_e2e_turns_any_failure_into_an_error_row_and_goes_on(tmp_path, monkeypatch):
    """A row that dies (an AssertionError inside torch's CUDA-graph trees did, on an H100) becomes
    an error row; the rows after it still run."""
    import benchmark_e2e

    real = benchmark_e2e.run_one

    def run_one(args, backend, precision, device, fast=None, repeat=0):
        if fast is not None:
            raise AssertionError("graph trees broke")
        return real(args, backend, precision, device, fast, repeat)

    monkeypatch.setattr(benchmark_e2e, "run_one", run_one)
    argv = [
        "--device", "cpu", "--backends", "pytorch", "--fast-backends", "pytorch", "--compile-scope", "layers", "network",
        "--iters", "1", "--warmup", "1", "--parity-steps", "1", "--out", str(tmp_path / "e2e"),
    ]
    assert benchmark_e2e.main(argv) == 0
    results = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert [(r["compile_scope"], r["error"]) for r in results] == [
        (None, None), ("layers", "AssertionError: graph trees broke"), ("network", "AssertionError: graph trees broke")
    ]


def test_profile_call_lists_each_call_s_kernels(tmp_path, monkeypatch):
    import profile_call

    monkeypatch.setenv(profile_call.LAYOUT_VARIABLE, "auto")
    out = tmp_path / "calls"
    assert profile_call.main(["--device", "cpu", "--calls", "2", "--warmup", "1", "--deterministic", "both",
                              "--grad-value-layouts", "dense", "touched", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["deterministic"], r["grad_value_layout"]) for r in rows] == [(False, "dense"), (False, "touched"), (True, "dense"), (True, "touched")]
    for r in rows:
        assert r["backend"] == "pytorch" and r["kernels"] and r["total_us_per_call"] > 0
        assert abs(sum(k["us_per_call"] for k in r["kernels"]) - r["total_us_per_call"]) < 1e-6
        assert all(k["launches_per_call"] > 0 for k in r["kernels"])
    assert "**total**" in out.with_suffix(".md").read_text()
    assert os.environ[profile_call.LAYOUT_VARIABLE] == "auto"  # restored after the runs


def test_profile_call_samples_uniformly_on_request(tmp_path):
    import profile_call

    out = tmp_path / "calls"
    assert profile_call.main(["--device", "cpu", "--calls", "1", "--warmup", "0", "--locality", "local", "uniform",
                              "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["locality"], r["forward_config"]) for r in rows] == [("local", None), ("uniform", None)]
    assert "forward + backward" in out.with_suffix(".md").read_text()


def test_profile_call_profiles_one_forward_config_alone(tmp_path, monkeypatch):
    """With --forward-config the forward op runs alone with that config's index: no backward."""
    import profile_call

    monkeypatch.setattr(profile_call, "kernel_configs", lambda backend, direction: ("c2_a", "rg_b"))
    called = []

    def forward(value, shapes, starts, loc, attn, backend, config):
        called.append((backend, config, loc.requires_grad))
        return torch.zeros(1)

    monkeypatch.setattr(torch.ops.mmdeform_tma, "ms_deform_attn_forward", forward)
    out = tmp_path / "calls"
    assert profile_call.main(["--device", "cpu", "--backends", "tma_ws", "--forward-config", "rg_b", "--calls", "2",
                              "--warmup", "1", "--out", str(out)]) == 0
    assert called == [("tma_ws", 1, False)] * 3
    (row,) = json.loads(out.with_suffix(".json").read_text())["results"]
    assert row["forward_config"] == "rg_b" and row["backend"] == "tma_ws"
    assert "forward rg_b" in out.with_suffix(".md").read_text()


def test_profile_call_names_the_configs_a_backend_has(monkeypatch):
    import profile_call

    monkeypatch.setattr(profile_call, "kernel_configs", lambda backend, direction: ("c2_a",))
    with pytest.raises(SystemExit, match="compiles no forward config 'rg_b' \\(it has: c2_a\\)"):
        profile_call.forward_config_index("tma_ws", "rg_b")


def test_profile_call_restores_the_layout_variable(monkeypatch):
    import profile_call

    monkeypatch.setenv(profile_call.LAYOUT_VARIABLE, "dense")
    with profile_call.grad_value_layout("touched"):
        assert os.environ[profile_call.LAYOUT_VARIABLE] == "touched"
    assert os.environ[profile_call.LAYOUT_VARIABLE] == "dense"
    monkeypatch.delenv(profile_call.LAYOUT_VARIABLE)
    with profile_call.grad_value_layout(None):
        assert profile_call.LAYOUT_VARIABLE not in os.environ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_backward_rows_are_timed_in_graphs():
    """A backward whose forward ran on the legacy default stream cannot be captured; under
    `side_stream` it can, and the previous stream is current again afterwards."""
    import bench_common

    device = torch.device("cuda")
    previous = torch.cuda.current_stream(device)
    with bench_common.side_stream(device):
        x = torch.randn(64, device=device, requires_grad=True)
        y = (x * x).sum()
        _, mode = bench_common.time_calls(device, [lambda: torch.autograd.grad(y, x, retain_graph=True)], warmup=2, iters=3)
    assert mode == "cuda events, graph replay, queue held"
    assert torch.cuda.current_stream(device) == previous


def test_hold_plan_covers_each_chunk_s_queueing_with_the_margin():
    """A chunk's hold outlasts the host's queueing of it by HOLD_MARGIN, within the hold's bounds;
    a host cost beyond the longest hold leaves one call per chunk."""
    import bench_common as bc

    chunk, hold = bc.hold_plan(0.02, 50)  # a graph replay and two events: about 20 us
    assert chunk == 50 and hold == pytest.approx(bc.HOLD_MARGIN * 0.02 * 50)
    chunk, hold = bc.hold_plan(1.0, 50)  # an eager backward of many launches
    assert chunk == int(bc.MAX_HOLD_MS / bc.HOLD_MARGIN) and hold <= bc.MAX_HOLD_MS
    assert hold >= bc.HOLD_MARGIN * 1.0 * chunk
    assert bc.hold_plan(1e-6, 3) == (3, bc.MIN_HOLD_MS)
    assert bc.hold_plan(200.0, 50) == (1, bc.MAX_HOLD_MS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the held queue needs a CUDA GPU")
def test_held_chunks_time_a_call_without_the_host_s_gaps():
    """Host work between the calls (a sleep standing in for Python and launches) does not reach the
    samples: each call's events are queued before the GPU leaves the hold."""
    import bench_common as bc

    x = torch.randn(1 << 20, device="cuda")

    def call():
        time.sleep(2e-4)
        x.mul_(1.0)

    samples, held = bc.held_chunks([call], iters=20)
    assert held and len(samples) == 20
    assert statistics.median(samples) < 0.1  # the 0.2 ms of host sleep per call is not in it


def test_side_stream_leaves_a_cpu_run_alone():
    """On the CPU there is no stream to switch: the body runs, and nothing touches CUDA (on a machine
    without a GPU, making a CUDA stream would raise)."""
    import bench_common

    ran = []
    with bench_common.side_stream(torch.device("cpu")):
        ran.append(True)
    assert ran == [True]
