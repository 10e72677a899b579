"""Train a detector, as mmdet's tools/train.py does, with mmdeform_tma's kernels available.

    python tools/train.py configs/synthetic/deformable-detr_r50_synthetic_tma-ws.py
    python tools/train.py CONFIG --amp bf16 --cfg-options model.encoder.layer_cfg.self_attn_cfg.backend=cuda
    MMDEFORM_TMA_BACKEND=cuda python tools/train.py CONFIG      # one kernel for every MSDA module

`--amp` takes fp16 (the default when given bare) or bf16. Multi-GPU: tools/dist_train.sh.
`--fast` switches on the fast training path (mmdeform_tma/integrations/fast_training.py): compiled
transformer layers, the fused optimizer and image-size buckets.
"""

import argparse

from mmengine.config import Config, DictAction

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
    parser = argparse.ArgumentParser(description="Train a detector")
    parser.add_argument("config", help="train config file path")
    parser.add_argument("--work-dir", help="the dir to save logs and models")
    parser.add_argument(
        "--amp",
        nargs="?",
        const="fp16",
        choices=["fp16", "bf16"],
        help="automatic mixed precision; bare --amp means fp16",
    )
    add_fast_args(parser)
    parser.add_argument("--auto-scale-lr", action="store_true", help="enable automatically scaling LR")
    parser.add_argument(
        "--resume",
        nargs="?",
        type=str,
        const="auto",
        help="resume from this checkpoint, or bare: from the latest one in the work dir",
    )
    parser.add_argument(
        "--cfg-options",
        nargs="+",
        action=DictAction,
        help="override config settings, key=value (e.g. model.encoder.layer_cfg.self_attn_cfg.backend=tma_ws)",
    )
    add_launcher_args(parser)
    return parse_launcher_args(parser, argv)


def build_config(args) -> Config:
    cfg = load_config(args)
    if args.amp:
        cfg.optim_wrapper.type = "AmpOptimWrapper"
        cfg.optim_wrapper.loss_scale = "dynamic"
        cfg.optim_wrapper.dtype = {"fp16": "float16", "bf16": "bfloat16"}[args.amp]
    apply_fast_args(cfg, args)
    if args.auto_scale_lr:
        if "auto_scale_lr" in cfg and "base_batch_size" in cfg.auto_scale_lr:
            cfg.auto_scale_lr.enable = True
        else:
            raise RuntimeError('the config has no "auto_scale_lr.base_batch_size" to scale the LR with')
    if args.resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def main(argv=None):
    args = parse_args(argv)
    allow_mmengine_checkpoints()
    from mmdet.utils import setup_cache_size_limit_of_dynamo

    setup_cache_size_limit_of_dynamo()
    cfg = build_config(args)
    runner = build_runner(cfg)
    runner.train()


if __name__ == "__main__":
    main()
