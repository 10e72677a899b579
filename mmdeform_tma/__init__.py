"""mmdeform_tma: multi-scale deformable attention for Hopper GPUs, as backends of mmcv's op.

Importing it registers the `mmdeform_tma::` ops and, when mmcv is installed, lets mmcv's
`MultiScaleDeformableAttention` take `backend=`. Importing never touches a GPU.
"""

from . import library  # noqa: F401  (registers the ops' CPU, fake and autograd kernels)
from ._extension import build_info
from .dispatch import BACKEND_CHOICES, BackendUnavailableError, available_backends, get_backend, select_backend
from .functional import multi_scale_deformable_attn
from .inputs import set_strict_validation, strict_validation, strict_validation_enabled
from .integrations import mmcv as _mmcv_integration
from .version import __version__

_mmcv_integration.install_if_available()

__all__ = [
    "BACKEND_CHOICES",
    "BackendUnavailableError",
    "__version__",
    "available_backends",
    "build_info",
    "get_backend",
    "multi_scale_deformable_attn",
    "select_backend",
    "set_strict_validation",
    "strict_validation",
    "strict_validation_enabled",
]
