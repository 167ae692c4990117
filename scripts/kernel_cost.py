"""Packed linear layers against nn.Linear on this machine (the timings ops/packed.py's docstring
quotes): the LM head's shape at 1-16 rows, and, for SmolLM2's layer shapes, each kernel at one row
with one weight in the cache and with weights streamed from memory, and the row count from which
the packed kernel runs (`small_rows`).

    python scripts/kernel_cost.py
"""

import torch
from torch import nn

from blockdraft.lab.profiling import timed
from blockdraft.ops.packed import PACK_HINT, kernel_timings, prepack, small_rows


def main() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(576, 49152, bias=False)
    packed = nn.Linear(576, 49152, bias=False)
    packed.load_state_dict(lin.state_dict())
    packed = prepack(packed)

    def ms(fn):
        fn()  # the first call packs the weight
        return 1e3 * timed(fn, torch.device("cpu"), repeats=30)

    with torch.inference_mode():
        packed(torch.randn(PACK_HINT, 576))  # packs the weight
        for rows in (1, 2, 4, 16):
            x = torch.randn(rows, 576)
            print(f"576 x 49152, {rows:2d} rows: nn.Linear {ms(lambda: lin(x)):6.2f} ms, "
                  f"PackedLinear {ms(lambda: packed(x)):6.2f} ms")
        for n_in, n_out in ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)):
            w = torch.randn(n_out, n_in)
            t = kernel_timings(w, 1)
            rows = small_rows(w, None)
            print(f"{n_in} x {n_out}, 1 row: default {t['cached_default']} us, packed {t['cached_packed']} us in the "
                  f"cache; streamed default {t['streamed_default']} us, packed {t['streamed_packed']} us; "
                  f"the default kernel below {rows} rows, packed from {rows}")


if __name__ == "__main__":
    main()
