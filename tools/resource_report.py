"""Compile every CUDA source with `ptxas -v` and print each kernel's registers, shared memory,
stack frame and spills. Needs nvcc and torch's headers, not a GPU.

    python tools/resource_report.py                       # sm_90a, all sources
    python tools/resource_report.py --arch 8.0 --markdown docs/resources_sm80.md
    python tools/resource_report.py --from-log gpu_out/ptxas.log   # a build's own -Xptxas -v output

Exits 1 when any kernel spills (the project's rule is zero spills).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cuda_home() -> Path:
    """The toolkit folder; CPU-only torch builds do not look for one, so search here."""
    from torch.utils import cpp_extension

    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return Path(candidate)
    raise SystemExit("no CUDA toolkit found: set CUDA_HOME")
CSRC = ROOT / "mmdeform_tma" / "csrc"


def load_setup_module():
    spec = importlib.util.spec_from_file_location("mmdeform_tma_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class KernelResources:
    source: str
    arch: str
    kernel: str
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def parse_ptxas(source: str, text: str) -> list[KernelResources]:
    kernels: list[KernelResources] = []
    current = None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            current = KernelResources(source=source, arch=m[2], kernel=m[1])
            kernels.append(current)
        elif current and (m := FRAME.search(line)):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current and (m := USED.search(line)):
            current.registers = int(m[1])
            current.shared_bytes = int(m[2] or 0)
    for kernel, name in zip(kernels, demangle([k.kernel for k in kernels])):
        kernel.kernel = name
    return kernels


def cpu_torch_shim(folder: Path) -> list[str]:
    """A CPU-only torch wheel lacks c10's generated CUDA config header; supply the one-line
    equivalent so the kernels can still be compiled (not linked) against its headers."""
    from torch.utils import cpp_extension

    generated = "c10/cuda/impl/cuda_cmake_macros.h"
    if any((Path(p) / generated).exists() for p in cpp_extension.include_paths()):
        return []
    (folder / generated).parent.mkdir(parents=True, exist_ok=True)
    (folder / generated).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [str(folder)]


def compile_command(source: Path, gencode: list[str], setup, shim: list[str]) -> list[str]:
    from torch.utils import cpp_extension

    home = cuda_home()
    includes = [*cpp_extension.include_paths(), *shim, str(home / "include"), sysconfig.get_paths()["include"], str(CSRC)]
    arch_names = [flag.split("code=")[1] for flag in gencode]
    return [
        str(home / "bin" / "nvcc"),
        "-c",
        str(source),
        "-o",
        os.devnull,
        *setup.NVCC_FLAGS,
        "-std=c++17",  # what torch 2.11 (the GPU machine's) passes nvcc: the oldest standard the sources must build with
        *setup.cuda_defines(arch_names),
        *gencode,
        "-Xptxas=-v",
        "-DTORCH_EXTENSION_NAME=_C",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        *[f"-I{path}" for path in includes],
    ]


def compile_one(source: Path, gencode: list[str], setup) -> tuple[Path, list[KernelResources], str]:
    with tempfile.TemporaryDirectory() as tmp:
        command = compile_command(source, gencode, setup, cpu_torch_shim(Path(tmp)))
        result = subprocess.run(command, capture_output=True, text=True)
    text = result.stdout + result.stderr
    if result.returncode != 0:
        return source, [], text
    return source, parse_ptxas(source.name, text), ""


def shorten(name: str, width: int) -> str:
    name = name.replace("mmdeform_tma::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST-style list (9.0 builds sm_90a)")
    parser.add_argument("--sources", nargs="*", help="only these .cu files (default: all)")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--from-log", type=Path, help="parse this ptxas -v output (MMDEFORM_TMA_PTXAS_VERBOSE=1 build) instead")
    args = parser.parse_args(argv)

    results: list[KernelResources] = []
    failed = False
    if args.from_log:
        results = parse_ptxas(args.from_log.name, args.from_log.read_text())
    else:
        setup = load_setup_module()
        gencode, _ = setup.gencode_flags(args.arch)
        sources = [Path(s).resolve() for s in args.sources] if args.sources else sorted(CSRC.rglob("*.cu"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for source, kernels, error in pool.map(lambda s: compile_one(s, gencode, setup), sources):
                if error:
                    failed = True
                    print(f"--- {source.relative_to(ROOT)} failed to compile:\n{error}", file=sys.stderr)
                results.extend(kernels)

    rows = [
        (k.source, k.arch, shorten(k.kernel, 110), k.registers, k.shared_bytes, k.stack_bytes, k.spill_stores, k.spill_loads)
        for k in results
    ]
    header = ("source", "arch", "kernel", "regs", "smem B", "stack B", "spill st B", "spill ld B")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
    spills = [k for k in results if k.spill_stores or k.spill_loads]
    print(f"\n{len(results)} kernels, {len(spills)} with spills")
    if args.markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in rows]
        args.markdown.write_text("\n".join(lines) + "\n")
    return 1 if (spills or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
