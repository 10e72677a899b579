"""`benchmark_op.py --host-overhead` and the bench_common pieces it stands on, on the CPU."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_common  # noqa: E402
import benchmark_op  # noqa: E402

import mmdeform_tma  # noqa: E402
from mmdeform_tma import library  # noqa: E402


def test_host_wall_per_call_counts_calls_and_scales_per_call():
    calls = []

    def call():
        calls.append(1)
        time.sleep(0.002)

    samples = bench_common.host_wall_per_call(call, torch.device("cpu"), calls=3, repeats=4, warmup=2)
    assert len(calls) == 2 + 3 * 4 and len(samples) == 4
    assert all(2000 <= us < 20000 for us in samples)  # microseconds per call, not per sample


def test_interleaved_samples_take_every_call_in_each_round_in_rotating_order():
    order = []
    calls = {key: (lambda key=key: order.append(key)) for key in "abc"}
    samples = bench_common.interleaved_host_wall_per_call(calls, torch.device("cpu"), calls=2, repeats=3, warmup=1)
    assert {key: len(v) for key, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(us > 0 for v in samples.values() for us in v)
    warm, rounds = order[:3], order[3:]
    assert warm == ["a", "b", "c"]
    assert rounds == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]


def test_a_slow_spell_of_the_host_reaches_every_interleaved_row():
    """The drift that interleaving is for: the host slows down halfway through; measured one row
    after another, only the later row would pay it."""
    clock = {"calls": 0}

    def call():
        clock["calls"] += 1
        time.sleep(0.010 if clock["calls"] > 20 else 0.001)

    samples = bench_common.interleaved_host_wall_per_call({"a": call, "b": call}, torch.device("cpu"), 2, 10, 0)
    slow = {key: sum(us > 5000 for us in v) for key, v in samples.items()}
    assert slow == {"a": 5, "b": 5}


def test_summarize_names_its_unit():
    stats = bench_common.summarize([3.0, 1.0, 2.0], unit="us")
    assert stats == {"median_us": 2.0, "p90_us": 3.0, "p99_us": 3.0, "samples": 3}


def tiny_inputs():
    return benchmark_op.make_inputs(benchmark_op.HOST_OVERHEAD_SHAPE, torch.float32, "local", torch.device("cpu"), 0)


def test_observed_backends_reads_what_auto_ran():
    value, shapes, starts, loc, attn = tiny_inputs()
    loc.requires_grad_()

    def step():
        out = mmdeform_tma.multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend="auto")
        out.sum().backward()

    assert bench_common.observed_backends(step) == {"forward": "pytorch", "backward": "pytorch"}
    assert bench_common.observed_backends(lambda: value + 1) == {"forward": "unknown", "backward": "unknown"}
    # the reference's ops take no kernel config
    assert bench_common.observed_backends(step, configs=True) == {
        "forward": "pytorch", "backward": "pytorch", "forward config": "-", "backward config": "-"
    }


@pytest.mark.skipif(not library.OPS_LOADED, reason="mmdeform_tma._C is not built")
def test_observed_backends_reads_the_backend_argument_of_the_compiled_op():
    value, shapes, starts, loc, attn = tiny_inputs()
    call = lambda: torch.ops.mmdeform_tma.ms_deform_attn_forward(value, shapes, starts, loc, attn, "pytorch", -1)  # noqa: E731
    assert bench_common.observed_backends(call)["forward"] == "pytorch"
    seen = bench_common.observed_backends(call, configs=True)
    assert (seen["forward config"], seen["backward config"]) == ("-1", "-")
    by_keyword = lambda: torch.ops.mmdeform_tma.ms_deform_attn_forward(  # noqa: E731
        value, shapes, starts, loc, attn, backend="pytorch", config=2
    )
    assert bench_common.observed_backends(by_keyword, configs=True)["forward config"] == "2"


def test_host_overhead_on_the_cpu(tmp_path):
    out = tmp_path / "host"
    args = ["--host-overhead", "--device", "cpu", "--host-calls", "2", "--host-repeats", "3", "--warmup", "1", "--out", str(out)]
    assert benchmark_op.main(args) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["api"], r["backend"], r["dtype"], r["direction"]): r for r in data["results"]}
    ours = benchmark_op.OUR_API
    assert {k[1] for k in rows if k[0] == ours} == set(mmdeform_tma.BACKEND_CHOICES)
    assert {(k[2], k[3]) for k in rows} == {(d, s) for d in ("float32", "float16") for s in ("forward", "forward+backward")}
    for dtype in ("float32", "float16"):
        for backend in ("auto", "pytorch"):
            forward, both = rows[(ours, backend, dtype, "forward")], rows[(ours, backend, dtype, "forward+backward")]
            assert forward["error"] is None and forward["timing"]["median_us"] > 0 and forward["calls_per_sample"] == 2
            assert (forward["ran"], both["ran"]) == ("pytorch", "pytorch / pytorch")
            assert (forward["configs"], both["configs"]) == ("-", "- / -")
        assert rows[(ours, "mmcv", dtype, "forward")]["error"] == "unavailable: runs on cuda, not cpu"
    assert data["environment"]["baseline"] == benchmark_op.MMCV_CPU_PATH
    mmcv_function = rows[(benchmark_op.MMCV_FUNCTION, "-", "float32", "forward")]
    cpu_path = rows[(benchmark_op.MMCV_CPU_PATH, "-", "float32", "forward")]
    if data["environment"]["mmcv"] is None:
        assert "mmcv" in mmcv_function["error"] and "mmcv" in cpu_path["error"]
    else:
        assert "cpu" in mmcv_function["error"]  # mmcv 2.1's function has CUDA and MLU kernels only
        assert cpu_path["error"] is None and cpu_path["ratio_to_mmcv"] == 1.0
        pytorch = rows[(ours, "pytorch", "float32", "forward")]
        assert pytorch["ratio_to_mmcv"] == pytest.approx(pytorch["timing"]["median_us"] / cpu_path["timing"]["median_us"])
    markdown = out.with_suffix(".md").read_text()
    assert "| api | backend | dtype | direction | median us/call |" in markdown and "pytorch / pytorch" in markdown


def test_host_overhead_needs_a_direction_it_measures():
    with pytest.raises(SystemExit, match="forward"):
        benchmark_op.main(["--host-overhead", "--device", "cpu", "--directions", "backward"])


def test_host_overhead_writes_to_its_own_default_prefix():
    assert benchmark_op.parse_args(["--host-overhead"]).out == Path("bench_results/op_host")
    assert benchmark_op.parse_args([]).out == Path("bench_results/op")


def test_gc_meter_times_the_collections_inside_it_only():
    import gc

    with bench_common.GcMeter() as meter:
        gc.collect()
        gc.collect(0)
    assert meter.collections[2] >= 1 and meter.collections[0] >= 1 and meter.ms > 0
    after = list(meter.collections)
    gc.collect()
    assert meter.collections == after  # unregistered on exit
