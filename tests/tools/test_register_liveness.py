"""`tools/register_liveness.py`: nvdisasm's life-range listing read back, on a listing shaped like
nvdisasm 13.5's `-lrm count` output, and its refusal without nvdisasm."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import register_liveness  # noqa: E402

PAD = " " * 40
LISTING = f"""
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
//--------------------- .text._Z4fastv --------------------------
	.section	.text._Z4fastv,"ax",@progbits
{PAD}// +-------+--------+--------+---------+
{PAD}// | GPR   | PRED   | UGPR   | UPRED   |
_Z4fastv:{PAD}// |       |        |        |         |
        /*0000*/                   LDC R1, c[0x0][0x28] ;{PAD}// |   11  |        |    3   |         |
        /*0010*/               @P0 BRA `(.L_x_1) ;{PAD}// |   12  |   1    |    3   |         |
.L_x_1:{PAD}// +.......+........+........+.........+
        /*0020*/                   HMMA.16816.F32 R40, R40, R52, RZ ;{PAD}// |   94  |        |    7   |         |
        /*0030*/                   EXIT ;{PAD}// |    2  |        |        |         |
//--------------------- .text._Z5spillv --------------------------
	.section	.text._Z5spillv,"ax",@progbits
        /*0000*/                   STL [R1+0x10], R0 (*"SpillRefill"*) ;{PAD}// |   14  |        |        |         |
        /*0010*/                   IMAD R0, R3, R0, RZ ;{PAD}// |   20  |        |        |         |
        /*0020*/                   LDL.LU R4, [R1+0xc] ;{PAD}// |   21  |        |        |         |
        /*0030*/                   STS.U16 [R30+-0x22], R29 ;{PAD}// |    9  |        |        |         |
"""


def test_each_kernels_instructions_and_live_counts_are_read():
    fast, spill = register_liveness.parse_liveness(LISTING)
    assert fast.symbol == "_Z4fastv" and spill.symbol == "_Z5spillv"
    assert [(i.address, i.live) for i in fast.instructions] == [(0x0, 11), (0x10, 12), (0x20, 94), (0x30, 2)]
    assert fast.instructions[1].text == "@P0 BRA `(.L_x_1)"
    assert fast.peak.address == 0x20 and fast.peak.text == "HMMA.16816.F32 R40, R40, R52, RZ"


def test_spills_are_the_local_stores_and_loads_only():
    fast, spill = register_liveness.parse_liveness(LISTING)
    assert fast.spills == []
    assert [i.address for i in spill.spills] == [0x0, 0x20]  # STL and LDL.LU, not STS


def test_regions_give_each_runs_busiest_instruction():
    fast, _ = register_liveness.parse_liveness(LISTING)
    assert [(first.address, busiest.address) for first, busiest in fast.regions(3)] == [(0x0, 0x20), (0x30, 0x30)]


def test_the_report_names_the_peak_and_every_spill_of_the_selected_kernels():
    lines = register_liveness.report(register_liveness.parse_liveness(LISTING), "spill", regions=2, min_live=21)
    assert len(lines) == 5
    assert "4 instructions; peak 21 live registers at 0x20 (LDL.LU R4, [R1+0xc]); 2 spill instructions" in lines[1]
    assert lines[2].startswith("  spill 0x0: STL [R1+0x10], R0") and lines[3].startswith("  spill 0x20: LDL.LU")
    assert lines[4] == "  from    0x20: peak 21 at 0x20 (LDL.LU R4, [R1+0xc])"


def test_without_nvdisasm_it_says_where_to_get_it(tmp_path, capsys):
    assert register_liveness.main(["--sources", "x.cu", "--nvdisasm", str(tmp_path)]) == 1
    assert "pip download nvidia-cuda-nvdisasm" in capsys.readouterr().err
