"""The peer byte-integrity probe's bytes: a deterministic pattern per directed copy, the poison the
destination is pre-filled with, and the count of bytes that came back wrong.

The pattern is the reference's xorshift64 stream, byte for byte, so both runtimes copy the same bytes.
Pure numpy and no policy: what a mismatch means is decided in memra.pp.probe_policy.
"""

from __future__ import annotations

import numpy as np

_U64_MAX = (1 << 64) - 1


def _rotl64(x: int, r: int) -> int:
    x &= _U64_MAX
    return ((x << r) | (x >> (64 - r))) & _U64_MAX


def pattern_seed(n_bytes: int, boundary: int, src_dev: int, dst_dev: int) -> int:
    """The xorshift64 start state: a fixed constant mixed with the copy's size and endpoints, so
    every (size, boundary, direction) copies different bytes and a stale buffer cannot pass."""
    return (0xD1B54A32D192ED03 ^ _rotl64(n_bytes, 7) ^ _rotl64(boundary, 19)
            ^ _rotl64(src_dev, 31) ^ _rotl64(dst_dev, 43))


def _pattern_loop(n: int, state: int) -> bytes:
    out = bytearray(n)
    for i in range(n):
        state ^= (state << 13) & _U64_MAX
        state ^= state >> 7
        state ^= (state << 17) & _U64_MAX
        out[i] = state & 0xFF
    return bytes(out)


def _xorshift(a: np.ndarray) -> None:
    a ^= a << np.uint64(13)
    a ^= a >> np.uint64(7)
    a ^= a << np.uint64(17)


def _linear_apply(images: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Apply the GF(2)-linear map whose basis images are `images` (64 u64) to every element of x."""
    idx = np.arange(256, dtype=np.uint64)
    out = np.zeros_like(x)
    for k in range(8):
        table = np.zeros(256, dtype=np.uint64)
        for b in range(8):
            table[((idx >> np.uint64(b)) & np.uint64(1)).astype(bool)] ^= images[8 * k + b]
        out ^= table[((x >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.intp)]
    return out


_FAST_MIN_BYTES = 1 << 16
_LANES = 1 << 16


def _pattern_lanes(n: int, state: int) -> bytes:
    """The same byte stream, computed in parallel lanes. Lane j owns bytes [j*K, (j+1)*K); its start
    state is the xorshift state jumped ahead j*K steps, found by repeated squaring of the (linear)
    K-step map. Turns a 64 MiB rung from a minute of Python into well under a second."""
    lanes = min(_LANES, n)
    steps = -(-n // lanes)
    images = np.array([1 << b for b in range(64)], dtype=np.uint64)
    for _ in range(steps):  # images of the K-step map
        _xorshift(images)
    starts = np.array([state], dtype=np.uint64)
    while len(starts) < lanes:  # starts[j] = K-step map applied j times to the seed state
        starts = np.concatenate([starts, _linear_apply(images, starts)])
        images = _linear_apply(images, images)
    s = starts[:lanes].copy()
    out = np.empty((steps, lanes), dtype=np.uint8)
    for i in range(steps):
        _xorshift(s)
        out[i] = (s & np.uint64(0xFF)).astype(np.uint8)
    return out.T.reshape(-1)[:n].tobytes()


def peer_probe_pattern(n_bytes: int, boundary: int, src_dev: int, dst_dev: int) -> bytes:
    """The deterministic probe bytes for one directed copy: the low byte of each successive
    xorshift64 (13, 7, 17) state from `pattern_seed`."""
    if n_bytes < 0:
        raise ValueError(f"probe size must be >= 0, got {n_bytes}")
    seed = pattern_seed(n_bytes, boundary, src_dev, dst_dev)
    if n_bytes < _FAST_MIN_BYTES:
        return _pattern_loop(n_bytes, seed)
    return _pattern_lanes(n_bytes, seed)


def poison_of(expected: bytes) -> bytes:
    """Every byte inverted: the destination is pre-filled with this, so a copy that never landed
    (or landed partly) differs from the pattern at every byte it missed."""
    return bytes(np.bitwise_not(np.frombuffer(expected, dtype=np.uint8)))


def mismatch_count(expected: bytes, readback: bytes) -> int:
    """Differing bytes over the common prefix, plus the length difference."""
    a = np.frombuffer(expected, dtype=np.uint8)
    b = np.frombuffer(readback, dtype=np.uint8)
    m = min(len(a), len(b))
    return int(np.count_nonzero(a[:m] != b[:m])) + abs(len(a) - len(b))

