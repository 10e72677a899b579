"""What tools/train.py and tools/test.py share: launcher arguments, loading the config, building
the runner, and torch >= 2.6 checkpoints.

torch 2.6 made `torch.load(weights_only=True)` the default; mmengine 0.10 pickles its message hub
(HistoryBuffer objects, numpy arrays and types rebuilt through `getattr`) into every checkpoint
and loads it without passing `weights_only`, so --resume and testing fail. Allow-listing `getattr`
would open the safe unpickler as wide as turning it off, so these tools turn it off, for the
checkpoints a training run wrote itself. Set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=0 to keep it on.
"""

import os
import os.path as osp

from mmengine.config import Config
from mmengine.registry import RUNNERS
from mmengine.runner import Runner


def allow_mmengine_checkpoints() -> None:
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def load_config(args) -> Config:
    """The config with --cfg-options, the launcher and the work dir (CLI > config > ./work_dirs/<name>)."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(args.config))[0])
    return cfg


def add_launcher_args(parser) -> None:
    parser.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none", help="job launcher")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)


def parse_launcher_args(parser, argv=None):
    """Parse, and export LOCAL_RANK as torch.distributed.launch-style launchers expect."""
    args = parser.parse_args(argv)
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args


def build_runner(cfg: Config):
    return Runner.from_cfg(cfg) if "runner_type" not in cfg else RUNNERS.build(cfg)


def add_fast_args(parser) -> None:
    parser.add_argument(
        "--fast",
        action="store_true",
        help="the fast path: compiled network with CUDA graphs, fused optimizer, image-size buckets "
        "(mmdeform_tma/integrations/fast_training.py)",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="with --fast: torch.compile mode (reduce-overhead = with CUDA graphs, the default; "
        "default = without; max-autotune-no-cudagraphs)",
    )
    parser.add_argument(
        "--compile-scope",
        default=None,
        help="with --fast: what is compiled (network+decoder = the transformer layers, backbone and neck, "
        "and Deformable DETR's / DINO's decoder as one graph, the default; network = the same with the "
        "decoder per layer; layers = the transformer layers only)",
    )
    parser.add_argument("--bucket-step", type=int, default=None, help="with --fast: pad images to multiples of this")
    parser.add_argument(
        "--gc-freeze-after",
        type=int,
        default=None,
        help="with --fast: freeze the heap (gc.freeze) after this many training iterations, so that Python's "
        "full collections stop walking the model and the compiled graphs (default 20; 0 = never)",
    )
    parser.add_argument(
        "--mmdet-targets",
        action="store_true",
        default=None,
        help="with --fast: keep mmdet's per-image Hungarian matching and targets instead of the batched ones "
        "(mmdeform_tma/integrations/batched_targets.py; the same targets, fewer launches and host waits)",
    )


def apply_fast_args(cfg: Config, args) -> None:
    if not args.fast:
        fast_only = (
            args.compile_mode,
            args.compile_scope,
            args.bucket_step,
            getattr(args, "gc_freeze_after", None),
            getattr(args, "mmdet_targets", None),
        )
        if any(value is not None for value in fast_only):
            raise SystemExit(
                "--compile-mode, --compile-scope, --bucket-step, --gc-freeze-after and --mmdet-targets go with --fast"
            )
        return
    from mmdeform_tma.integrations import fast_training

    fast_training.fast_training_config(
        cfg,
        compile_mode=args.compile_mode or fast_training.DEFAULT_COMPILE_MODE,
        compile_scope=args.compile_scope or fast_training.DEFAULT_COMPILE_SCOPE,
        bucket_step=args.bucket_step or fast_training.DEFAULT_BUCKET_STEP,
        gc_freeze_after=gc_freeze_after(args, fast_training.DEFAULT_GC_FREEZE_AFTER),
        batched_targets=not getattr(args, "mmdet_targets", None),
    )


def gc_freeze_after(args, default: int) -> int | None:
    """--gc-freeze-after as `fast_training_config` takes it: 0 means never (None)."""
    value = getattr(args, "gc_freeze_after", None)
    if value is None:
        return default
    if value < 0:
        raise SystemExit(f"--gc-freeze-after must be 0 (never) or a positive number of iterations, got {value}")
    return value or None
