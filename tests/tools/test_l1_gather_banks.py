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


def first_rows(layout: str, key0: torch.Tensor) -> torch.Tensor:
    """[points, teams] byte offsets of each point's top-left row, in the layout's team order."""
    keys, heads = tool.team_points(layout, key0)
    return tool.row_offset(layout, keys, heads, KEYS, HEADS)


def test_corner_keys_leave_room_for_all_four_corners(key0):
    assert key0.shape == (BATCH, KEYS, HEADS, POINTS)
    x0, y0 = key0 % WIDTH, key0 // WIDTH
    assert int(x0.max()) <= WIDTH - 2 and int(y0.max()) <= HEIGHT - 2 and int(key0.min()) >= 0


@pytest.mark.parametrize("layout", tool.LAYOUTS)
def test_every_layout_gathers_the_same_points_inside_its_value(key0, layout):
    keys, heads = tool.team_points(layout, key0)
    assert keys.shape == heads.shape == (POINTS, BATCH * KEYS * HEADS)
    want_keys, want_heads = tool.team_points("one_head_per_warp", key0)
    for p in range(POINTS):  # the same (key, head) pairs, in another team order
        got = (keys[p] * HEADS + heads[p]).sort().values
        assert torch.equal(got, (want_keys[p] * HEADS + want_heads[p]).sort().values)
    last = tool.row_offset(layout, keys + WIDTH + 1, heads, KEYS, HEADS)  # the bottom-right corner
    assert int(first_rows(layout, key0).min()) >= 0
    assert int(last.max()) + tool.ROW_BYTES <= tool.value_bytes(layout, KEYS, HEADS)


def test_rows_of_distinct_keys_and_heads_do_not_overlap():
    key = torch.arange(KEYS).repeat_interleave(HEADS)
    head = torch.arange(HEADS).repeat(KEYS)
    for layout in tool.LAYOUTS:
        rows = tool.row_offset(layout, key, head, KEYS, HEADS)
        assert rows.unique().numel() == KEYS * HEADS and bool((rows % tool.ROW_BYTES == 0).all())


def test_a_warp_of_one_head_uses_one_bank_half_and_of_two_heads_both(key0):
    def warps(layout):  # [points, warps, 8 teams]
        return tool.bank_halves(first_rows(layout, key0)).view(POINTS, -1, tool.TEAMS_PER_WARP)

    one = warps("one_head_per_warp")
    assert bool((one == one[:, :, :1]).all())  # every team of a warp in the first team's half
    two = warps("two_heads_per_warp")
    assert bool((two.sum(-1) == tool.TEAMS_PER_WARP // 2).all())  # 4 teams in each half
    assert bool((two[..., 0::2] != two[..., 1::2]).all())  # and each quarter warp's two teams apart
    _, heads = tool.team_points("two_heads_per_warp", key0)
    heads = heads.view(POINTS, -1, tool.TEAMS_PER_WARP)  # a warp: heads 2j, 2j + 1 in turn
    assert bool((heads[..., 0::2] % 2 == 0).all()) and torch.equal(heads[..., 1::2], heads[..., 0::2] + 1)
    assert bool((heads == heads[..., :1] + torch.arange(tool.TEAMS_PER_WARP) % 2).all())


def test_the_share_of_warp_loads_in_both_halves_is_none_for_one_head_and_all_for_two(key0):
    assert tool.warps_in_both_halves(first_rows("one_head_per_warp", key0)) == 0.0
    assert tool.warps_in_both_halves(first_rows("two_heads_per_warp", key0)) == 1.0
    assert 0.0 < tool.warps_in_both_halves(first_rows("padded_key_stride", key0)) < 1.0


def test_padded_keys_and_head_major_alternate_halves_with_the_key():
    key = torch.arange(8)
    head = torch.full_like(key, 3)
    for layout in ("padded_key_stride", "head_major"):
        halves = tool.bank_halves(tool.row_offset(layout, key, head, KEYS, HEADS))
        assert torch.equal(halves[1:], 1 - halves[:-1])
    same = tool.bank_halves(tool.row_offset("one_head_per_warp", key, head, KEYS, HEADS))
    assert bool((same == same[0]).all())


def test_pack_keeps_key_and_head_apart_and_refuses_what_does_not_fit():
    keys, heads = torch.tensor([0, 5, (1 << 24) - 1]), torch.tensor([0, 7, 127])
    words = tool.pack(keys, heads)
    assert words.dtype == torch.int32
    assert torch.equal(words & 0xFFFFFF, keys.to(torch.int32)) and torch.equal(words >> 24, heads.to(torch.int32))
    with pytest.raises(ValueError):
        tool.pack(torch.tensor([1 << 24]), torch.tensor([0]))
    with pytest.raises(ValueError):
        tool.pack(torch.tensor([0]), torch.tensor([128]))


def test_two_heads_per_warp_refuses_queries_it_cannot_group():
    key0 = tool.corner_keys(3, 5, 2, 1, 1, seed=0, device=torch.device("cpu"))  # 15 queries
    with pytest.raises(ValueError, match="queries in fours"):
        tool.team_points("two_heads_per_warp", key0)


def test_the_benchmark_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["--iters", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
