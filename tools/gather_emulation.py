"""NumPy emulation of the `tma_ws` window backwards' value gradient, no GPU: the gather kernel (the
`_g` configs) and the MMA kernel's accumulation window (the `_m16` configs and the encoders' default).

It follows window_pipeline.cuh and window_backward.cu stage by stage: pixel-block tiles, the
producer's point geometry (float32), window placement and the window-point test, the counting
sort of window corners by cell (stable: scan order of the producer warp), and the consumers'
per-cell fp32 sums next to the direct reductions of the other corners. The MMA window is 16 x 16
cells whatever the row, and takes a point whose corners *inside its level* lie in it (a corner
outside the level gets no entry; its cell carries kMmaCellBias); `mma="full"` is the rule before
session 48, all four corners inside. The MMA's sums are emulated in fp32 per cell (the kernel's
products run on fp16 hi + lo operands). It checks grad_value against float64 and counts L2
reductions against the plain kernel's (one per valid corner).

    python tools/gather_emulation.py            # correctness on small shapes, then statistics
    python tools/gather_emulation.py --stats    # statistics of the bs 2 fp16 encoder only
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def floor_pow2(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def window_shape(row_bytes: int, kbytes: int = 16) -> tuple[int, int]:
    """(window_rows, window_cols) as window_config.cpp's shape_for sizes them."""
    cells = kbytes * 1024 // row_bytes
    cols = min(max(floor_pow2(int(math.sqrt(cells))), 8), 32)
    return min(max(cells // cols, 1), 32), cols


MMA_WINDOW_SIDE = 16  # window_config.h: kMmaWindowSide
MMA_CELL_BIAS = MMA_WINDOW_SIDE + 1  # window_config.h: kMmaCellBias


def corners_in_window(x0, y0, wx0, wy0, cols, rows):
    """window_pipeline.cuh's corners_in_window(): bits (corner order) of the corners in the window."""
    left, right = (x0 >= wx0) & (x0 < wx0 + cols), (x0 + 1 >= wx0) & (x0 + 1 < wx0 + cols)
    top, bottom = (y0 >= wy0) & (y0 < wy0 + rows), (y0 + 1 >= wy0) & (y0 + 1 < wy0 + rows)
    return (top & left) * 1 | (top & right) * 2 | (bottom & left) * 4 | (bottom & right) * 8


def block_shape(slots: int) -> tuple[int, int]:
    log2 = slots.bit_length() - 1
    rows = 1 << (log2 // 2)
    return rows, slots // rows


def local_inputs(levels, heads, points, rng):
    """The benchmark's 'local' encoder inputs for one batch: each query is a pixel, its points lie
    around its reference point with N(0, 2 px) offsets; softmax attention weights."""
    refs = []
    for h, w in levels:
        ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        refs.append(np.stack([(xs.ravel() + 0.5) / w, (ys.ravel() + 0.5) / h], -1))
    ref = np.concatenate(refs)[:, None, None, None, :]
    wh = np.array([[w, h] for h, w in levels], dtype=np.float64)[None, None, :, None, :]
    q = ref.shape[0]
    loc = (ref + rng.standard_normal((q, heads, len(levels), points, 2)) * 2.0 / wh).astype(np.float32)
    logits = rng.standard_normal((q, heads, len(levels) * points))
    attn = np.exp(logits - logits.max(-1, keepdims=True))
    attn = (attn / attn.sum(-1, keepdims=True)).reshape(q, heads, len(levels), points).astype(np.float32)
    return loc, attn


def bilinear(x, y, height, width):
    """device_utils.cuh's bilinear() in float32: (x0, y0, lx, ly, valid bits)."""
    h_im = np.float32(y) * np.float32(height) - np.float32(0.5)
    w_im = np.float32(x) * np.float32(width) - np.float32(0.5)
    inside = (h_im > -1) & (w_im > -1) & (h_im < height) & (w_im < width)
    yf, xf = np.floor(h_im), np.floor(w_im)
    y0, x0 = yf.astype(np.int64), xf.astype(np.int64)
    ly, lx = (h_im - yf).astype(np.float32), (w_im - xf).astype(np.float32)
    top, bottom, left, right = y0 >= 0, y0 + 1 < height, x0 >= 0, x0 + 1 < width
    valid = (top & left) * 1 | (top & right) * 2 | (bottom & left) * 4 | (bottom & right) * 8
    valid = np.where(inside, valid, 0)
    return x0, y0, lx, ly, valid


def corner_weights(lx, ly):
    one = np.float32(1)
    return np.stack([(one - ly) * (one - lx), (one - ly) * lx, ly * (one - lx), ly * lx], -1).astype(np.float32)


def emulate(levels, heads, channels, points, slots, row_bytes, loc, attn, grad_out, exact_order=True, gather=True,
            mma=None):
    """grad_value (float32) of one batch and the reduction counts (plain kernel, window kernel);
    gather=False: the plain kernel (every corner reduced directly); mma='partial' (the kernel's
    rule) or 'full' (all four corners in the level): the MMA kernel's accumulation window."""
    starts = np.concatenate([[0], np.cumsum([h * w for h, w in levels])[:-1]])
    keys = int(sum(h * w for h, w in levels))
    win_rows, win_cols = (MMA_WINDOW_SIDE, MMA_WINDOW_SIDE) if mma else window_shape(row_bytes)
    brows, bcols = block_shape(slots)
    grad = np.zeros((keys, heads, channels), np.float32)
    plain = gathered = 0
    per_level = np.zeros((len(levels), 2), np.int64)
    for head in range(heads):
        for qh, qw in levels:  # tiles: pixel blocks of every query level
            q0 = starts[levels.index((qh, qw))]
            for r0 in range(0, qh, brows):
                for c0 in range(0, qw, bcols):
                    slot_y = r0 + np.arange(slots) // bcols
                    slot_x = c0 + np.arange(slots) % bcols
                    present = (slot_y < qh) & (slot_x < qw)
                    query = np.where(present, q0 + slot_y * qw + slot_x, -1)
                    for level, (h, w) in enumerate(levels):
                        # stage point i = slot * points + point
                        q = np.repeat(query, points)
                        ok = q >= 0
                        qq = np.where(ok, q, 0)
                        pt = np.tile(np.arange(points), slots)
                        x = loc[qq, head, level, pt, 0]
                        y = loc[qq, head, level, pt, 1]
                        a = np.where(ok, attn[qq, head, level, pt], 0).astype(np.float32)
                        x0, y0, lx, ly, valid = bilinear(x, y, h, w)
                        valid = np.where(ok, valid, 0)
                        wts = (a[:, None] * corner_weights(lx, ly)).astype(np.float32)
                        # window placement and window points (produce_stage)
                        v = valid > 0
                        cell = np.full(q.shape, -1)
                        rows = 0
                        if v.any():
                            min_x, max_x = np.maximum(x0[v], 0).min(), np.minimum(x0[v] + 1, w - 1).max()
                            min_y, max_y = np.maximum(y0[v], 0).min(), np.minimum(y0[v] + 1, h - 1).max()
                            wx0 = min_x if max_x - min_x < win_cols else max(0, min(w - win_cols, (min_x + max_x + 1 - win_cols) // 2))
                            wy0 = min_y if max_y - min_y < win_rows else max(0, min(h - win_rows, (min_y + max_y + 1 - win_rows) // 2))
                            rows = min(win_rows, max_y - wy0 + 1)
                            cols = min(win_cols, w - wx0)
                            needed = valid if mma == "partial" else np.full_like(valid, 15)
                            held = corners_in_window(x0, y0, wx0, wy0, cols, rows)
                            inw = (valid > 0) & ((valid & needed) == needed) & ((held & needed) == needed)
                            bias = MMA_CELL_BIAS if mma else 0
                            cell = np.where(inw, (y0 - wy0) * win_cols + (x0 - wx0) + bias, -1)
                            if 4 * inw.sum() < rows * cols:
                                rows = 0
                        in_window = (cell >= 0) & (rows > 0) & gather
                        go_rows = grad_out[qq, head]  # [n, channels]
                        key = starts[level] + y0 * w + x0
                        offsets = (0, 1, w, w + 1)
                        # direct reductions: valid corners of the other points
                        for c in range(4):
                            m = ((valid >> c) & 1).astype(bool) & ~in_window
                            contrib = (wts[m, c][:, None] * go_rows[m]).astype(np.float32)
                            np.add.at(grad[:, head], key[m] + offsets[c], contrib)
                            plain_c = int((((valid >> c) & 1) > 0).sum())
                            plain += plain_c
                            gathered += int(m.sum())
                            per_level[level, 0] += plain_c
                            per_level[level, 1] += int(m.sum())
                        if not in_window.any():
                            continue
                        if mma:  # A^T x G: one fp32 sum per touched cell, of the level's corners only
                            sums = np.zeros((rows * win_cols, channels), np.float32)
                            for c in range(4):
                                m = in_window & ((valid >> c) & 1).astype(bool)
                                at = cell[m] - MMA_CELL_BIAS + (c & 1) + (win_cols if c & 2 else 0)
                                assert ((at >= 0) & (at < rows * win_cols) & (at % win_cols < cols)).all()
                                np.add.at(sums, at, (wts[m, c][:, None] * go_rows[m]).astype(np.float32))
                            touched = np.nonzero(np.any(sums != 0, axis=1))[0]
                            wy0_key = starts[level] + wy0 * w + wx0
                            grad[wy0_key + (touched // win_cols) * w + touched % win_cols, head] += sums[touched]
                            gathered += len(touched)
                            per_level[level, 1] += len(touched)
                            continue
                        # the index: counting sort of window corners by cell, stable in scan order
                        n = q.size
                        down = win_cols
                        if exact_order:
                            entries = []  # (cell, point, corner) in the producer's scatter order
                            for first in range(0, n, 32):
                                for c in range(4):
                                    for i in range(first, min(first + 32, n)):
                                        if in_window[i]:
                                            entries.append((cell[i] + (c & 1) + (down if c & 2 else 0), i, c))
                            cells_of = np.array([e[0] for e in entries])
                            order = np.argsort(cells_of, kind="stable")
                            touched, begin = np.unique(cells_of[order], return_index=True)
                            assert begin[0] == 0 and len(order) == 4 * in_window.sum()
                            assert 4 * n < (1 << 16) and touched.max() < win_rows * win_cols
                            ends = np.append(begin[1:], len(order))
                            wy0_key = starts[level] + wy0 * w + wx0
                            for t, b, e in zip(touched, begin, ends):
                                s = np.zeros(channels, np.float32)
                                for k in order[b:e]:
                                    _, i, c = entries[k]
                                    s = (s + wts[i, c] * go_rows[i]).astype(np.float32)  # fp32, index order
                                grad[wy0_key + (t // win_cols) * w + t % win_cols, head] += s
                            gathered += len(touched)
                            per_level[level, 1] += len(touched)
                        else:
                            cells_all = np.concatenate([cell[in_window] + off for off in (0, 1, down, down + 1)])
                            t = len(np.unique(cells_all))
                            gathered += t
                            per_level[level, 1] += t
    return grad, plain, gathered, per_level


def reference(levels, heads, channels, loc, attn, grad_out):
    """grad_value in float64, straight from the definition (zero padding outside the level)."""
    starts = np.concatenate([[0], np.cumsum([h * w for h, w in levels])[:-1]])
    keys = int(sum(h * w for h, w in levels))
    grad = np.zeros((keys, heads, channels))
    q_count, _, _, points, _ = loc.shape
    for level, (h, w) in enumerate(levels):
        x = loc[:, :, level, :, 0].astype(np.float64) * w - 0.5
        y = loc[:, :, level, :, 1].astype(np.float64) * h - 0.5
        x0, y0 = np.floor(x).astype(np.int64), np.floor(y).astype(np.int64)
        lx, ly = x - x0, y - y0
        a = attn[:, :, level].astype(np.float64)
        for dy in (0, 1):
            for dx in (0, 1):
                xx, yy = x0 + dx, y0 + dy
                wgt = a * (ly if dy else 1 - ly) * (lx if dx else 1 - lx)
                ok = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
                qi, hi, pi = np.nonzero(ok)
                contrib = wgt[qi, hi, pi][:, None] * grad_out[qi, hi].astype(np.float64)
                np.add.at(grad, (starts[level] + yy[qi, hi, pi] * w + xx[qi, hi, pi], hi), contrib)
    return grad


def check(levels, heads, channels, points, slots, row_bytes, seed, mma=None):
    """`row_bytes` sizes the window as the kernel's head row would (64: fp16 x 32 channels, a
    16 x 16 window; 128: fp32, 16 x 8; the MMA window is 16 x 16 for any); `channels` only sizes
    the emulated gradient rows."""
    rng = np.random.default_rng(seed)
    loc, attn = local_inputs(levels, heads, points, rng)
    q = loc.shape[0]
    loc[rng.random(loc.shape[:4]) < 0.05] += np.float32(0.3)  # some points near or past the edges
    grad_out = rng.standard_normal((q, heads, channels)).astype(np.float32)
    got, plain, gathered, _ = emulate(levels, heads, channels, points, slots, row_bytes, loc, attn, grad_out, mma=mma)
    direct = emulate(levels, heads, channels, points, slots, row_bytes, loc, attn, grad_out, gather=False)[0]
    want = reference(levels, heads, channels, loc, attn, grad_out)
    err, err_direct = (np.linalg.norm(g - want) / np.linalg.norm(want) for g in (got, direct))
    print(f"levels {levels} heads {heads} points {points} slots {slots} row {row_bytes} B: rel L2 {err:.2e} "
          f"(plain kernel {err_direct:.2e}), reductions {plain} -> {gathered} ({plain / max(gathered, 1):.2f}x)")
    assert err < 2e-6 and err < 2 * err_direct, (err, err_direct)


def stats(slots: int, element: int, heads: int = 2, mma=None):
    """Reduction counts of the bs 2 fp16 encoder (8 x 32 channels, 4 points) with the benchmark's
    'local' inputs; heads are alike, so two of them stand for eight."""
    levels = [(100, 152), (50, 76), (25, 38), (13, 19)]
    rng = np.random.default_rng(0)
    loc, attn = local_inputs(levels, heads, 4, rng)
    grad_out = np.ones((loc.shape[0], heads, 1), np.float32)  # nonzero: a touched cell's sum is not zero
    _, plain, gathered, per_level = emulate(levels, heads, 1, 4, slots, 32 * element, loc, attn, grad_out,
                                            exact_order=False, mma=mma)
    kind = f"MMA window ({mma})" if mma else f"{32 * element}-byte rows"
    print(f"encoder, slots {slots}, {kind}: reductions {plain} -> {gathered} ({plain / gathered:.2f}x fewer)")
    for level, (p, g) in enumerate(per_level):
        print(f"  sampled level {level}: {p} -> {g} ({p / g:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stats", action="store_true", help="only the encoder's reduction counts")
    args = parser.parse_args()
    if not args.stats:
        check([(9, 13), (5, 7), (3, 4)], heads=2, channels=8, points=4, slots=32, row_bytes=64, seed=1)
        check([(30, 44), (15, 22), (8, 11)], heads=1, channels=4, points=3, slots=64, row_bytes=64, seed=2)
        check([(17, 9), (8, 5), (1, 1)], heads=2, channels=4, points=2, slots=32, row_bytes=128, seed=3)
        check([(40, 33), (20, 17)], heads=1, channels=4, points=4, slots=32, row_bytes=128, seed=4)
        check([(9, 13), (5, 7), (3, 4)], heads=2, channels=8, points=4, slots=32, row_bytes=64, seed=1, mma="partial")
        check([(17, 9), (8, 5), (1, 1)], heads=2, channels=4, points=2, slots=32, row_bytes=128, seed=3, mma="partial")
    for slots in (32, 64):
        stats(slots, element=2)
    for rule in ("full", "partial"):
        stats(32, element=2, mma=rule)


if __name__ == "__main__":
    main()
