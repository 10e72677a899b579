"""Stand-ins for the commands the device scripts (tools/gpu_suite.sh, tools/end_to_end_evidence.sh)
run, so that their CPU tests see which commands each step runs without running them."""

import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("tools/gpu_suite.sh", "tools/end_to_end_evidence.sh")
# what the shell itself sets, not a setting of the scripts
SHELL_VARIABLES = {"PATH", "PWD", "SECONDS", "PYTHONPATH", "HOME"}


def script_settings() -> set[str]:
    """The environment variables the device scripts and the stand-ins read. A device call's own
    environment sets some (OUT, CUDA_VISIBLE_DEVICES, and those of a lane, when these tests run
    on the device), and none may leak into the runs under test."""
    names = {"CUDA_VISIBLE_DEVICES", "MMDEFORM_TMA_TEST_BACKENDS", "PINNED_TO"}
    for script in SCRIPTS:
        names |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", (ROOT / script).read_text()))
    return names - SHELL_VARIABLES


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


class StandIns:
    """A folder of stand-in commands first on PATH. python3 records one line per call:
    'CUDA_VISIBLE_DEVICES|cores|MMDEFORM_TMA_TEST_BACKENDS| arguments', where cores is the list a
    taskset before it pinned the call to (empty: none); taskset runs the command so; nproc says 32;
    ncu records '||| ncu arguments'; compute-sanitizer records '||| compute-sanitizer arguments'."""

    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.calls = tmp_path / "calls.txt"
        executable(
            self.bin / "python3",
            '#!/usr/bin/env bash\n'
            'echo "${CUDA_VISIBLE_DEVICES:-}|${PINNED_TO:-}|${MMDEFORM_TMA_TEST_BACKENDS:-}| $*"'
            f' >> "{self.calls}"\n',
        )
        executable(
            self.bin / "taskset", '#!/usr/bin/env bash\n[ "$1" = -c ] && export PINNED_TO=$2\nshift 2\nexec "$@"\n'
        )
        executable(self.bin / "nproc", "#!/usr/bin/env bash\necho 32\n")
        # ncu records itself with what it would profile, as one call (it runs nothing)
        executable(self.bin / "ncu", f'#!/usr/bin/env bash\necho "||| ncu $*" >> "{self.calls}"\n')
        executable(self.bin / "compute-sanitizer", f'#!/usr/bin/env bash\necho "||| compute-sanitizer $*" >> "{self.calls}"\n')
        self.gpus(2)

    def gpus(self, count: int) -> None:
        """nvidia-smi -L lists `count` GPUs."""
        lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(count))
        executable(self.bin / "nvidia-smi", "#!/usr/bin/env bash\n" + lines)

    def without(self, command: str, tmp_path: Path) -> str:
        """A PATH of this folder and the system's commands, less `command` (its stand-in too)."""
        (self.bin / command).unlink(missing_ok=True)
        system = tmp_path / "system_bin"
        system.mkdir(exist_ok=True)
        for folder in os.environ["PATH"].split(os.pathsep):
            for entry in Path(folder).glob("*") if Path(folder).is_dir() else ():
                link = system / entry.name
                if entry.name != command and not link.exists() and not link.is_symlink():
                    link.symlink_to(entry)
        return f"{self.bin}:{system}"

    def run(self, script: str, *args: str, env: dict, expect_rc: int = 0) -> tuple[list[str], list[str]]:
        """Runs `bash script args` in the repository root; returns (the recorded calls, stdout's lines)."""
        self.calls.unlink(missing_ok=True)
        settings = script_settings()
        clean = {name: value for name, value in os.environ.items() if name not in settings}
        environment = {**clean, "PATH": f"{self.bin}:{os.environ['PATH']}", **env}  # env may set PATH
        result = subprocess.run(["bash", script, *args], cwd=ROOT, env=environment, capture_output=True, text=True)
        assert result.returncode == expect_rc, result.stdout + result.stderr
        calls = self.calls.read_text().splitlines() if self.calls.exists() else []
        return calls, result.stdout.splitlines()
