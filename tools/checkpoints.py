"""Lets torch >= 2.6 resume from mmengine 0.10 checkpoints.

torch 2.6 made `torch.load(weights_only=True)` the default; mmengine 0.10 pickles its message hub
(HistoryBuffer objects, numpy arrays and types rebuilt through `getattr`) into every checkpoint
and loads it without passing `weights_only`, so --resume fails. Allow-listing `getattr` would
open the safe unpickler as wide as turning it off, so these tools turn it off, for the
checkpoints a training run wrote itself. Set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=0 to keep it on.
"""

import os


def allow_mmengine_checkpoints() -> None:
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
