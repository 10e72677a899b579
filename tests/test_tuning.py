"""Tuning tables: per-direction choices, the nearest-shape rule, GPUs without a table of their own."""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from msda_cases import region_forward_reason, tensor_core_forward_reason

from mmdeform_tma import _extension, dispatch, tuning
from mmdeform_tma.tuning import ShapeKey, distance

GPU, CAPABILITY = "Test GPU", (9, 0)
ALL = ("tma_ws", "other", "cuda")  # "other": a third kernel family, for the rules alone


def entry(key, backend, direction, *timed):
    return {"key": key, "backend": backend, "direction": direction, "best": [{"config": c, "ms": ms} for c, ms in timed]}


# A decoder-sized shape (w10) where tma_ws is fastest and an encoder-sized one (w16) where cuda is,
# except in the encoder's backward, where tma_ws is.
SYNTHETIC = [
    entry("float16/h8/c32/l4/p4/w10", "tma_ws", "forward", ("ws_a", 0.020)),
    entry("float16/h8/c32/l4/p4/w10", "cuda", "forward", ("cu_a", 0.025)),
    entry("float16/h8/c32/l4/p4/w10", "tma_ws", "backward", ("ws_b", 0.070)),
    entry("float16/h8/c32/l4/p4/w10", "cuda", "backward", ("cu_b", 0.086)),
    entry("float16/h8/c32/l4/p4/w16", "tma_ws", "forward", ("ws_a", 0.43)),
    entry("float16/h8/c32/l4/p4/w16", "cuda", "forward", ("cu_c", 0.21), ("cu_a", 0.22)),
    entry("float16/h8/c32/l4/p4/w16", "tma_ws", "backward", ("ws_b", 1.0)),
    entry("float16/h8/c32/l4/p4/w16", "cuda", "backward", ("cu_b", 1.05)),
    entry("float32/h8/c32/l4/p4/w16", "other", "forward", ("s2", 0.5)),
    # the deterministic backward, measured at the encoder only: tma_ws's gather config wins there
    entry("float16/h8/c32/l4/p4/w16", "tma_ws", "backward-deterministic", ("ws_g", 2.2), ("ws_b", 7.0)),
    entry("float16/h8/c32/l4/p4/w16", "cuda", "backward-deterministic", ("cu_b", 6.7)),
]


