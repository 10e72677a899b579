"""tools/end_to_end_evidence.sh on the CPU, with stand-in commands: what each of its three device
calls runs, on which GPU and cores."""

import tarfile

import pytest
from stand_in_commands import ROOT, StandIns


@pytest.fixture
def evidence(tmp_path):
    """Runs the script's call N; returns {'-': calls off the lanes, '0': lane E's, '1': lane T's}
    (by CUDA_VISIBLE_DEVICES), each python3 call as 'cores| arguments' ('-': not pinned)."""
    stand_ins = StandIns(tmp_path)

    def run(*args: str, expect_rc: int = 0, **env: str) -> dict[str, list[str]]:
        # no build cache: a cached copy would be written over the extension this process has loaded
        folders = {"EVIDENCE_DIR": str(tmp_path / "out"), "PARITY_WORK": str(tmp_path / "parity")}
        env = {**folders, "BUILD_CACHE": "", **env}
        calls, _ = stand_ins.run("tools/end_to_end_evidence.sh", *args, env=env, expect_rc=expect_rc)
        lanes: dict[str, list[str]] = {"-": [], "0": [], "1": []}
        for call in calls:
            gpu, cores, _, arguments = call.split("|", 3)
            lanes[gpu or "-"].append(f"{cores or '-'}|{arguments}")
        return lanes

    return run


def test_call_1_builds_measures_host_cost_alone_then_splits_tests_from_timing(evidence, tmp_path):
    lanes = evidence("1")
    build, info, host, targets = lanes["-"]
    assert "pip install" in build and "mmdeform_tma.info" in info and "--host-overhead" in host
    assert all(call.startswith("-|") for call in lanes["-"])  # no lane: the machine to itself
    tests, *parity = [call for call in lanes["1"] if "make_synthetic_coco.py" not in call]
    assert "test_mmdet_gpu.py" in tests
    assert tests.endswith("-k not (fast_path and (dino or layers)) and not mask2former")
    # loss parity's eager runs, the reference and the repeat, in the folder that call 3 reads
    assert [call.split("--work-dir ")[1].split()[0] for call in parity] == [
        str(tmp_path / "parity" / f"deformable-detr_r50_synthetic_tma-ws-{run}") for run in ("eager", "eager-2")
    ]
    assert not any("--fast" in call for call in parity)
    fast, paired = lanes["0"]
    assert "deformable-detr" in fast and "--fast-backends auto" in fast
    assert "deformable-detr" in paired and "--paired 5" in paired


def test_each_call_ends_with_the_targets_of_its_rows_and_the_earlier_calls(evidence, tmp_path):
    (tmp_path / "evidence_1").mkdir()  # call 1's folder on this machine
    (tmp_path / "evidence_parity").mkdir()  # loss parity's runs: no evidence of a call
    lanes = evidence("2", EVIDENCE_DIR=str(tmp_path / "evidence_2"))
    targets = lanes["-"][-1]
    assert targets.endswith(f"tools/e2e_targets.py {tmp_path / 'evidence_2'} {tmp_path / 'evidence_1'}")


def test_lanes_take_a_gpu_and_half_of_the_cores_each(evidence):
    extension = {path: path.stat().st_mtime_ns for path in (ROOT / "mmdeform_tma").glob("_C*.so")}
    for call in "123":
        lanes = evidence(call)
        assert lanes["0"] and {c.split("|")[0] for c in lanes["0"]} == {"0-15"}
        assert lanes["1"] and {c.split("|")[0] for c in lanes["1"]} == {"16-31"}
    assert extension == {path: path.stat().st_mtime_ns for path in (ROOT / "mmdeform_tma").glob("_C*.so")}


def test_call_2_runs_dino_s_rows_and_the_rest_of_the_integration_tests(evidence):
    lanes = evidence("2")
    assert not any("--host-overhead" in call for call in lanes["-"])
    tests, unit = lanes["1"]
    assert tests.endswith("-k (fast_path and (dino or layers)) or mask2former")  # the rest of call 1's
    assert "--ignore=tests/integrations" in unit  # the other GPU tests
    fast, paired_dino, paired_mask2former = lanes["0"]
    assert "dino-4scale" in fast and "--fast-backends auto" in fast
    assert "dino-4scale" in paired_dino and "mask2former" in paired_mask2former
    assert "--paired 5" in paired_mask2former


def test_call_3_times_batch_8_then_the_kernel_tests_beside_detr_s_loss_parity(evidence, tmp_path):
    lanes = evidence("3")
    fast, *kernels = lanes["0"]
    assert "deformable-detr" in fast and fast.endswith("--batch 8")
    assert [call.endswith(" tests/backends") for call in kernels] == [True, True]  # cuda, tma_ws
    train, compare, *tests = [call for call in lanes["1"] if "make_synthetic_coco.py" not in call]
    runs = tmp_path / "parity" / "deformable-detr_r50_synthetic_tma-ws"
    assert "tools/train.py" in train and "--fast" in train and f"--work-dir {runs}-fast " in train
    assert "compare_loss_curves.py" in compare and f"{runs}-eager {runs}-fast --repeats {runs}-eager-2" in compare
    assert [call.split()[1:2] for call in tests] == [["tools/test.py"]] * 2


def test_results_are_packed_when_asked_without_checkpoints(evidence, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "out" / "t" / "work").mkdir(parents=True)
    (tmp_path / "out" / "t" / "work" / "epoch_1.pth").write_bytes(b"weights")
    evidence("3", RESULTS=str(results))
    with tarfile.open(results / "evidence_3.tgz") as packed:
        names = packed.getnames()
    assert any(name.endswith("lane_t.txt") for name in names)
    assert not any(name.endswith(".pth") for name in names)


def test_the_device_s_out_is_not_the_evidence_folder(evidence, tmp_path):
    """The device tool sets OUT to the folder that comes back; the logs must not land there, nor the
    archive pack itself (session 23's call 1 did both)."""
    device_out = tmp_path / "device_out"
    device_out.mkdir()
    evidence("1", OUT=str(device_out), RESULTS=str(device_out))
    assert sorted(path.name for path in device_out.iterdir()) == ["evidence_1.tgz"]
    assert (tmp_path / "out" / "lane_t.txt").exists()


def test_one_gpu_is_refused(tmp_path):
    stand_ins = StandIns(tmp_path)
    stand_ins.gpus(1)
    calls, _ = stand_ins.run("tools/end_to_end_evidence.sh", "1", env={"EVIDENCE_DIR": str(tmp_path / "out")},
                             expect_rc=2)
    assert calls == []  # nothing built or run: lane T would have had no GPU


def test_an_unknown_call_is_refused(evidence):
    assert evidence("4", expect_rc=2) == {"-": [], "0": [], "1": []}
