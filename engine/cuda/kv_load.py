"""Device functions the attention kernel reads one K or V element through, per page format.

``kv_loader(bits)`` returns ``load(pages, scales, page, slot, head, d) -> float32``:

- bits 0: unquantized pages [P, S, KV, D] in the run dtype (``scales`` is not read);
- bits 8: int8 codes [P, S, KV, D] times the group's fp16 scale;
- bits 4: uint8 [P, S, KV, D / 2]: element d of group g = d // 32 sits in byte g * 16 + d % 16,
  low nibble for d % 32 < 16, high nibble otherwise, stored as q + 8.

The layout is engine/cache/quant.py's (its INVARIANT); the product is taken in float32 as the
torch reference's ``dequantize`` takes it, so both see the same values. A lane that owns dims
lane, lane + LT, ... (LT = 16 or 32) reads, for each i, one byte of the group's 16: the lanes
of a key group read contiguous bytes.
"""

from __future__ import annotations

import functools

from engine.cuda._launch import cuda

float32 = cuda.float32  # bound here: inside a simulated kernel ``cuda`` is the fake module
int32 = cuda.int32
GROUP = 32
HALF = GROUP // 2


@functools.cache
def kv_loader(bits: int):
    if bits == 0:

        def load(pages, scales, page, slot, head, d):
            return float32(pages[page, slot, head, d])

    elif bits == 8:

        def load(pages, scales, page, slot, head, d):
            return float32(pages[page, slot, head, d]) * float32(
                scales[page, slot, head, d // GROUP]
            )

    elif bits == 4:

        def load(pages, scales, page, slot, head, d):
            g = d // GROUP
            j = d - g * GROUP
            byte = int32(pages[page, slot, head, g * HALF + j % HALF])
            nibble = (byte >> 4) if j >= HALF else (byte & 15)
            return float32(nibble - 8) * float32(scales[page, slot, head, g])

    else:
        raise ValueError(f"no K/V loader for {bits}-bit pages (0, 8 or 4)")
    return cuda.jit(device=True)(load)