def compiled_names(entries):
    """Every config the entries name, as if this build compiled them all."""
    names = {}
    for e in entries:
        direction = tuning.kernel_direction(e["direction"])
        names.setdefault((e["backend"], direction), {}).update(dict.fromkeys(c["config"] for c in e["best"]))
    return {k: tuple(v) for k, v in names.items()}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A synthetic table for GPU, the only one loaded; the build compiles every config it names."""
    names = compiled_names(SYNTHETIC)
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: names.get((backend, direction), ()))
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"format": tuning.TABLE_FORMAT, "device": GPU, "capability": list(CAPABILITY), "entries": SYNTHETIC}))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path / "none")
    monkeypatch.setenv("MMDEFORM_TMA_TUNING_TABLE", str(path))
    dispatch.clear_caches()
    yield path
    dispatch.clear_caches()


def fastest(key, direction, candidates=ALL, gpu=GPU, capability=CAPABILITY):
    return tuning._fastest(gpu, capability, key, direction, candidates)


def test_shape_key_round_trips():
    key = tuning.shape_key(torch.bfloat16, 8, 32, 4, 4, 40394)
    assert key == "bfloat16/h8/c32/l4/p4/w16"
    assert ShapeKey.parse(key) == ShapeKey("bfloat16", 8, 32, 4, 4, 16) and ShapeKey.parse(key).row_bytes == 64


def test_a_measured_shape_decides_each_direction_by_its_own_times(table):
    assert fastest("float16/h8/c32/l4/p4/w16", "forward") == "cuda"
    assert fastest("float16/h8/c32/l4/p4/w16", "backward") == "tma_ws"
    assert fastest("float16/h8/c32/l4/p4/w10", "forward") == "tma_ws"


def test_only_candidates_are_chosen(table):
    assert fastest("float16/h8/c32/l4/p4/w10", "forward", ("cuda",)) == "cuda"
    # Nothing measured for `other` at all in fp16: the nearest shape measuring a candidate is fp32's.
    assert fastest("float16/h8/c32/l4/p4/w10", "forward", ("other",)) == "other"


@pytest.mark.parametrize(
    "key, expected",
    [
        ("float16/h8/c32/l4/p4/w11", "tma_ws"),  # one step from the decoder, five from the encoder
        ("float16/h8/c32/l4/p4/w15", "cuda"),
        ("float16/h8/c32/l4/p4/w13", "cuda"),  # a tie: the larger measured shape
        ("float16/h8/c32/l5/p8/w17", "cuda"),  # more levels and points: still nearest the encoder
        ("bfloat16/h8/c32/l4/p4/w16", "cuda"),  # another dtype of the same row bytes: fp16's times
        ("float16/h4/c64/l4/p4/w9", "tma_ws"),  # other heads and channels: layout first, then size
    ],
)
def test_an_unmeasured_shape_takes_the_nearest_measured_one(table, key, expected):
    assert fastest(key, "forward") == expected


def test_measurements_of_kernels_this_build_lacks_are_ignored(table, monkeypatch):
    """A kernel rewrite renames its configs: the old times say nothing about the new kernels."""
    names = compiled_names(SYNTHETIC)
    names[("tma_ws", "forward")] = ("new_window_config",)
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: names.get((backend, direction), ()))
    tuning.clear_caches()
    assert fastest("float16/h8/c32/l4/p4/w10", "forward") == "cuda"
    assert fastest("float16/h8/c32/l4/p4/w10", "backward") == "tma_ws"  # its backward configs are still built
    assert tuning._best_config(GPU, CAPABILITY, "float16/h8/c32/l4/p4/w10", "tma_ws", "forward") == -1
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: ())
    tuning.clear_caches()
    assert fastest("float16/h8/c32/l4/p4/w16", "forward") == "tma_ws"  # nothing valid measured: the candidates' order


def test_the_deterministic_backward_is_tuned_apart_and_falls_back_to_the_fast_one(table):
    det = tuning.DETERMINISTIC_BACKWARD
    names = _extension.kernel_configs("tma_ws", "backward")
    assert "ws_g" in names  # a deterministic ranking names backward configs
    best = lambda key, backend, direction: tuning._best_config(GPU, CAPABILITY, key, backend, direction)  # noqa: E731
    assert best("float16/h8/c32/l4/p4/w16", "tma_ws", det) == names.index("ws_g")
    assert best("float16/h8/c32/l4/p4/w16", "tma_ws", "backward") == names.index("ws_b")
    # fp32 has no deterministic measurement of its layout: the fast backward's config (none here)
    assert best("float32/h8/c32/l4/p4/w16", "tma_ws", det) == -1
    assert fastest("float16/h8/c32/l4/p4/w16", det) == "tma_ws"
    assert fastest("float16/h8/c32/l4/p4/w16", det, ("cuda", "other")) == "cuda"


def test_without_deterministic_measurements_the_fast_backward_decides(table):
    det = tuning.DETERMINISTIC_BACKWARD
    table.write_text(json.dumps({
        "format": tuning.TABLE_FORMAT, "device": GPU, "capability": list(CAPABILITY),
        "entries": [e for e in SYNTHETIC if e["direction"] != det],
    }))
    tuning.clear_caches()
    assert tuning.nearest_times(GPU, CAPABILITY, "float16/h8/c32/l4/p4/w10", det, ALL) is None
    assert fastest("float16/h8/c32/l4/p4/w10", det, ("cuda", "tma_ws")) == "tma_ws"  # 0.070 against 0.086
    names = _extension.kernel_configs("tma_ws", "backward")
    assert tuning._best_config(GPU, CAPABILITY, "float16/h8/c32/l4/p4/w16", "tma_ws", det) == names.index("ws_b")


def test_backward_direction_follows_the_deterministic_flag():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert tuning.backward_direction() == tuning.DETERMINISTIC_BACKWARD
        torch.use_deterministic_algorithms(False)
        assert tuning.backward_direction() == "backward"
    finally:
        torch.use_deterministic_algorithms(before)


def test_layout_differences_count_before_size():
    target = ShapeKey.parse("float32/h8/c32/l4/p4/w16")
    same_layout_far = distance(target, ShapeKey.parse("float32/h8/c32/l3/p2/w9"))
    other_dtype_near = distance(target, ShapeKey.parse("float16/h8/c32/l4/p4/w16"))
    assert same_layout_far < other_dtype_near
    assert distance(target, ShapeKey.parse("float32/h8/c32/l4/p4/w17")) < distance(target, ShapeKey.parse("float32/h8/c32/l4/p4/w15"))


def test_a_gpu_without_a_table_uses_its_architecture_s(table):
    assert fastest("float16/h8/c32/l4/p4/w16", "forward", gpu="Other Hopper") == "cuda"
    # No table of this architecture: the candidates' own order, the one case without measurements.
    assert fastest("float16/h8/c32/l4/p4/w16", "forward", gpu="Ampere", capability=(8, 0)) == "tma_ws"
    assert tuning.nearest_times("Ampere", (8, 0), "float16/h8/c32/l4/p4/w16", "forward", ALL) is None


def test_kernel_configs_come_from_the_nearest_shape_of_the_same_layout(table, monkeypatch):
    names = {("cuda", "forward"): ("cu_a", "cu_b", "cu_c"), ("tma_ws", "forward"): ("ws_a",)}
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: names.get((backend, direction), ()))
    tuning.clear_caches()
    best = lambda key, backend: tuning._best_config(GPU, CAPABILITY, key, backend, "forward")  # noqa: E731
    assert best("float16/h8/c32/l4/p4/w16", "cuda") == 2  # cu_c, the measured best
    assert best("float16/h8/c32/l4/p4/w14", "cuda") == 2  # the nearest shape's
    assert best("float16/h8/c32/l4/p4/w11", "cuda") == 0  # the decoder's cu_a
    assert best("float16/h8/c64/l4/p4/w16", "cuda") == -1  # no shape of this layout: the kernel's heuristic
    assert best("bfloat16/h8/c32/l4/p4/w16", "cuda") == -1
    assert best("float16/h8/c32/l4/p4/w16", "other") == -1  # not measured


def test_a_user_table_wins_on_equal_keys(table, tmp_path, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    (package / "gpu.json").write_text(json.dumps({"format": 1, "device": GPU, "entries": [entry("float16/h8/c32/l4/p4/w16", "tma_ws", "forward", ("ws_a", 0.01))]}))
    monkeypatch.setattr(tuning, "TABLE_DIR", package)
    tuning.clear_caches()
    assert fastest("float16/h8/c32/l4/p4/w16", "forward") == "cuda"  # the user's table, read last
    assert tuning.load_tables()[GPU].capability == CAPABILITY


def test_the_package_tables_declare_their_gpus_capability():
    tuning.clear_caches()
    try:
        tables = tuning.load_tables()
        assert tables and all(table.capability for table in tables.values())
        h100 = tuning.measurements("NVIDIA H100 80GB HBM3", (9, 0))
        assert h100 and set(h100) <= set(tuning.measurements("A Hopper without a table", (9, 0)))
    finally:
        tuning.clear_caches()


H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def h100_table(monkeypatch):
    """The package's H100 table alone, with every config it names compiled (CI's build may have none)."""
    monkeypatch.delenv("MMDEFORM_TMA_TUNING_TABLE", raising=False)
    names = compiled_names(json.loads((tuning.TABLE_DIR / "nvidia_h100_80gb_hbm3.json").read_text())["entries"])
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: names.get((backend, direction), ()))
    dispatch.clear_caches()
    yield
    dispatch.clear_caches()


@pytest.mark.parametrize(
    ("dtype", "batch", "queries", "direction", "expected"),
    [
        # sweep s10: before its own (backward-only) entry, the nearest bucket was DINO's bs 2 x 900,
        # where cuda is 2 % ahead; at bs 8 x 300 tma_ws is 8 % (H100) to 12 % (H200) ahead.
        (torch.float32, 8, 300, "backward", "tma_ws"),
        (torch.float32, 2, 900, "backward", "cuda"),
        # the entry is a backward one: s10's forward and s40 (fp16, bs 4 x 2000) keep their neighbours,
        # which a bs 8 entry of every dtype and direction had moved (perf_notes item 60)
        (torch.float32, 8, 300, "forward", "tma_ws"),
        (torch.float16, 4, 2000, "forward", "tma_ws"),
    ],
)
def test_the_h100_table_answers_the_decoder_sweep_shapes(h100_table, dtype, batch, queries, direction, expected):
    key = tuning.shape_key(dtype, 8, 32, 4, 4, batch * queries)
    assert fastest(key, direction, ("cuda", "tma_ws"), gpu=H100, capability=(9, 0)) == expected


def test_a_wrong_table_format_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": 0, "device": GPU, "entries": []}))
    monkeypatch.setenv("MMDEFORM_TMA_TUNING_TABLE", str(path))
    tuning.clear_caches()
    try:
        with pytest.raises(ValueError, match="tuning table format 0, expected 1"):
            tuning.load_tables()
    finally:
        monkeypatch.delenv("MMDEFORM_TMA_TUNING_TABLE")
        tuning.clear_caches()


def test_backward_direction_traces_fullgraph_and_guards_on_the_flag():
    """Compiled callers (the launcher under torch.compile) read the flag at trace time; dynamo must
    recompile, not reuse the other mode's choice."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * (2 if tuning.backward_direction() == "backward" else 3), fullgraph=True, backend="aot_eager")
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert compiled(torch.ones(1)).item() == 2
        torch.use_deterministic_algorithms(True)
        assert compiled(torch.ones(1)).item() == 3
    finally:
        torch.use_deterministic_algorithms(before)
        torch._dynamo.reset()


