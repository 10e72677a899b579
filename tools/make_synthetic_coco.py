"""Write a small COCO-format detection set that needs no download.

    python tools/make_synthetic_coco.py                      # data/synthetic_coco, 400 train / 100 val
    python tools/make_synthetic_coco.py --out /tmp/s --num-train 16 --num-val 4 --size 128

Each image is a textured background (smooth colour gradient, blotches and noise) with 1-6
coloured circles, squares and triangles of varied size; their boxes and classes are the labels.
The layout matches configs/_base_/datasets/synthetic_coco.py: <out>/{train,val}/*.jpg and
<out>/annotations/instances_{train,val}.json. Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import cv2
import numpy as np

CLASSES = ("circle", "square", "triangle")


def background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    c0, c1 = rng.uniform(40, 215, size=3), rng.uniform(40, 215, size=3)
    angle = rng.uniform(0, 2 * math.pi)
    t = ((x * math.cos(angle) + y * math.sin(angle)) / max(height, width) + 1) / 2
    img = c0[None, None] * (1 - t[..., None]) + c1[None, None] * t[..., None]
    for _ in range(rng.integers(3, 9)):  # soft blotches
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.05, 0.3) * max(height, width)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        img += blob[..., None] * rng.uniform(-50, 50, size=3)
    img += rng.normal(0, 8, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def draw_object(rng: np.random.Generator, img: np.ndarray, category: int) -> list[float] | None:
    height, width = img.shape[:2]
    size = rng.uniform(0.08, 0.35) * min(height, width)
    cx, cy = rng.uniform(size / 2, width - size / 2), rng.uniform(size / 2, height - size / 2)
    color = tuple(int(c) for c in rng.integers(0, 256, size=3))
    if category == 0:
        cv2.circle(img, (int(cx), int(cy)), int(size / 2), color, -1, lineType=cv2.LINE_AA)
        x0, y0, x1, y1 = cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2
    elif category == 1:
        angle = rng.uniform(0, 90)
        box = cv2.boxPoints(((cx, cy), (size, size), angle))
        cv2.fillPoly(img, [box.astype(np.int32)], color, lineType=cv2.LINE_AA)
        x0, y0 = box.min(0)
        x1, y1 = box.max(0)
    else:
        angle = rng.uniform(0, 2 * math.pi)
        points = np.array(
            [(cx + size / 2 * math.cos(angle + k * 2 * math.pi / 3), cy + size / 2 * math.sin(angle + k * 2 * math.pi / 3)) for k in range(3)]
        )
        cv2.fillPoly(img, [points.astype(np.int32)], color, lineType=cv2.LINE_AA)
        x0, y0 = points.min(0)
        x1, y1 = points.max(0)
    x0, y0, x1, y1 = max(0.0, x0), max(0.0, y0), min(float(width), x1), min(float(height), y1)
    if x1 - x0 < 2 or y1 - y0 < 2:
        return None
    return [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]


def write_split(out: Path, split: str, count: int, size: int, rng: np.random.Generator, first_id: int) -> dict:
    (out / split).mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(count):
        image_id = first_id + i
        height = size
        width = int(size * rng.choice([1.0, 1.25, 1.5]))
        img = background(rng, height, width)
        for category in rng.integers(0, len(CLASSES), size=rng.integers(1, 7)):
            box = draw_object(rng, img, int(category))
            if box is not None:
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "category_id": int(category) + 1,
                        "bbox": [round(v, 2) for v in box],
                        "area": round(box[2] * box[3], 2),
                        "iscrowd": 0,
                    }
                )
        name = f"{image_id:06d}.jpg"
        cv2.imwrite(str(out / split / name), img, [cv2.IMWRITE_JPEG_QUALITY, 92])
        images.append({"id": image_id, "file_name": name, "height": height, "width": width})
    return {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": k + 1, "name": name, "supercategory": "shape"} for k, name in enumerate(CLASSES)],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("data/synthetic_coco"))
    p.add_argument("--num-train", type=int, default=400)
    p.add_argument("--num-val", type=int, default=100)
    p.add_argument("--size", type=int, default=320, help="image height in pixels (width 1-1.5x)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    (args.out / "annotations").mkdir(parents=True, exist_ok=True)
    for split, count, first in (("train", args.num_train, 1), ("val", args.num_val, 1 + args.num_train)):
        coco = write_split(args.out, split, count, args.size, rng, first)
        (args.out / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
        print(f"{split}: {len(coco['images'])} images, {len(coco['annotations'])} objects")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
