"""tools/gpu_suite.sh on the CPU: which commands each step runs, with a stand-in python3 that
records its arguments instead of running them."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def suite(tmp_path):
    """Runs gpu_suite.sh STEPS with ENV; returns each command the stand-in python3 was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/usr/bin/env bash\necho "${{MMDEFORM_TMA_TEST_BACKENDS:-}}| $*" >> "{calls}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    # taskset: records its core list, then runs the command as the real one would
    taskset = bin_dir / "taskset"
    taskset.write_text(f'#!/usr/bin/env bash\necho "taskset $1 $2" >> "{calls}"\nshift 2\nexec "$@"\n')
    taskset.chmod(taskset.stat().st_mode | stat.S_IEXEC)

    def run(*steps: str, **env: str) -> list[str]:
        calls.unlink(missing_ok=True)
        environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), **env}
        result = subprocess.run(["bash", "tools/gpu_suite.sh", *steps], cwd=ROOT, env=environment,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return calls.read_text().splitlines() if calls.exists() else []

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
    calls = suite("integration", "host", CPUS="16-31")
    assert calls[0::2] == ["taskset -c 16-31"] * 2  # each step's command follows its pinning
    assert "test_mmdet_gpu.py" in calls[1] and "--host-overhead" in calls[3]
    assert not any(call.startswith("taskset") for call in suite("host"))


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
