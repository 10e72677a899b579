"""The dispatch path on CUDA-like inputs, on a machine without a GPU.

FakeTensors on `cuda:0` carry shapes, dtypes and devices but no data, so the public call runs its
whole host side (signature, validation, selection, tuning, the op's C++ autograd and fake kernel)
as on a GPU. `pretend_gpu` makes the build and the device answer like a CUDA build on a given GPU;
`NoHostSync` fails on every host read of device data, which on a GPU is a synchronisation.

FakeTensors on CUDA cannot go through autograd here (a CPU-only torch aborts when an autograd node
asks for a CUDA stream): tests keep them free of requires_grad when they reach an op.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmdeform_tma import _extension, dispatch

CUDA = torch.device("cuda", 0)
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))


def pretend_gpu(monkeypatch, gpu=H100) -> None:
    """The extension claims CUDA and Hopper kernels for every GPU, and cuda:N is `gpu` (name, capability)."""
    monkeypatch.setattr(_extension, "build_reasons", lambda needs_hopper: ())
    monkeypatch.setattr(_extension, "device_reason", lambda major, minor: "")
    monkeypatch.setattr(_extension, "_gpu", lambda index: gpu)
    dispatch.clear_caches()


class HostSync(AssertionError):
    """Device data was read on the host."""


class NoHostSync(TorchDispatchMode):
    """Raises on any op that brings data of a non-CPU tensor to the host: `item`, `tolist`, `bool`,
    `.cpu()`, a device-to-host copy. On a GPU each of them waits for the device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        if on_device and func is torch.ops.aten._local_scalar_dense.default:
            raise HostSync(f"{func} reads a {on_device[0].device} tensor on the host")
        out = func(*args, **kwargs)
        if on_device and any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves(out)):
            raise HostSync(f"{func} copies a {on_device[0].device} tensor to the host")
        return out


@contextlib.contextmanager
def cuda_like():
    """FakeTensorMode for CUDA-like tensors (real CPU tensors may join), watched by NoHostSync."""
    with FakeTensorMode(allow_non_fake_inputs=True), NoHostSync():
        yield


def on_cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Fake CUDA tensors like `tensors` (call inside `cuda_like`)."""
    return [torch.empty(t.shape, dtype=t.dtype, device=CUDA) for t in tensors]
