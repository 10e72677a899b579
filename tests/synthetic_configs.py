"""Paths of the repository's synthetic-set configs that the integration and tool tests build."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/synthetic/deformable-detr_tiny_synthetic_cpu.py")  # a small Deformable DETR for the CPU
DETR_R50 = str(ROOT / "configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py")
DINO = str(ROOT / "configs/synthetic/dino-4scale_r50_synthetic_tma-ws.py")
