"""The source distribution: what `python -m build` or `pip download --no-binary` hands to another
machine must hold everything the extension's build reads there, CUDA or not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in")


def package_tree(destination: Path) -> Path:
    """The files an sdist is made from, without build outputs, so the sdist writes nothing here."""
    for name in PACKAGE_FILES:
        shutil.copy2(ROOT / name, destination / name)
    shutil.copytree(
        ROOT / "mmdeform_tma",
        destination / "mmdeform_tma",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"),
    )
    return destination


def make_sdist(source: Path, dist: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (archive,) = dist.glob("mmdeform_tma-*.tar.gz")
    return archive


def archive_members(archive: Path) -> set[str]:
    with tarfile.open(archive) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[Path, Path]:
    source = package_tree(tmp_path_factory.mktemp("source"))
    return source, make_sdist(source, tmp_path_factory.mktemp("dist"))


def test_the_sdist_holds_every_kernel_source_header_and_table(sdist):
    """Made on this CPU-only machine, whose build compiles four C++ files, the sdist still holds
    every .cpp, .cu, .h and .cuh under csrc (the CUDA build's sources and what they include), the
    tuning tables and every Python module."""
    source, archive = sdist
    members = archive_members(archive)
    package = source / "mmdeform_tma"
    wanted = {
        path.relative_to(source).as_posix()
        for path in package.rglob("*")
        if path.is_file()
        and (path.suffix in (".py", ".cpp", ".cu", ".h", ".cuh") or path.parent.name == "tuning_tables")
    }
    assert any(name.endswith(".cuh") for name in wanted) and any(name.endswith(".cu") for name in wanted)
    assert not sorted(wanted - members)


def test_the_sdist_builds_the_cpu_extension(sdist, tmp_path):
    """Unpacked elsewhere, the sdist builds and imports: the C++ sources find their headers in it."""
    _, archive = sdist
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    (unpacked,) = tmp_path.glob("mmdeform_tma-*")
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=unpacked,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    probe = "import mmdeform_tma, torch; print(mmdeform_tma.__file__); print(hasattr(torch.ops.mmdeform_tma, 'ms_deform_attn_forward'))"
    imported = subprocess.run([sys.executable, "-c", probe], cwd=unpacked, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-4000:]
    where, has_op = imported.stdout.split()
    assert Path(where).resolve().is_relative_to(unpacked.resolve()) and has_op == "True"
