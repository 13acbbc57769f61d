"""Lean Triton launches (memra.kernels.triton.launch): a known variant launched straight through its
compiled launcher. The key must tell apart every argument Triton's specialization tells apart, or a
launch could run a variant compiled for other arguments; on the GPU a launch through the kept variant
gives the bits of the launch that compiled it."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from cuda_marks import cuda_only
from memra.kernels.triton.launch import _arg_key


def test_the_key_tells_apart_what_triton_specializes():
    """Two arguments with one key must get one specialization from Triton (the key may be finer)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    flat = torch.zeros(64, dtype=torch.bfloat16)
    args = [1, 2, 16, 17, 32, 2**31 - 16, 2**31, 2**31 + 1, 2**63, -16, -1, 0, True, False, 1.0, 2.5, None,
            flat, flat[8:], flat[1:], flat[3:], flat.float(), flat.float()[4:], flat.float()[1:]]
    triton_spec = lambda a: native_specialize_impl(BaseBackend, a, False, True, True)  # noqa: E731
    for a in args:
        for b in args:
            if _arg_key(a) == _arg_key(b):
                assert triton_spec(a) == triton_spec(b), (a, b)
    assert len({_arg_key(a) for a in args}) >= len({repr(triton_spec(a)) for a in args})
    with pytest.raises(TypeError, match="not str"):
        _arg_key("x")


@cuda_only
def test_a_kept_variant_gives_the_bits_of_the_launch_that_compiled_it():
    from memra.kernels.triton import linear as T

    g = torch.Generator(device=DEVICE).manual_seed(0)
    k, n, m = 512, 384, 37
    w = torch.randn(n, k, device=DEVICE, generator=g).to(torch.bfloat16)
    flat = torch.randn(m * k + 1, device=DEVICE, generator=g).to(torch.bfloat16)
    for x in (flat[: m * k].view(m, k), flat[1:].view(m, k)):  # an aligned and a misaligned start
        kept = len(T._linear_kernel.variants)
        first = T.linear(x, w)  # through Triton: compiles (or finds) the variant
        known = len(T._linear_kernel.variants)
        assert known <= kept + 1
        again = T.linear(x, w)  # through the kept variant: no new one
        assert len(T._linear_kernel.variants) == known and torch.equal(first, again)
    assert any(not key[1][0][1] for key in T._linear_kernel.variants)  # the misaligned x has a variant of its own
