"""bench/kernel_sass.py's SASS reading (the compile and cuobjdump need tools CI lacks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from kernel_sass import longest_loading_loop, memory_opcodes

# An outer loop 0x10..0xb0 around three inner ones: 0x20..0x40 (one load, 3 instructions),
# 0x50..0x70 (two loads, 3 instructions: like a sink variant's exact tiles) and 0x80..0xa0 (no
# loads); then 0xc0..0x110 (one load, 6 instructions: like the code tiles).
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;                /* 0x0000000103037810 */
        /*0040*/              @!P0 BRA 0x20 ;                             /* 0x0000000000008947 */
        /*0050*/                   LDG.E R6, desc[UR4][R8.64] ;           /* 0x0000000408067981 */
        /*0060*/                   LDG.E.64 R10, desc[UR4][R12.64] ;      /* 0x000000040c0a7981 */
        /*0070*/               @P1 BRA 0x50 ;                             /* 0x0000000000001947 */
        /*0080*/                   FFMA R7, R6, R10, R7 ;                 /* 0x0000000a06077223 */
        /*0090*/                   FADD R7, R7, R7 ;                      /* 0x0000000707077221 */
        /*00a0*/               @P2 BRA 0x80 ;                             /* 0x0000000000002947 */
        /*00b0*/                   BRA 0x10 ;                             /* 0x0000000000007947 */
        /*00c0*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*00d0*/                   LOP3.LUT R3, R2, 0xf0f0f0f, RZ, 0xc0, !PT ; /* 0x0 */
        /*00e0*/                   PRMT R5, R3, 0x5410, R2 ;              /* 0x0000541003057816 */
        /*00f0*/                   HADD2 R5, R5, -1032, -1032 ;           /* 0x0000000005057830 */
        /*0100*/                   IADD3 R4, R4, 0x10, RZ ;               /* 0x0000001004047810 */
        /*0110*/              @!P3 BRA 0xc0 ;                             /* 0x0000000000008947 */
        /*0120*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_the_longest_innermost_loop_that_loads_is_the_key_loop():
    total, body = longest_loading_loop(SASS)
    assert total == 19
    # not the outer loop (most loads), nor 0x50..0x70 (more loads, shorter), nor 0x80..0xa0
    assert body == ["LDG", "LOP3", "PRMT", "HADD2", "IADD3", "BRA"]


def test_predicates_are_not_opcodes():
    _, body = longest_loading_loop(SASS)
    assert not any(op.startswith("@") for op in body)


def test_memory_opcodes_count_loads_and_stores_by_width():
    """The gather's figures (``--gather``): every global load and store of the program with
    its width, a predicated one included, nothing else."""
    total, memory = memory_opcodes(SASS + "        /*0130*/    @P4 STG.E.64 [R2.64], R4 ;\n")
    assert total == 20
    assert memory == {"LDG.E": 3, "LDG.E.64": 1, "STG.E.64": 1}
