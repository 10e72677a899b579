"""tools/pack_device_deps.py: wheels unpacked, shared objects stripped, one tarball, a setup.sh
that unpacks it and checks the imports."""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import pack_device_deps  # noqa: E402


needs_tar_xz = pytest.mark.skipif(not (shutil.which("tar") and shutil.which("xz")), reason="setup.sh needs tar and xz")


def make_wheel(path: Path, package: str, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(f"{package}/{name}", data)
        wheel.writestr(f"{package}-1.0.dist-info/METADATA", f"Name: {package}\nVersion: 1.0\n")
    return path


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "device"
    (folder / "wheels").mkdir(parents=True)
    make_wheel(folder / "wheels" / "alpha-1.0-py3-none-any.whl", "alpha", {"__init__.py": b"VALUE = 7\n"})
    (folder / "sdist.tar.gz").write_bytes(b"not really a tarball")
    return folder


def run_setup(out: Path, site: Path, statement: str) -> subprocess.CompletedProcess:
    script = f"source {out}/setup.sh && python3 -c {pack_device_deps.shell_quote(statement)}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=out.parent,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "DEVICE_SITE": str(site)})


@needs_tar_xz
def test_pack_unpacks_every_wheel_and_setup_imports_them(tmp_path, source):
    extra = make_wheel(tmp_path / "beta-1.0-py3-none-any.whl", "beta", {"__init__.py": b"from alpha import VALUE\n"})
    out = tmp_path / ".deps_op"
    report = pack_device_deps.pack(source, out, [extra], ["sdist.tar.gz"], "import alpha, beta", strip=None)
    assert report["wheels"] == ["alpha-1.0-py3-none-any.whl", "beta-1.0-py3-none-any.whl"]
    assert (out / "sdist.tar.gz").read_bytes() == b"not really a tarball"
    with tarfile.open(out / pack_device_deps.TARBALL) as tar:
        names = set(tar.getnames())
    assert {"alpha/__init__.py", "beta/__init__.py", "alpha-1.0.dist-info/METADATA"} <= names
    done = run_setup(out, tmp_path / "site", "import beta; print(beta.VALUE)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["device deps ok: .deps_op", "7"]


@needs_tar_xz
def test_setup_fails_when_the_import_check_fails(tmp_path, source):
    out = tmp_path / "deps"
    pack_device_deps.pack(source, out, [], [], "import missing_package", strip=None)
    done = run_setup(out, tmp_path / "site", "print('should not run')")
    assert done.returncode != 0
    assert "import check failed" in done.stderr
    assert "should not run" not in done.stdout


def test_pack_without_wheels_says_where_it_looked(tmp_path):
    (tmp_path / "empty" / "wheels").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no wheels in"):
        pack_device_deps.pack(tmp_path / "empty", tmp_path / "out", [], [], "pass", strip=None)


@needs_tar_xz
@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("strip")), reason="needs a C compiler and strip")
def test_stripped_shared_objects_keep_their_exported_functions(tmp_path, source):
    c_file = tmp_path / "answer.c"
    c_file.write_text("int answer(void) { return 42; }\n")
    so = tmp_path / "libanswer.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-g", "-O0", str(c_file), "-o", str(so)], check=True)
    wheel = make_wheel(tmp_path / "gamma-1.0-py3-none-any.whl", "gamma", {"__init__.py": b"", "libanswer.so": so.read_bytes()})
    out = tmp_path / "deps"
    report = pack_device_deps.pack(source, out, [wheel], [], "import gamma", shutil.which("strip"))
    assert report["stripped"] == ["gamma/libanswer.so"]
    site = tmp_path / "site"
    done = run_setup(out, site, "import ctypes, gamma, os; "
                     "print(ctypes.CDLL(os.path.join(gamma.__path__[0], 'libanswer.so')).answer())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "42"
    assert (site / "gamma" / "libanswer.so").stat().st_size < so.stat().st_size
