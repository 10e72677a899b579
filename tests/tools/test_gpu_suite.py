"""tools/gpu_suite.sh on the CPU: which commands each step runs, with a stand-in python3 that
records its arguments instead of running them."""

import re
import subprocess
import tarfile
import time

import pytest
from stand_in_commands import ROOT, StandIns


@pytest.fixture
def suite(tmp_path):
    """Runs gpu_suite.sh STEPS with ENV; returns each command the stand-in python3 was given, as
    'MMDEFORM_TMA_TEST_BACKENDS| arguments', or 'cores|MMDEFORM_TMA_TEST_BACKENDS| arguments' where
    a taskset pinned it."""
    stand_ins = StandIns(tmp_path)

    def run(*steps: str, expect_rc: int = 0, printed: list | None = None, **env: str) -> list[str]:
        calls, stdout = stand_ins.run("tools/gpu_suite.sh", *steps, env={"OUT": str(tmp_path / "out"), **env},
                                      expect_rc=expect_rc)
        if printed is not None:
            printed.extend(stdout)
        fields = [call.split("|", 2) for call in calls]
        return [f"{cores}|{rest}" if cores else rest for _, cores, rest in fields]

    return run


def test_e2e_runs_the_paired_and_the_fast_rows_per_model(suite):
    calls = suite("e2e", E2E_MODELS="deformable-detr")
    assert len(calls) == 2
    paired, fast = calls
    assert "--backends stock auto" in paired and "--paired 10" in paired and "--fast-backends --" in paired
    assert "--backends stock --fast-backends auto" in fast and "--paired" not in fast
    assert "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py" in fast


def test_e2e_rows_and_rounds_can_be_chosen(suite):
    (paired,) = suite("e2e", E2E_MODELS="dino-4scale", E2E_ROWS="paired", E2E_PAIRED_ROUNDS="5")
    assert "--paired 5" in paired and "dino-4scale_r50_synthetic_tma-ws.py" in paired
    (fast,) = suite("e2e", E2E_MODELS="dino-4scale", E2E_ROWS="fast")
    assert "--fast-backends auto" in fast and "--paired" not in fast


def test_host_step_leaves_the_reference_rows_out(suite):
    (host,) = suite("host")
    assert "--host-overhead --backends auto tma_ws cuda mmcv" in host


def test_integration_step_runs_every_gpu_test_file_of_the_training_paths(suite):
    (tests,) = suite("integration")
    for name in ("test_mmdet_gpu.py", "test_batched_targets.py", "test_mask2former_gpu.py"):
        assert f"tests/integrations/{name}" in tests


def test_kernel_tests_cover_the_compiled_backends_only(suite):
    calls = suite("kernels_cuda", "kernels_tma_ws", "kernels_tma")
    assert [call.split("|")[0] for call in calls] == ["cuda", "tma_ws"]  # 'tma' was retired: no step runs it
    assert all("tests/backends" in call for call in calls)


def test_integration_step_selects_tests_by_k_expression(suite):
    (tests,) = suite("integration", INTEGRATION_K="fast_path and not dino")
    assert tests.endswith("-k fast_path and not dino")
    (everything,) = suite("integration")
    assert " -k " not in everything


def test_every_pytest_run_reports_its_slowest_tests(suite):
    calls = suite("kernels_cuda", "integration")
    assert len(calls) == 2 and all("--durations=" in call for call in calls)


def test_cpus_pin_every_step_to_those_cores(suite):
    tests, host = suite("integration", "host", CPUS="16-31")
    assert tests.startswith("16-31|") and "test_mmdet_gpu.py" in tests
    assert host.startswith("16-31|") and "--host-overhead" in host
    (host,) = suite("host")
    assert host.startswith("| ")  # no pinning without CPUS


def source_key() -> str:
    """The key gpu_suite.sh's build cache is kept under, computed as the script computes it."""
    command = "find setup.py mmdeform_tma/csrc -type f | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-16"
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_info_follows_a_real_build_only(suite, tmp_path):
    build, info = suite("build")
    assert "pip install" in build and "-e ." in build and info.endswith("-m mmdeform_tma.info")

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SOURCES").write_text(source_key() + "\n")
    stand_in = "_C_gpu_suite_test_stand_in.so"  # not an importable name of the extension
    (cache / stand_in).write_text("")
    try:
        assert suite("build", BUILD_CACHE=str(cache)) == []  # the cached extension, copied: no build, no info
        assert (ROOT / "mmdeform_tma" / stand_in).exists()
    finally:
        (ROOT / "mmdeform_tma" / stand_in).unlink(missing_ok=True)


