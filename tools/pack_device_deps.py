"""Pack the device machine's OpenMMLab stack small enough to travel beside the repository.

A device call carries at most 64 MiB: the tracked tree (about 29 MiB, most of it
docs/measurements) and the ignored folders named in `carry`. `../shared/device` is 42 MiB, 35 of
them mmcv's wheel, whose extension is 103 MiB unpacked and 80 % debug information. Together they
exceed the limit, so an operator run with mmcv and DCNv4 beside our backends could not travel.

This tool unpacks every wheel (a wheel is a zip of what `pip install --target` puts in place; none
of these has a `.data` folder or scripts that an operator run needs), strips the shared objects'
debug information and symbol tables (`strip --strip-unneeded`: the dynamic symbols and the CUDA
fatbins stay, so the kernels are the same), and writes the lot as one xz tarball, about 6 MiB, plus
a `setup.sh` that unpacks it on the device. Extra wheels, e.g. DCNv4's brought back from a device
build, join the same tarball. The sdists named with --copy are copied beside it.

    python tools/pack_device_deps.py --out .deps_op --wheel path/to/dcnv4-*.whl
    # device call: carry [".deps_op"], command "source .deps_op/setup.sh && ..."
"""

from __future__ import annotations

import argparse
import io
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().parents[1].parent / "shared" / "device"
DEFAULT_COPY = ("DCNv4-1.0.0.post2.tar.gz",)
DEFAULT_CHECK = "import torch, mmcv, mmengine; from mmcv.ops import MultiScaleDeformableAttention"
TARBALL = "site.tar.xz"

SETUP_SH = """#!/usr/bin/env bash
# Written by tools/pack_device_deps.py. Source it on the device machine from the repository root:
#   source {folder}/setup.sh
# It unpacks {tarball} into DEVICE_SITE (default /tmp/site) and puts that on PYTHONPATH.
_here=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
_site=${{DEVICE_SITE:-/tmp/site}}
mkdir -p "$_site" && tar -xJf "$_here/{tarball}" -C "$_site" || {{ echo "device deps: unpack failed" >&2; return 1 2>/dev/null || exit 1; }}
export PYTHONPATH=$_site${{PYTHONPATH:+:$PYTHONPATH}}
export MAX_JOBS=${{MAX_JOBS:-16}}
export TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST:-9.0}}
python3 -c {check} && echo "device deps ok: {folder}" || {{ echo "device deps: import check failed" >&2; return 1 2>/dev/null || exit 1; }}
"""


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def unpack_wheels(wheels: list[Path], site: Path) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def strip_shared_objects(site: Path, strip: str | None) -> list[str]:
    """Strip every .so in place; returns the files that were stripped (none without `strip`)."""
    if strip is None:
        return []
    stripped = []
    for so in sorted(site.rglob("*.so*")):
        if so.is_file() and not so.is_symlink():
            subprocess.run([strip, "--strip-unneeded", str(so)], check=True)
            stripped.append(str(so.relative_to(site)))
    return stripped


def write_tarball(site: Path, target: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(site.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            tar.add(path, arcname=str(path.relative_to(site)), recursive=False)
    target.write_bytes(lzma.compress(buffer.getvalue(), preset=9))


def pack(source: Path, out: Path, extra_wheels: list[Path], copy: list[str], check: str, strip: str | None) -> dict:
    wheels = sorted((source / "wheels").glob("*.whl")) + list(extra_wheels)
    if not wheels:
        raise SystemExit(f"no wheels in {source / 'wheels'} and none given with --wheel")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        site = Path(staging)
        unpack_wheels(wheels, site)
        stripped = strip_shared_objects(site, strip)
        write_tarball(site, out / TARBALL)
    copied = []
    for name in copy:
        shutil.copy2(source / name, out / name)
        copied.append(name)
    setup = out / "setup.sh"
    setup.write_text(SETUP_SH.format(folder=out.name, tarball=TARBALL, check=shell_quote(check)))
    setup.chmod(0o755)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"wheels": [w.name for w in wheels], "stripped": stripped, "copied": copied, "bytes": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="the shared device folder (wheels/ inside)")
    parser.add_argument("--out", type=Path, default=Path(".deps_op"), help="the folder to write (keep it git-ignored)")
    parser.add_argument("--wheel", type=Path, action="append", default=[], help="another wheel to include, e.g. DCNv4's")
    parser.add_argument("--copy", nargs="*", default=list(DEFAULT_COPY), help="files of --source to copy beside it")
    parser.add_argument("--check", default=DEFAULT_CHECK, help="the Python statement setup.sh runs to check the imports")
    parser.add_argument("--no-strip", action="store_true", help="keep the shared objects as they are")
    args = parser.parse_args(argv)
    strip = None if args.no_strip else shutil.which("strip")
    if not args.no_strip and strip is None:
        raise SystemExit("no `strip` on PATH: install binutils or pass --no-strip (the tarball will be larger)")
    report = pack(args.source, args.out, args.wheel, args.copy, args.check, strip)
    print(f"{args.out}: {len(report['wheels'])} wheels, {len(report['stripped'])} shared objects stripped, "
          f"{report['bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
