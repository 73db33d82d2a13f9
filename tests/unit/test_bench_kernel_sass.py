"""bench/kernel_sass.py's SASS reading (the compile and cuobjdump need tools CI lacks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from kernel_sass import loop_of_most_loads

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;                /* 0x0000000103037810 */
        /*0040*/              @!P0 BRA 0x20 ;                             /* 0x0000000000008947 */
        /*0050*/                   LDG.E R6, desc[UR4][R8.64] ;           /* 0x0000000408067981 */
        /*0060*/                   LDG.E.64 R10, desc[UR4][R12.64] ;      /* 0x000000040c0a7981 */
        /*0070*/                   FFMA R7, R6, R10, R7 ;                 /* 0x0000000a06077223 */
        /*0080*/               @P1 BRA 0x50 ;                             /* 0x0000000000001947 */
        /*0090*/                   BRA 0x10 ;                             /* 0x0000000000007947 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_the_loop_with_the_most_loads_is_the_key_loop():
    total, body = loop_of_most_loads(SASS)
    assert total == 11
    # 0x10..0x90 holds the most loads (all three), over 0x50..0x80 (two) and 0x20..0x40 (one)
    assert body[0] == "S2R" and body[-1] == "BRA" and len(body) == 9
    assert body.count("LDG") == 3


def test_predicates_are_not_opcodes():
    _, body = loop_of_most_loads(SASS)
    assert "@!P0" not in body and body.count("BRA") == 3
