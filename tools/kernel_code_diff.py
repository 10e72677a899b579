"""Which kernels a change touched: compile two source trees and compare each kernel's machine code.

    python tools/kernel_code_diff.py 5f324d4                    # a revision against the checkout
    python tools/kernel_code_diff.py /tmp/old_tree /tmp/new_tree --sources mmdeform_tma/csrc/hopper/window_backward.cu

CPU only: nvcc compiles each CUDA source of both trees to a cubin (the flags of
tools/resource_report.py, for --arch), and every kernel's .text section is compared byte for byte.
A kernel whose code is identical keeps every measurement of the older tree, so a change meant for a
few kernels can show that device results of the rest carry over (perf_notes.md, session 24). OLD
may be a directory or a git revision (exported with `git archive`); NEW defaults to this checkout.
Both trees compile with this checkout's flags. A kernel that gained template arguments (a template
parameter added with a default) is compared with the kernel it was, matched by its demangled name.
Exits 1 when a source fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resource_report  # noqa: E402

ROOT = resource_report.ROOT
CSRC_RELATIVE = resource_report.CSRC.relative_to(ROOT)

# nvcc names an anonymous namespace after its file's path and a hash: the same kernel compiled from
# two trees gets two names.
ANONYMOUS_NAMESPACE = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")


def normalized(symbol: str) -> str:
    return ANONYMOUS_NAMESPACE.sub("(anonymous)", symbol)


def text_sections(elf: bytes) -> dict[str, bytes]:
    """The `.text.<kernel>` sections of a 64-bit little-endian ELF (a cubin), by kernel symbol."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (section_offset,) = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, section_offset + i * entry_size) for i in range(count)]
    names_offset = headers[names_index][4]
    sections = {}
    for name_at, _, _, _, offset, size, *_ in headers:
        start = names_offset + name_at
        name = elf[start : elf.index(b"\0", start)].decode()
        if name.startswith(".text."):
            sections[name[len(".text.") :]] = elf[offset : offset + size]
    return sections


def compile_cubin(tree: Path, source: Path, arch: str, setup) -> bytes:
    """`source` (relative to the tree) as an sm cubin, with this checkout's flags and the tree's headers."""
    gencode, _ = setup.gencode_flags(arch)
    with tempfile.TemporaryDirectory() as tmp:
        command = resource_report.compile_command(tree / source, gencode, setup, resource_report.cpu_torch_shim(Path(tmp)))
        command = [f"-I{tree / CSRC_RELATIVE}" if part == f"-I{resource_report.CSRC}" else part for part in command]
        cubin = Path(tmp) / "kernels.cubin"
        command[command.index("-c")] = "-cubin"
        command[command.index(os.devnull)] = str(cubin)
        command.remove("-Xptxas=-v")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{tree / source} failed to compile:\n{result.stdout}{result.stderr}")
        return cubin.read_bytes()


@dataclass
class Comparison:
    identical: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)


def compare(old: dict[str, bytes], new: dict[str, bytes]) -> Comparison:
    old = {normalized(k): v for k, v in old.items()}
    new = {normalized(k): v for k, v in new.items()}
    result = Comparison()
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            result.only_old.append(name)
        elif name not in old:
            result.only_new.append(name)
        else:
            (result.identical if old[name] == new[name] else result.changed).append(name)
    return result


