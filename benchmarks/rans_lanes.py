"""What an adaptive-coder sparse-v2 would cost the puller: a binary rANS decoder of one
2^20-element change mask with a probability per element (from its old exponent), vectorised
with numpy across interleaved lanes, beside one pass of today's sparse-v2 class decode (a
compare and a position list over the segment) in the same run.

    .venv/bin/python benchmarks/rans_lanes.py

The mask is synthetic but shaped like the benchmark's: per-element change probabilities of
0.2-0.0005 by exponent bin. Each lane needs its final state (4 bytes) in the payload, so lanes
cost bytes: the table prints them against the mask's own size. Every decode is checked
against the encoded mask.
"""

from __future__ import annotations

import time

import numpy as np

PROB_BITS = 12
M = 1 << PROB_BITS
LOW = 1 << 16  # states live in [2^16, 2^32); 16 bits move per renormalisation


def encode(bits: np.ndarray, f1: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(final states, word stream) of ``bits`` (element i in lane i % lanes, step i // lanes)
    with P(1) = f1 / 2^12; the decoder reads at step s the words the encoder wrote at step s,
    lanes in ascending order."""
    steps = bits.size // lanes
    b = bits.reshape(steps, lanes)
    f = f1.reshape(steps, lanes).astype(np.uint64)
    x = np.full(lanes, LOW, np.uint64)
    words = []
    for s in range(steps - 1, -1, -1):
        bit = b[s]
        freq = np.where(bit, f[s], np.uint64(M) - f[s])
        start = np.where(bit, np.uint64(0), f[s])
        emit = x >= (freq << np.uint64(32 - PROB_BITS))
        words.append((x[emit] & np.uint64(0xFFFF)).astype(np.uint16))
        x[emit] >>= np.uint64(16)
        x = (x // freq << np.uint64(PROB_BITS)) + x % freq + start
    return x, np.concatenate(words[::-1]) if words else np.zeros(0, np.uint16)


def decode(states: np.ndarray, stream: np.ndarray, f1: np.ndarray, lanes: int) -> np.ndarray:
    steps = f1.size // lanes
    f = f1.reshape(steps, lanes).astype(np.uint32)
    x = states.astype(np.uint64)
    out = np.empty((steps, lanes), np.bool_)
    words = stream.astype(np.uint64)
    pos = 0
    mask = np.uint64(M - 1)
    for s in range(steps):
        fs = f[s]
        slot = (x & mask).astype(np.uint32)
        bit = slot < fs
        out[s] = bit
        freq = np.where(bit, fs, np.uint32(M) - fs)
        start = np.where(bit, np.uint32(0), fs)
        x = freq.astype(np.uint64) * (x >> np.uint64(PROB_BITS)) + (slot - start)
        need = np.flatnonzero(x < LOW)
        if need.size:
            x[need] = (x[need] << np.uint64(16)) | words[pos : pos + need.size]
            pos += need.size
    return out.reshape(-1)


def best_of(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    rng = np.random.default_rng(0)
    n = 1 << 20
    # exponent bins with their share of the elements and change rate (the benchmark's steps 3-4 look like this)
    share = np.array([0.02, 0.05, 0.13, 0.3, 0.3, 0.2])
    rate = np.array([0.2, 0.1, 0.05, 0.02, 0.005, 0.0005])
    key = rng.choice(share.size, n, p=share)
    p = rate[key]
    bits = rng.random(n) < p
    table = np.clip(np.round(rate * M), 1, M - 1).astype(np.uint32)
    old = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0x807F)) | (key.astype(np.uint16) + 0x70 << 7)
    ideal = float(-(np.log2(np.where(bits, p, 1 - p))).sum()) / 8
    sel = np.empty(n, np.bool_)

    def class_pass() -> None:  # today's cost per class: a compare and a position list over the segment
        np.less(old & np.uint16(0x7FFF), np.uint16(0x73 << 7), out=sel)
        np.flatnonzero(sel)

    t_pass = best_of(class_pass)
    print(f"one mask of 2^20 elements, {int(bits.sum())} changed; entropy {ideal / 1e3:.1f} KB; "
          f"one sparse-v2 class pass (compare + position list) {t_pass * 1e3:.2f} ms = {t_pass / n * 1e9:.2f} ns/element\n")
    print("| lanes | payload KB | of it, lane states KB | / entropy | decode ms | ns/element | / one class pass |")
    print("|---|---|---|---|---|---|---|")
    for lanes in (256, 1024, 4096, 16384):
        f1 = table[((old >> np.uint16(7)) & np.uint16(0xFF)).astype(np.intp) - 0x70]  # the per-element context lookup
        states, stream = encode(bits, f1, lanes)
        nbytes = stream.nbytes + 4 * lanes
        got = decode(states, stream, f1, lanes)
        assert np.array_equal(got, bits), lanes

        def run() -> None:
            f = table[((old >> np.uint16(7)) & np.uint16(0xFF)).astype(np.intp) - 0x70]
            decode(states, stream, f, lanes)

        t = best_of(run)
        print(f"| {lanes} | {nbytes / 1e3:.1f} | {4 * lanes / 1e3:.1f} | {nbytes / 1e3 / (ideal / 1e3):.3f}x | {t * 1e3:.1f} | "
              f"{t / n * 1e9:.1f} | {t / t_pass:.1f}x |")


if __name__ == "__main__":
    main()