def test_work_bits_is_bit_length_and_guards_a_symbolic_size_on_its_range_only():
    """Under torch.compile's dynamic shapes the query count is symbolic: the tuning key must not
    pin its value (a recompile per size), only its power-of-two bucket."""
    from msda_cases import guards, symbolic_sizes

    assert [tuning.work_bits(n) for n in range(0, 9)] == [max(n, 1).bit_length() for n in range(0, 9)]
    assert tuning.work_bits(2**40) == 41
    (queries,), env = symbolic_sizes(queries=20197)
    assert tuning.work_bits(2 * queries) == (2 * 20197).bit_length()
    q = queries.node.expr
    assert guards(env)[-2:] == [f"2*{q} >= 32768", f"2*{q} < 65536"]
    assert not any(g.startswith("Eq(") for g in guards(env))



def region_config_measured_at(key, table, monkeypatch):
    """The synthetic table with tma_ws's forward at `key` led by the region forward (0.13 ms, then ws_a at
    0.43; cuda 0.21 there); returns the forward config names this build is taken to compile."""
    entries = [e for e in SYNTHETIC if (e["key"], e["backend"], e["direction"]) != (key, "tma_ws", "forward")]
    entries.append(entry(key, "tma_ws", "forward", ("rg_r8x16", 0.13), ("ws_a", 0.43)))
    table.write_text(json.dumps({"format": tuning.TABLE_FORMAT, "device": GPU, "capability": list(CAPABILITY), "entries": entries}))
    names = compiled_names(entries)
    monkeypatch.setattr(_extension, "_kernel_configs", lambda backend, direction: names.get((backend, direction), ()))
    tuning.clear_caches()
    return _extension.kernel_configs("tma_ws", "forward")


