"""`tools/kernel_code_diff.py`: the ELF reading and the comparison on made-up input, and two tiny
source trees through nvcc where a toolkit is installed (CI's CPU machine has one)."""

import shutil
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import kernel_code_diff  # noqa: E402


def elf_with_sections(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF: a null section, the named ones, then the name table."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name in [*sections, ".shstrtab"])
    body, headers, name_at, offset = b"", [], 1, 64
    for name, data in sections.items():
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset + len(body), len(data), 0, 0, 1, 0))
        body += data
        name_at += len(name) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, offset + len(body), len(names), 0, 0, 1, 0))
    body += names
    section_offset = offset + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, section_offset)
    struct.pack_into("<HHH", header, 0x3A, 64, len(headers) + 1, len(headers))
    return bytes(header) + body + b"\0" * 64 + b"".join(headers)


def test_text_sections_are_read_by_kernel_symbol():
    elf = elf_with_sections({".text._Z1av": b"\x01\x02", ".nv.info._Z1av": b"\x09", ".text._Z1bv": b"\x03\x04\x05"})
    assert kernel_code_diff.text_sections(elf) == {"_Z1av": b"\x01\x02", "_Z1bv": b"\x03\x04\x05"}
    with pytest.raises(ValueError):
        kernel_code_diff.text_sections(b"not an elf file")


def test_the_same_kernel_from_two_trees_compares_by_its_code():
    # nvcc's anonymous namespace names differ between two copies of one file
    old = "_ZN1x46_GLOBAL__N__97f3943a_18_window_backward_cu_23239d7e6kernelEv"
    new = "_ZN1x46_GLOBAL__N__0badf00d_18_window_backward_cu_5eed5eed6kernelEv"
    assert kernel_code_diff.normalized(old) == kernel_code_diff.normalized(new)
    result = kernel_code_diff.compare(
        {old: b"same", "_Z7changedv": b"v1", "_Z4gonev": b"x"}, {new: b"same", "_Z7changedv": b"v2", "_Z3newv": b"y"}
    )
    assert result.identical == [kernel_code_diff.normalized(old)]
    assert result.changed == ["_Z7changedv"]
    assert result.only_old == ["_Z4gonev"] and result.only_new == ["_Z3newv"]


KERNELS = """
__global__ void scale(float* x) {{ x[threadIdx.x] *= {factor}f; }}
__global__ void copy(float* y, const float* x) {{ y[threadIdx.x] = x[threadIdx.x]; }}
"""


def write_tree(folder: Path, factor: str) -> Path:
    source = folder / "mmdeform_tma" / "csrc" / "tiny.cu"
    source.parent.mkdir(parents=True)
    source.write_text(KERNELS.format(factor=factor))
    return folder


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(), reason="no CUDA toolkit")
def test_two_trees_name_the_kernel_that_changed(tmp_path, capsys):
    pytest.importorskip("torch")
    old = write_tree(tmp_path / "old", "2.0")
    new = write_tree(tmp_path / "new", "3.0")
    source = "mmdeform_tma/csrc/tiny.cu"
    assert kernel_code_diff.main([str(old), str(new), "--sources", source]) == 0
    out = capsys.readouterr().out
    assert f"{source}: 1 identical, 1 changed, 0 removed, 0 added" in out
    assert "changed: scale(float*)" in out
    assert kernel_code_diff.main([str(old), str(old), "--sources", source]) == 0
    assert f"{source}: 2 identical, 0 changed" in capsys.readouterr().out


def test_kernel_names_split_into_name_template_arguments_and_parameters():
    name = "void ns::(anonymous namespace)::k<float, B<C, D>, 2>(float*, ns::Problem<float>, int)"
    assert kernel_code_diff.split_kernel_name(name) == (
        "void ns::(anonymous namespace)::k", ["float", "B<C, D>", "2"], "(float*, ns::Problem<float>, int)")
    assert kernel_code_diff.split_kernel_name("void plain(int)") is None
    assert kernel_code_diff.split_kernel_name("not a function") is None


def test_a_kernel_that_gained_template_arguments_pairs_with_what_it_was():
    old = {"a": "void ns::k<__half, 2>(__half*, P<__half>)", "b": "void ns::k<float, 2>(float*, P<float>)",
           "c": "void ns::gone<int>(int)"}
    new = {"x": "void ns::k<__half, 2, false>(__half*, P<__half>)", "y": "void ns::k<__half, 2, true>(__half*, P<__half>)",
           "z": "void ns::k<float, 2, false>(double*, P<float>)", "w": "void ns::other<int, 1>(int)"}
    # the first match per old kernel; z's parameters differ from b's, w's name from c's
    assert kernel_code_diff.renamed_pairs(old, new) == [("a", "x")]
