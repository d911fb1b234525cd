"""No K loop of ours rewrites the A registers of a warpgroup MMA still in flight (tests/_sass.py; docs/performance.md
§32.3). The kernels are compiled for sm_90a on this machine: the check needs no GPU, only Triton's NVIDIA backend
(its ptxas and cuobjdump)."""

import pytest

from tests._sass import FP8_WEIGHT_GEMM, VSA_FINE_TMA, a_register_hazards, compile_sass

pytest.importorskip("triton.backends.nvidia")

# Two K steps of two MMAs each, as ptxas lays out Triton 3.6's pipelined loop: each MMA its own group, a
# `DEPBAR.LE 1` after each, so one is in flight at the back edge, and the next step's first load hits its A
# registers (R8..R11). The same with `DEPBAR.LE 0` at the loop head has no hazard.
_LOOP = """
        /*0100*/                   {head} ;
        /*0110*/                   LDS.U16 R9, [R2+0x100] ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR4], R24, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0140*/                   HGMMA.64x128x16.F32.BF16 R24, R8, gdesc[UR4], R24, gsb0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0160*/               @!P0 BRA 0x100 ;
"""


def test_the_check_finds_a_write_into_an_in_flight_mma():
    assert a_register_hazards(_LOOP.format(head="NOP")) == ["LDS.U16 R9, [R2+0x100]"]
    assert a_register_hazards(_LOOP.format(head="WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []


@pytest.mark.parametrize("decode", [1, 2])
def test_fp8_weight_gemm_waits_before_its_next_decode(decode):
    # Under Triton 3.6 (the H200's) the same loop without `_wgmma_drain` has 71 such writes (checked with 3.6 on the
    # CPU machine, and wrong sums on the H200); newer Triton may need the drain no more.
    assert a_register_hazards(compile_sass(FP8_WEIGHT_GEMM, str(decode), "1")) == []


@pytest.mark.parametrize("int8", [True, False])
def test_vsa_fine_kernel_has_no_in_flight_write(int8):
    # P (the P.V MMA's A operand) is rewritten only after the next score MMA's `DEPBAR.LE 0`, which retires the
    # previous P.V too: no drain needed.
    sass = compile_sass(VSA_FINE_TMA, "1" if int8 else "0")
    assert "HGMMA" in sass and a_register_hazards(sass) == []
