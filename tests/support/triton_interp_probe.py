"""Whether this triton's interpreter can run a loop with loaded bounds at all.

Triton 3.6's interpreter turns a loop bound into a Python int with ``int(array)`` on a
one-element array, which NumPy >= 2.5 refuses ("only 0-dimensional arrays can be converted to
Python scalars"); newer triton (3.9, as vLLM's CPU build brings) extracts the element. Both
interpreter case runners call :func:`interpreter_defect` first, with ``TRITON_INTERPRET=1``
already set, and report a skip naming the versions instead of one failure per case.
"""

from __future__ import annotations


def interpreter_defect() -> str | None:
    """None when the interpreter runs a loop over loaded bounds; else why not, with versions."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _loop(bounds_ptr, out_ptr):
        lo = tl.load(bounds_ptr)
        hi = tl.minimum(tl.load(bounds_ptr + 1), 4)
        acc = 0
        for i in range(lo, hi):
            acc += i
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop[(1,)](torch.tensor([1, 3], dtype=torch.int32), out)
    except Exception as exc:
        text = repr(exc)
        if "0-dimensional arrays" in text or "ndim > 0 to a scalar" in text:
            return (
                f"triton {triton.__version__}'s interpreter converts one-element arrays to loop "
                f"bounds with int(), which NumPy {np.__version__} refuses; the "
                "kernels' loops over loaded bounds cannot run interpreted here. Triton 3.9 runs "
                "them; on a GPU the compiled kernels are tested instead"
            )
        raise
    if int(out) != 3:
        raise AssertionError(f"triton {triton.__version__}'s interpreter summed 1..2 as {int(out)}")
    return None
