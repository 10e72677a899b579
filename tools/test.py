"""Evaluate a detector checkpoint, as mmdet's tools/test.py does, with mmdeform_tma's kernels.

    python tools/test.py configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py work_dirs/.../epoch_12.pth
    python tools/test.py CONFIG CHECKPOINT --fast      # compiled transformer layers, as tools/train.py --fast
"""

import argparse

from mmengine.config import DictAction

import mmdeform_tma  # noqa: F401  (MultiScaleDeformableAttention takes backend=; honours MMDEFORM_TMA_BACKEND)
from runner_setup import (
    add_fast_args,
    add_launcher_args,
    allow_mmengine_checkpoints,
    apply_fast_args,
    build_runner,
    load_config,
    parse_launcher_args,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Test (and evaluate) a detector")
    parser.add_argument("config", help="test config file path")
    parser.add_argument("checkpoint", help="checkpoint file")
    parser.add_argument("--work-dir", help="the directory to save the evaluation metrics")
    parser.add_argument("--out", type=str, help="dump predictions to a pickle file for offline evaluation")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction, help="override config settings, key=value")
    add_fast_args(parser)
    add_launcher_args(parser)
    return parse_launcher_args(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    allow_mmengine_checkpoints()
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    apply_fast_args(cfg, args)
    if args.out is not None:
        assert args.out.endswith((".pkl", ".pickle")), "--out must be a .pkl file"
        cfg.test_evaluator = [cfg.test_evaluator] if not isinstance(cfg.test_evaluator, list) else cfg.test_evaluator
        cfg.test_evaluator.append(dict(type="DumpDetResults", out_file_path=args.out))
    runner = build_runner(cfg)
    runner.test()


if __name__ == "__main__":
    main()
