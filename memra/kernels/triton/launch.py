"""Launching a compiled Triton kernel with a fraction of `kernel[grid](...)`'s host time.

Why this is written here rather than taken from Triton: Triton's launch path binds every argument,
specializes it in C, formats the options into a cache key and checks the kernel's globals on every
call, about 35 us of host time per launch on the H200's host (a 4-prompt prefill wave of the 8B shape:
312 launches, 11.4 ms of host time against 7.1 ms of GPU time). Outside a CUDA graph -- a prefill
wave, an eager decode -- the host is then what a step waits for.

`lean(kernel)` keeps each variant Triton compiles, under a key computed here that is at least as
fine as Triton's own specialization of the arguments (a tensor: its dtype and whether its address
is 16-byte aligned; an int: whether it is 1, divisible by 16, and its width; the constexprs and
options by value), and launches a known variant straight through its compiled launcher. So a launch
runs exactly the kernel `kernel[grid](...)` would have run, on the same arguments: the same bits.
The first call of each key goes through Triton (compiling, with its hooks: memra's compile counter
sees it). Not carried over: Triton's launch enter/exit hooks (profilers such as proton see only the
first launch of each variant), and its check that a kernel's global constants have not changed
since it was compiled (memra's never do). Under TRITON_INTERPRET every call goes through Triton.
"""

from __future__ import annotations

import torch
from triton.runtime import driver

from memra.kernels.triton.common import _interpreting


def _arg_key(a) -> object:
    """What Triton's specialization can tell apart about one runtime argument (and a little more)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return "i", a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63
    if isinstance(a, float):
        return "f"
    if a is None:
        return "n"
    raise TypeError(f"a lean launch takes tensors, ints, floats, bools or None, not {type(a).__name__}")


class Lean:
    """A @triton.jit kernel launched as `kernel[grid](*runtime_args, **constexprs_and_options)`, with its
    compiled variants kept here (module docstring). Runtime arguments come positionally, constexprs by name."""

    def __init__(self, fn):
        self.fn = fn
        self.params = getattr(fn, "params", ())  # its parameters in signature order (not under the interpreter)
        self.variants: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if _interpreting():
            self.fn[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        key = (device, tuple(_arg_key(a) for a in args), tuple(kwargs.items()))
        compiled = self.variants.get(key)
        if compiled is None:
            # The key holds runtime arguments by their specialization only: a constexpr (compiled in by
            # value) must come by name, a tensor positionally.
            if any(p.is_constexpr for p in self.params[: len(args)]):
                raise TypeError(f"{self.fn.__name__}: pass constexprs by name to a lean launch")
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                raise TypeError(f"{self.fn.__name__}: pass tensors positionally to a lean launch")
            self.variants[key] = self.fn[grid](*args, **kwargs)  # compiles (or finds) the variant, and launches
            return
        # The constexprs (and any defaulted parameter) in signature order: the launcher takes every parameter.
        tail = [kwargs[p.name] if p.name in kwargs else p.default for p in self.params[len(args):]]
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        compiled.run(g0, g1, g2, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *tail)


def lean(fn) -> Lean:
    """Decorator, outside @triton.jit: `@lean @triton.jit def _k(...)`, launched as before with `_k[grid](...)`."""
    return Lean(fn)
