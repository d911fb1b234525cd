"""No K loop of ours rewrites the A registers of a warpgroup MMA still in flight (tests/_sass.py; docs/performance.md
§32.3). The kernels are compiled for sm_90a on this machine: the check needs no GPU, only Triton's NVIDIA backend
(its ptxas and cuobjdump)."""

import pytest

from tests._sass import (FP8_WEIGHT_GEMM, VSA_FINE_TMA, a_register_hazards, compile_sass,
                         waits_for_all_before_loading)

pytest.importorskip("triton.backends.nvidia")


def _loop(*body: str) -> str:
    """A SASS loop from address 0x100: `body`'s instructions, then the branch back to its head."""
    lines = [f"        /*{0x100 + 16 * i:04x}*/                   {t} ;" for i, t in enumerate(body)]
    return "\n".join(lines + [f"        /*{0x100 + 16 * len(body):04x}*/               @!P0 BRA 0x100 ;"])


_MMA_R4 = "HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR4], R24, gsb0"
_MMA_R8 = "HGMMA.64x128x16.F32.BF16 R24, R8, gdesc[UR4], R24, gsb0"


def test_the_check_finds_writes_into_in_flight_mmas():
    # Triton 3.6's form: one MMA a group, `DEPBAR.LE 1` after each: the second is in flight at the back edge, and the
    # next step's first load hits its A registers (R8..R11); a wait for all at the head clears it.
    load = "LDS.U16 R9, [R2+0x100]"
    deps = "WARPGROUP.DEPBAR.LE gsb0, 0x1"
    assert set(a_register_hazards(_loop("NOP", load, _MMA_R4, deps, _MMA_R8, deps))) == {load}
    assert a_register_hazards(_loop("WARPGROUP.DEPBAR.LE gsb0, 0x0", load, _MMA_R4, deps, _MMA_R8, deps)) == []
    # a wait for "at most 3" with 2 in flight keeps both: the older group's R4..R7 are still read
    assert a_register_hazards(_loop("LDS.U16 R5, [R2]", _MMA_R4, _MMA_R8, "WARPGROUP.DEPBAR.LE gsb0, 0x3")) != []
    # an MMA issued but not yet committed (no gsb0) reads its registers too
    issued = "HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR4], R24"
    wait = "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert set(a_register_hazards(_loop(issued, "MOV R6, R7", _MMA_R8, wait))) == {"MOV R6, R7"}


@pytest.mark.parametrize("decode", [0, 1, 2])
def test_fp8_weight_gemm_waits_before_its_next_decode(decode):
    # Under Triton 3.6 (the H200's) the same loop without `_wgmma_drain` has such writes for every decode (§32.3);
    # Triton 3.9 (this machine's) has none either way, so the drain's own mark is checked as well.
    drained = compile_sass(FP8_WEIGHT_GEMM, str(decode), "1")
    assert a_register_hazards(drained) == [] and waits_for_all_before_loading(drained)
    assert not waits_for_all_before_loading(compile_sass(FP8_WEIGHT_GEMM, str(decode), "0"))


def test_fp8_weight_gemm_compiles_for_blackwell():
    # `wgmma` is sm_90 only: ptxas refuses `wgmma.wait_group` for sm_100a, so the launcher drains on sm_90 alone.
    from h3render.kernels.fp8_weight.triton_impl import drain_for

    assert drain_for(9) and not drain_for(10) and not drain_for(12) and not drain_for(8)
    assert "_wfp8_kernel" in compile_sass(FP8_WEIGHT_GEMM, "1", "0", "100")  # compiled: no ptxas error


@pytest.mark.parametrize("int8", [True, False])
def test_vsa_fine_kernel_has_no_in_flight_write(int8):
    # P (the P.V MMA's A operand) is rewritten only after the next score MMA's `DEPBAR.LE 0`, which retires the
    # previous P.V too: no drain needed.
    sass = compile_sass(VSA_FINE_TMA, "1" if int8 else "0")
    assert "HGMMA" in sass and a_register_hazards(sass) == []
