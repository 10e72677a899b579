"""tools/l1_gather_banks.py: the layouts gather the same rows, ordered and placed as they claim."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import l1_gather_banks as tool  # noqa: E402

HEIGHT, WIDTH, HEADS, POINTS, BATCH = 6, 12, 4, 3, 2  # 72 queries: whole warps of teams
KEYS = HEIGHT * WIDTH


@pytest.fixture(scope="module")
def key0():
    return tool.corner_keys(HEIGHT, WIDTH, HEADS, POINTS, BATCH, seed=0, device=torch.device("cpu"))


def decode(layout: str, offsets: torch.Tensor) -> torch.Tensor:
    """(key, head) of each row offset, as key * HEADS + head."""
    row = offsets // tool.ROW_BYTES
    if layout == "head_major":
        head, key = row // KEYS, row % KEYS
    else:
        per_key = tool.value_bytes(layout, KEYS, HEADS) // KEYS // tool.ROW_BYTES
        key, head = row // per_key, row % per_key
    return key * HEADS + head


def test_corner_keys_leave_room_for_all_four_corners(key0):
    assert key0.shape == (BATCH, KEYS, HEADS, POINTS)
    x0, y0 = key0 % WIDTH, key0 // WIDTH
    assert int(x0.max()) <= WIDTH - 2 and int(y0.max()) <= HEIGHT - 2 and int(key0.min()) >= 0


@pytest.mark.parametrize("layout", tool.LAYOUTS)
def test_every_layout_gathers_the_same_rows_inside_its_value(key0, layout):
    offsets = tool.team_offsets(layout, key0, WIDTH, KEYS)
    assert offsets.shape == (BATCH * KEYS * HEADS * POINTS, 4)
    assert int(offsets.min()) >= 0
    assert int(offsets.max()) + tool.ROW_BYTES <= tool.value_bytes(layout, KEYS, HEADS)
    assert bool((offsets % tool.ROW_BYTES == 0).all())
    reference = tool.team_offsets("one_head_per_warp", key0, WIDTH, KEYS)
    for corner in range(4):
        got = decode(layout, offsets[:, corner]).sort().values
        want = decode("one_head_per_warp", reference[:, corner]).sort().values
        assert torch.equal(got, want)


def test_a_warp_of_one_head_uses_one_bank_half_and_of_two_heads_both(key0):
    warps = lambda layout: tool.bank_halves(tool.team_offsets(layout, key0, WIDTH, KEYS)).view(-1, tool.TEAMS_PER_WARP, 4)
    one = warps("one_head_per_warp")
    assert bool((one == one[:, :1]).all())  # every team of a warp in the first team's half
    two = warps("two_heads_per_warp")
    assert bool((two.sum(1) == tool.TEAMS_PER_WARP // 2).all())  # 4 teams in each half, per corner
    assert bool((two[:, 0::2] != two[:, 1::2]).all())  # and each quarter warp's two teams apart


def test_padded_keys_and_head_major_alternate_halves_with_the_key():
    key = torch.arange(8)
    head = torch.full_like(key, 3)
    for layout in ("padded_key_stride", "head_major"):
        halves = tool.bank_halves(tool.row_offset(layout, key, head, KEYS, HEADS))
        assert torch.equal(halves[1:], 1 - halves[:-1])
    same = tool.bank_halves(tool.row_offset("one_head_per_warp", key, head, KEYS, HEADS))
    assert bool((same == same[0]).all())


def test_the_benchmark_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["--iters", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_two_heads_per_warp_refuses_queries_it_cannot_group():
    key0 = tool.corner_keys(3, 5, 2, 1, 1, seed=0, device=torch.device("cpu"))  # 15 queries
    with pytest.raises(ValueError, match="queries in fours"):
        tool.team_offsets("two_heads_per_warp", key0, 5, 15)