def test_deadline_caps_each_step_s_limit_and_skips_what_cannot_start(suite):
    printed = []
    (host,) = suite("host", DEADLINE=str(int(time.time()) + 100), printed=printed)
    limit = int(re.search(r"=== host \(limit (\d+) s\)", "\n".join(printed)).group(1))
    assert 90 <= limit <= 100  # capped at the time left, not the step's own 300 s

    printed.clear()
    calls = suite("host", "integration", DEADLINE=str(int(time.time()) + 10), expect_rc=1, printed=printed)
    assert calls == []  # neither started: less than MIN_STEP_S left
    assert sum("not run" in line and "left before DEADLINE" in line for line in printed) == 2

    printed.clear()
    suite("host", printed=printed)
    assert "=== host (limit 300 s)" in printed


def test_unit_step_runs_the_suite_outside_the_kernel_integration_and_fuzz_tests(suite):
    (unit,) = suite("unit")
    assert " tests --ignore=tests/backends --ignore=tests/integrations --ignore=tests/test_fuzz.py" in unit


def test_cpus_without_taskset_run_unpinned_and_say_so(tmp_path):
    stand_ins = StandIns(tmp_path)
    path = stand_ins.without("taskset", tmp_path)
    env = {"OUT": str(tmp_path / "out"), "CPUS": "0-7", "PATH": path}
    calls, printed = stand_ins.run("tools/gpu_suite.sh", "host", env=env)
    assert len(calls) == 1 and calls[0].split("|")[1] == "" and "--host-overhead" in calls[0]
    assert any("no taskset" in line for line in printed)


def test_parity_parts_split_over_calls_in_one_work_folder(suite, tmp_path):
    work = tmp_path / "parity"

    def parity(parts: str) -> list[str]:
        calls = suite("parity", PARITY_MODELS="deformable-detr", PARITY_PARTS=parts, PARITY_WORK=str(work))
        return [call for call in calls if "make_synthetic_coco.py" not in call]

    runs = work / "deformable-detr_r50_synthetic_tma-ws"
    eager, repeat = parity("eager")
    assert f"--work-dir {runs}-eager " in eager and f"--work-dir {runs}-eager-2 " in repeat
    assert "--fast" not in eager + repeat
    fast, compare, test_eager, test_fast = parity("fast compare test")
    assert "tools/train.py" in fast and f"--fast --work-dir {runs}-fast " in fast
    assert f"{runs}-eager {runs}-fast --repeats {runs}-eager-2" in compare
    assert f"{runs}-fast/epoch_1.pth" in test_eager and "--fast" not in test_eager and "--fast" in test_fast
    assert len(parity("eager fast compare test")) == 6


def test_a_device_call_s_environment_does_not_reach_the_runs_under_test(suite, monkeypatch):
    """These tests run on the device too (gpu_suite.sh unit, in a lane): its OUT, DEADLINE, CPUS,
    CUDA_VISIBLE_DEVICES and RESULTS once made eleven of them fail there (session 23)."""
    clean = suite("host", "integration", "parity")
    lane = {"CPUS": "16-31", "CUDA_VISIBLE_DEVICES": "1", "DEADLINE": str(int(time.time()) + 40), "RESULTS": "/x",
            "INTEGRATION_K": "mask2former", "PARITY_PARTS": "fast", "MMDEFORM_TMA_TEST_BACKENDS": "cuda"}
    for name, value in lane.items():
        monkeypatch.setenv(name, value)
    assert suite("host", "integration", "parity") == clean


def test_dcnv4_step_installs_a_wheel_it_has_without_building(suite, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "dcnv4-1.0.0.post2-cp312-cp312-linux_x86_64.whl").write_bytes(b"wheel")
    (install,) = suite("dcnv4", DCNV4_WHEELS=str(wheels))
    assert "-m pip install" in install and "--target /tmp/site" in install
    assert install.endswith(f"{wheels}/dcnv4-1.0.0.post2-cp312-cp312-linux_x86_64.whl")


def test_dcnv4_step_builds_the_wheel_from_the_sdist(suite, tmp_path):
    package = tmp_path / "DCNv4-1.0.0.post2"
    package.mkdir()
    (package / "setup.py").write_text("")
    sdist = tmp_path / "DCNv4-1.0.0.post2.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(package, arcname=package.name)
    wheels = tmp_path / "wheels"
    (build,) = suite("dcnv4", DCNV4_WHEELS=str(wheels), DCNV4_SDIST=str(sdist))  # the stand-in builds none
    assert f"-m pip wheel --no-deps --no-build-isolation -w {wheels} /tmp/dcnv4_source/DCNv4-1.0.0.post2/" in build


def test_dcnv4_step_without_wheel_or_sdist_says_so(suite, tmp_path):
    printed = []
    calls = suite("dcnv4", DCNV4_WHEELS=str(tmp_path / "none"), DCNV4_SDIST=str(tmp_path / "missing.tar.gz"),
                  expect_rc=1, printed=printed)
    assert calls == []
    assert any("no wheel" in line and "no sdist" in line for line in printed)