def test_self_attention_only_configs_stand_only_for_one_query_per_key(table, monkeypatch):
    """A region forward config (`rg_*`) measured fastest on an encoder is not chosen for a decoder of as
    many queries in all (the same table key): the next config is, and the backend choice follows that
    config's time."""
    key = "float16/h8/c32/l4/p4/w16"
    forward = region_config_measured_at(key, table, monkeypatch)
    best = lambda attention: tuning._best_config(GPU, CAPABILITY, key, "tma_ws", "forward", attention)  # noqa: E731
    assert best(True) == forward.index("rg_r8x16")
    assert best(False) == forward.index("ws_a")
    assert tuning._fastest(GPU, CAPABILITY, key, "forward", ALL, True) == "tma_ws"  # 0.13 against cuda's 0.21
    assert tuning._fastest(GPU, CAPABILITY, key, "forward", ALL, False) == "cuda"  # 0.43 against 0.21


def shape_of(dtype, channels, levels, points, self_attention, batch=2, heads=8):
    """A call's tensors as the refusal rules read them (meta tensors: shapes and dtypes only)."""
    keys = 300
    queries = keys if self_attention else keys + 1
    return SimpleNamespace(
        value=torch.empty(batch, keys, heads, channels, dtype=dtype, device="meta"),
        sampling_locations=torch.empty(batch, queries, heads, levels, points, 2, device="meta"),
    )


