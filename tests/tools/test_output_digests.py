"""`tools/output_digests.py`, on the CPU with the pytorch backend (the compiled op's CPU kernel)."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import output_digests  # noqa: E402

from mmdeform_tma import library  # noqa: E402

pytestmark = pytest.mark.skipif(not library.OPS_LOADED, reason="mmdeform_tma._C is not built")
CPU = ["--device", "cpu", "--backends", "pytorch"]


def test_the_same_build_matches_itself_and_a_changed_output_is_named(tmp_path, capsys):
    base = tmp_path / "base.json"
    assert output_digests.main([*CPU, "--out", str(base)]) == 0
    digests = json.loads(base.read_text())["digests"]
    # every case, dtype and direction; the CPU build lists no configs, so the kernel's own choice
    assert len(digests) == len(output_digests.CASES) * len(output_digests.DTYPES) * 2
    assert "pytorch/backward-deterministic/default/encoder/float16" in digests
    assert output_digests.main([*CPU, "--compare", str(base)]) == 0

    key = "pytorch/forward/default/local/bfloat16"
    digests[key] = "0" * 32
    base.write_text(json.dumps({"device": "cpu", "digests": digests}))
    capsys.readouterr()
    assert output_digests.main([*CPU, "--compare", str(base)]) == 1
    assert f"differs: {key}" in capsys.readouterr().out


def test_variants_in_one_build_only_are_listed_and_nothing_shared_fails(tmp_path):
    assert output_digests.compare({"a": "1", "b": "2"}, {"a": "1", "c": "3"}) == [
        "only in the base: c", "only in this build: b"
    ]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"device": "cuda", "digests": {"tma_ws/forward/x/encoder/float16": "1"}}))
    assert output_digests.main([*CPU, "--compare", str(other)]) == 1


def test_digests_follow_every_bit():
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[1] += 1  # the next bf16 value
    assert b[1] != a[1]
    assert output_digests.digest(a) == output_digests.digest(a.clone()) != output_digests.digest(b)
    assert output_digests.digest(a, b) != output_digests.digest(b, a)
