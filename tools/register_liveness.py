"""Where a kernel's registers go: live GPRs per instruction and its spill instructions, on the CPU.

    python tools/register_liveness.py --sources mmdeform_tma/csrc/hopper/window_backward.cu \\
        --kernel 'halfLi16.*AggregationE2ELi4ELb1E' --regions 60 --min-live 85

PTXAS says how many registers a kernel takes and whether it spills, not where: nvdisasm's register
life ranges (`-lrm count`) give the number of live registers at every instruction of the sm cubin
this checkout's flags build (kernel_code_diff.compile_cubin), and its listing shows each spill
(`STL`, `LDL`) in place. A spill of a value the loops never use, reloaded once per stage, costs
nothing; one inside a point loop does. In session 49 this showed a register cache loaded under a
condition kept live around a whole stage loop (perf_notes.md, item 114).

nvdisasm is not in the CUDA compiler packages; `pip download nvidia-cuda-nvdisasm` has it (name its
folder with --nvdisasm or put it on PATH). Exits 1 when a source fails to compile or nvdisasm is missing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_code_diff  # noqa: E402
import resource_report  # noqa: E402

ROOT = resource_report.ROOT

# A function's header line in nvdisasm's listing, and one instruction with its life-range column
# (`-lrm count`): `/*0120*/  OPCODE operands ;  // |  93 | ...`.
FUNCTION = re.compile(r"^//-+ \.text\.(\S+) -+")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;.*?//\s*\|\s*(\d+)\s*\|")
SPILL = re.compile(r"(?:^|\s)(STL|LDL)(?:\.\w+)*\s")


@dataclass
class Instruction:
    address: int
    text: str
    live: int  # general-purpose registers live at this instruction


@dataclass
class Kernel:
    symbol: str
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def peak(self) -> Instruction:
        return max(self.instructions, key=lambda i: i.live)

    @property
    def spills(self) -> list[Instruction]:
        return [i for i in self.instructions if SPILL.search(f" {i.text} ")]

    def regions(self, size: int) -> list[tuple[Instruction, Instruction]]:
        """(first instruction, busiest instruction) of each run of `size` instructions."""
        runs = [self.instructions[i : i + size] for i in range(0, len(self.instructions), size)]
        return [(run[0], max(run, key=lambda i: i.live)) for run in runs]


def parse_liveness(listing: str) -> list[Kernel]:
    """Kernels of an `nvdisasm -lrm count` listing, in order, each with its instructions."""
    kernels: list[Kernel] = []
    for line in listing.splitlines():
        if m := FUNCTION.match(line):
            kernels.append(Kernel(m[1]))
        elif kernels and (m := INSTRUCTION.match(line)):
            kernels[-1].instructions.append(Instruction(int(m[1], 16), " ".join(m[2].split()), int(m[3])))
    return [k for k in kernels if k.instructions]


def find_nvdisasm(folder: Path | None) -> str | None:
    if folder is not None:
        candidate = folder / "nvdisasm"
        return str(candidate) if candidate.exists() else None
    return shutil.which("nvdisasm")


def report(kernels: list[Kernel], pattern: str, regions: int, min_live: int) -> list[str]:
    selected = [k for k in kernels if re.search(pattern, k.symbol)]
    names = dict(zip([k.symbol for k in selected], resource_report.demangle([k.symbol for k in selected])))
    lines = []
    for kernel in selected:
        peak, spills = kernel.peak, kernel.spills
        lines.append(f"{resource_report.shorten(names[kernel.symbol], 150)}")
        lines.append(f"  {len(kernel.instructions)} instructions; peak {peak.live} live registers at "
                     f"{peak.address:#x} ({peak.text}); {len(spills)} spill instructions")
        for spill in spills:
            lines.append(f"  spill {spill.address:#x}: {spill.text} ({spill.live} live)")
        if regions:
            for first, busiest in kernel.regions(regions):
                if busiest.live >= min_live:
                    lines.append(f"  from {first.address:#7x}: peak {busiest.live} at {busiest.address:#x} ({busiest.text})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", nargs="+", type=Path, required=True, help="CUDA sources relative to this checkout")
    p.add_argument("--kernel", default=".", help="regular expression over the mangled kernel names")
    p.add_argument("--regions", type=int, default=0, help="also show the peak of every run of this many instructions")
    p.add_argument("--min-live", type=int, default=0, help="with --regions: only runs whose peak reaches this")
    p.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST-style (9.0 builds sm_90a)")
    p.add_argument("--nvdisasm", type=Path, help="the folder holding nvdisasm (default: PATH)")
    args = p.parse_args(argv)
    nvdisasm = find_nvdisasm(args.nvdisasm)
    if nvdisasm is None:
        print("nvdisasm not found: `pip download nvidia-cuda-nvdisasm` has it; name its folder with --nvdisasm",
              file=sys.stderr)
        return 1
    setup = resource_report.load_setup_module()
    failed = False
    for source in args.sources:
        try:
            cubin = kernel_code_diff.compile_cubin(ROOT, source, args.arch, setup)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            failed = True
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernels.cubin"
            path.write_bytes(cubin)
            listing = subprocess.run([nvdisasm, "-lrm", "count", "-c", str(path)], capture_output=True, text=True, check=True)
        print(f"{source}:")
        for line in report(parse_liveness(listing.stdout), args.kernel, args.regions, args.min_live):
            print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