def test_ab_builds_the_base_tree_then_tunes_base_and_checkout_apart(suite, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "setup.py").write_text("")
    build, tune_base, tune_new = suite("ab", AB_BASE=str(base), AB_ARGS="--presets detr_enc_bs2 --configs c4_t64_s2_m16")
    assert build.endswith("setup.py build_ext --inplace")
    for tune, tree in ((tune_base, "base"), (tune_new, "new")):
        assert "tools/autotune.py" in tune and tune.endswith("--presets detr_enc_bs2 --configs c4_t64_s2_m16")
        assert f"table_ab_{tree}.json" in tune and f"autotune_ab_{tree}.json" in tune


def test_ab_without_a_base_tree_runs_nothing_and_fails(suite, tmp_path):
    printed = []
    assert suite("ab", AB_BASE=str(tmp_path / "missing"), expect_rc=1, printed=printed) == []
    assert any("no source tree" in line for line in printed)


def test_ab_op_builds_the_base_then_alternates_the_trees_round_by_round_and_compares(suite, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "setup.py").write_text("")
    build, *benches, compare = suite("ab_op", AB_BASE=str(base), AB_ROUNDS="2")
    assert build.endswith("setup.py build_ext --inplace")
    outs = [re.search(r"--out \S*/(ab_op_\w+)", b)[1] for b in benches]
    assert outs == ["ab_op_base_r1", "ab_op_new_r1", "ab_op_base_r2", "ab_op_new_r2"]
    assert all("tools/benchmark_op.py --presets detr_enc_bs2 detr_enc_bs8 --backends tma_ws" in b and "--deterministic" in b
               for b in benches)
    assert "tools/ab_compare.py" in compare and compare.endswith("ab_op.md")
    assert re.search(r"ab_op_base_r1\.json \S*ab_op_base_r2\.json --new \S*ab_op_new_r1\.json \S*ab_op_new_r2\.json", compare)


def test_ab_op_takes_its_benchmark_arguments(suite, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "setup.py").write_text("")
    _, *benches, _ = suite("ab_op", AB_BASE=str(base), AB_ROUNDS="1", AB_OP_ARGS="--presets detr_dec_bs2 --dtypes float16")
    assert len(benches) == 2 and all("benchmark_op.py --presets detr_dec_bs2 --dtypes float16 --out" in b for b in benches)


def test_ab_op_without_a_base_tree_runs_nothing_and_fails(suite, tmp_path):
    printed = []
    assert suite("ab_op", AB_BASE=str(tmp_path / "missing"), expect_rc=1, printed=printed) == []
    assert any("ab_op: no source tree" in line for line in printed)


def test_l1_banks_step_times_the_microbenchmark_then_counts_its_wavefronts(suite):
    timed, profiled = suite("l1_banks")
    assert timed.endswith(" tools/l1_gather_banks.py")
    assert "ncu --clock-control none --kernel-name gather_rows --metrics" in profiled
    assert "l1tex__data_pipe_lsu_wavefronts.sum" in profiled
    assert profiled.endswith("python3 tools/l1_gather_banks.py --warmup 0 --iters 1")


def test_l1_banks_step_without_ncu_says_so_and_fails(tmp_path):
    stand_ins = StandIns(tmp_path)
    path = stand_ins.without("ncu", tmp_path)
    calls, stdout = stand_ins.run("tools/gpu_suite.sh", "l1_banks", env={"OUT": str(tmp_path / "out"), "PATH": path},
                                  expect_rc=1)
    assert "=== l1_banks_ncu: no ncu on PATH" in stdout
    assert not any(" ncu " in call for call in calls) and len(calls) == 1


def test_autotune_step_then_lists_the_stale_entries(suite):
    tune, stale = suite("autotune")
    assert "tools/autotune.py --backends tma_ws cuda --directions forward backward backward-deterministic" in tune
    assert stale.endswith("tools/autotune.py --stale")


def test_sanitize_step_runs_each_tool_over_the_sanitizer_cases(suite):
    calls = suite("sanitize")
    assert [c.split("--tool ")[1].split()[0] for c in calls] == ["memcheck", "racecheck", "synccheck"]
    assert all(c.endswith("--error-exitcode 1 python3 tools/sanitize_cases.py --backends cuda tma_ws") for c in calls)


def test_sanitize_step_narrows_to_a_backend_and_config_groups(suite):
    calls = suite("sanitize", SANITIZE_BACKENDS="tma_ws", SANITIZE_ARGS="--groups region")
    assert len(calls) == 3
    assert all(c.endswith("tools/sanitize_cases.py --backends tma_ws --groups region") for c in calls)