def split_kernel_name(demangled: str) -> tuple[str, list[str], str] | None:
    """'void ns::k<A, B<C, D> >(P)' -> ('void ns::k', ['A', 'B<C, D>'], '(P)'); None without a
    template argument list right before the parameters."""
    if not demangled.endswith(")"):
        return None
    depth, start = 0, None
    for i in range(len(demangled) - 1, -1, -1):  # the parameters' opening parenthesis
        depth += {")": 1, "(": -1}.get(demangled[i], 0)
        if depth == 0:
            start = i
            break
    if not start or demangled[start - 1] != ">":
        return None
    depth, args, arg_start = 0, [], start - 1
    for i in range(start - 1, -1, -1):  # the template arguments, split at their top-level commas
        c = demangled[i]
        if c == ">":
            depth += 1
            if depth == 1:
                arg_start = i
                continue
        elif c == "<":
            depth -= 1
            if depth == 0:
                args.insert(0, demangled[i + 1 : arg_start].strip())
                return demangled[:i], args, demangled[start:]
        elif c == "," and depth == 1:
            args.insert(0, demangled[i + 1 : arg_start].strip())
            arg_start = i
    return None


def renamed_pairs(only_old: dict[str, str], only_new: dict[str, str]) -> list[tuple[str, str]]:
    """(old, new) symbol pairs, from {symbol: demangled name}, where the new kernel is the old one with
    template arguments appended (a template parameter added with a default): same name, same
    parameters, the old arguments first."""
    pairs = []
    for old_symbol, old_name in only_old.items():
        old_parts = split_kernel_name(old_name)
        if old_parts is None:
            continue
        for new_symbol, new_name in only_new.items():
            new_parts = split_kernel_name(new_name)
            if (new_parts is not None and new_parts[0] == old_parts[0] and new_parts[2] == old_parts[2]
                    and len(new_parts[1]) > len(old_parts[1]) and new_parts[1][: len(old_parts[1])] == old_parts[1]):
                pairs.append((old_symbol, new_symbol))
                break
    return pairs


def exported(revision: str, folder: Path) -> Path:
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="a source tree, or a git revision of this checkout")
    p.add_argument("new", nargs="?", type=Path, default=ROOT, help="a source tree (default: this checkout)")
    p.add_argument("--sources", nargs="*", type=Path, help="CUDA sources relative to the trees (default: all of NEW's)")
    p.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST-style (9.0 builds sm_90a)")
    args = p.parse_args(argv)
    setup = resource_report.load_setup_module()
    new = args.new.resolve()
    sources = args.sources or sorted(path.relative_to(new) for path in (new / CSRC_RELATIVE).rglob("*.cu"))
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(args.old).resolve() if Path(args.old).is_dir() else exported(args.old, Path(tmp))
        failed = False
        for source in sources:
            try:
                old_kernels = text_sections(compile_cubin(old, source, args.arch, setup)) if (old / source).exists() else {}
                new_kernels = text_sections(compile_cubin(new, source, args.arch, setup))
            except RuntimeError as error:
                print(error, file=sys.stderr)
                failed = True
                continue
            result = compare(old_kernels, new_kernels)
            symbols = {normalized(k): k for k in [*old_kernels, *new_kernels]}
            readable = dict(zip(symbols, resource_report.demangle(list(symbols.values()))))
            old_text = {normalized(k): v for k, v in old_kernels.items()}
            new_text = {normalized(k): v for k, v in new_kernels.items()}
            renamed = renamed_pairs({n: readable[n] for n in result.only_old}, {n: readable[n] for n in result.only_new})
            for old_name, new_name in renamed:
                result.only_old.remove(old_name)
                result.only_new.remove(new_name)
                (result.identical if old_text[old_name] == new_text[new_name] else result.changed).append(new_name)
            print(f"{source}: {len(result.identical)} identical, {len(result.changed)} changed, "
                  f"{len(result.only_old)} removed, {len(result.only_new)} added"
                  + (f" ({len(renamed)} matched to a kernel that gained template arguments)" if renamed else ""))
            for label, names in (("changed", result.changed), ("removed", result.only_old), ("added", result.only_new)):
                for name in names:
                    print(f"  {label}: {resource_report.shorten(readable[name], 160)}")
            for old_name, new_name in renamed:
                state = "identical" if old_text[old_name] == new_text[new_name] else "changed"
                print(f"  {state}, was without its last template arguments: {resource_report.shorten(readable[new_name], 160)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
