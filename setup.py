"""Build script for mmdeform_tma and its extension ``mmdeform_tma._C``.

The extension always holds the operator schema (``csrc/ops.cpp``). The CUDA kernels are compiled
when a CUDA toolkit and a CUDA-enabled torch are present, or when ``FORCE_CUDA=1``. Environment:

    TORCH_CUDA_ARCH_LIST  architectures to build, e.g. "8.0;9.0". 9.0 is built as sm_90a, the
                          target the Hopper-only (TMA) kernels need. Archs below 8.0 are dropped.
    FORCE_CUDA=1          build the CUDA kernels even without a CUDA-enabled torch / visible GPU.
    MAX_JOBS              parallel compile jobs (ninja).
    MMDEFORM_TMA_PTXAS_VERBOSE=1   print the ptxas resource report of every kernel.

Install with ``pip install -e . --no-build-isolation`` into an environment that already has torch.
"""

import os
import re
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - only reached in a misconfigured build
    sys.exit(
        "mmdeform_tma: torch must be installed before building. Install torch, then run "
        "`pip install -e . --no-build-isolation` (build isolation would hide your torch)."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("mmdeform_tma", "csrc")
MIN_ARCH = (8, 0)
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0"


def read_version() -> str:
    with open(os.path.join(ROOT, "mmdeform_tma", "version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def cuda_build_decision() -> tuple[bool, str]:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True, "FORCE_CUDA=1"
    if cpp_extension.CUDA_HOME is None:
        return False, "no CUDA toolkit found (set CUDA_HOME or install nvcc)"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    return True, f"CUDA toolkit at {cpp_extension.CUDA_HOME} and torch built with CUDA {torch.version.cuda}"


def requested_arch_list() -> str:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
    return DEFAULT_ARCH_LIST


def gencode_flags(arch_list: str) -> tuple[list[str], list[str]]:
    """Turn TORCH_CUDA_ARCH_LIST into -gencode flags; returns (flags, arch names)."""
    flags, names = [], []
    for item in re.split(r"[;,\s]+", arch_list.strip()):
        if not item:
            continue
        match = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", item)
        if not match:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {item!r} is not of the form 8.0, 9.0a or 9.0+PTX")
        major, minor, suffix, ptx = int(match[1]), int(match[2]), match[3], match[4]
        if (major, minor) < MIN_ARCH:
            print(f"mmdeform_tma: dropping arch {item}: the kernels need sm_80 or newer")
            continue
        if (major, minor) == (9, 0):
            suffix = "a"  # TMA, mbarrier tx-counts and setmaxnreg live in sm_90a
        arch = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        names.append(f"sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
            names.append(f"compute_{arch}")
    if not names:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={arch_list!r} leaves no architecture of sm_80 or newer")
    return flags, names


NVCC_FLAGS = [
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def cuda_defines(arch_names: list[str]) -> list[str]:
    return [
        "-DMMDEFORM_TMA_WITH_CUDA=1",
        f"-DMMDEFORM_TMA_CUDA_ARCHS={','.join(arch_names)}",  # stringified in ops.cpp: no shell quoting
        f"-DMMDEFORM_TMA_WITH_HOPPER={int('sm_90a' in arch_names)}",
    ]


def source_files(*subdirs: str, suffixes=(".cpp", ".cu")) -> list[str]:
    files = []
    for sub in subdirs:
        folder = os.path.join(CSRC, sub)
        files += sorted(
            os.path.join(folder, name) for name in os.listdir(os.path.join(ROOT, folder)) if name.endswith(suffixes)
        )
    return files


def make_extension():
    with_cuda, why = cuda_build_decision()
    cxx_flags = ["-O3"]  # BuildExtension adds the C++ standard this torch needs
    sources = [os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "autograd.cpp"), *source_files("common", suffixes=(".cpp",))]
    config = {
        "torch": torch.__version__,
        "CUDA kernels": f"{'yes' if with_cuda else 'no'} ({why})",
        "MAX_JOBS": os.environ.get("MAX_JOBS", "(ninja default)"),
    }
    if not with_cuda:
        ext = cpp_extension.CppExtension("mmdeform_tma._C", sources, extra_compile_args={"cxx": cxx_flags})
        return ext, config

    arch_list = requested_arch_list()
    flags, names = gencode_flags(arch_list)
    with_hopper = "sm_90a" in names
    defines = cuda_defines(names)
    nvcc_flags = [*NVCC_FLAGS, *flags, *defines]
    if os.environ.get("MMDEFORM_TMA_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    sources += source_files("common", suffixes=(".cu",)) + source_files("cuda", "hopper")
    config.update(
        {
            "TORCH_CUDA_ARCH_LIST": arch_list,
            "targets": " ".join(names),
            "Hopper (tma_ws) kernels": "yes (sm_90a)" if with_hopper else "no (9.0 not in TORCH_CUDA_ARCH_LIST)",
        }
    )
    ext = cpp_extension.CUDAExtension(
        "mmdeform_tma._C",
        sources,
        extra_compile_args={"cxx": cxx_flags + defines, "nvcc": nvcc_flags},
    )
    return ext, config


def main():
    if not cpp_extension.is_ninja_available():
        sys.exit("mmdeform_tma: ninja is required to build the extension: `pip install ninja`")
    ext, config = make_extension()
    width = max(map(len, config))
    print("mmdeform_tma build configuration:")
    for key, value in config.items():
        print(f"  {key:<{width}} : {value}")
    setup(
        name="mmdeform_tma",
        version=read_version(),
        description="Multi-Scale Deformable Attention for Hopper GPUs (TMA, warp-specialised), plugged into OpenMMLab",
        packages=find_packages(include=["mmdeform_tma", "mmdeform_tma.*"]),
        package_data={"mmdeform_tma": ["tuning_tables/*.json"]},
        python_requires=">=3.10",
        install_requires=["torch>=2.4"],
        ext_modules=[ext],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