@pytest.mark.parametrize("config", ["tc_w4", "rg_r8x16", "ws_a"])
def test_the_tables_rule_agrees_with_the_kernels_refusals(config):
    """tuning.config_runs keeps a forward-only config's measurement only for calls its kernel runs: the
    refusals the GPU tests hold the kernels to (msda_cases), on every layout, level and point count."""
    grid = itertools.product((torch.float16, torch.bfloat16, torch.float32), (16, 32, 64), range(1, 7), (1, 2, 3, 4, 6, 8),
                             (True, False))
    for dtype, channels, levels, points, self_attention in grid:
        call = shape_of(dtype, channels, levels, points, self_attention)
        refused = tensor_core_forward_reason(config, call) or region_forward_reason(config, call)
        key = ShapeKey.parse(tuning.shape_key(dtype, 8, channels, levels, points, 2 * call.sampling_locations.shape[1]))
        assert tuning.config_runs(config, key, self_attention) == (refused is None), (dtype, channels, levels, points, self_attention)


def test_the_region_forward_is_not_taken_for_inputs_past_its_32_bit_indices():
    """Value bytes or location coordinates of 2^31 or more: the region forward's fallback refuses them
    (lean_fits), so the whole work bucket that may hold them takes another config."""
    for bits, runs in ((21, True), (22, True), (23, False)):  # value bytes below (2^bits) x 8 heads x 64 bytes
        key = ShapeKey.parse(f"float16/h8/c32/l4/p4/w{bits}")
        assert tuning.config_runs("rg_r8x16", key, True) is runs
    assert tuning.config_runs("rg_r8x16", ShapeKey.parse("float16/h8/c32/l5/p8/w20"), True)
    assert not tuning.config_runs("rg_r8x16", ShapeKey.parse("float16/h16/c32/l5/p8/w21"), True)  # coordinates: 2^21 x 1280


@pytest.mark.parametrize("key, expected", [
    ("float16/h8/c32/l4/p2/w16", "ws_a"),   # 2 points: the region forward refuses them
    ("float16/h8/c32/l3/p6/w15", "ws_a"),   # 6 points
    ("float16/h8/c32/l6/p4/w16", "ws_a"),   # 6 levels
    ("float16/h8/c32/l5/p8/w17", "rg_r8x16"),
    ("float16/h8/c32/l3/p4/w14", "rg_r8x16"),
])
def test_a_region_config_measured_nearby_is_taken_only_where_it_runs(table, monkeypatch, key, expected):
    """The nearest measured encoder names the region forward first: an encoder it cannot run (points,
    levels) takes the entry's next config instead of raising, and `auto`'s backend choice follows that
    config's time."""
    measured = "float16/h8/c32/l4/p4/w16"
    forward = region_config_measured_at(measured, table, monkeypatch)
    assert tuning._best_config(GPU, CAPABILITY, key, "tma_ws", "forward", True) == forward.index(expected)
    assert tuning._fastest(GPU, CAPABILITY, key, "forward", ALL, True) == ("tma_ws" if expected == "rg_r8x16" else "cuda")
