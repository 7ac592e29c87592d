"""Where sparse-v2's bytes go: per step, the bytes of each stream (changed positions, signs,
large-change flags, large-change sizes, tables), beside the entropy of what it codes given the
old element's exponent (per 2^20-element segment, 256 exponent bins), and per class of one
segment of one tensor.

    .venv/bin/python benchmarks/sparse2_streams.py --steps 4 --every 4
    .venv/bin/python benchmarks/sparse2_streams.py --history --steps 9 --every 4

``--history``: what the previous version's change at an element (whether it changed, and its
sign) would save, per step: the entropies given that context, and a projection with a real
coder (sparse-v2's own classes and Rice codes, each segment's members split by whether they
changed in the previous step, and the signs of those that did coded as flips of their last
sign), against sparse-v1 and upstream's xor+zstd-1. Step 1 follows a full version (the
seed), so it has no history context.

Same data as bench_sync.py (bench_data.RLStream, seed 0); ``--every k`` codes every k-th
tensor only (a quick look); nothing is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

from bench_data import DEFAULT_STEPS, PRESETS, RLStream  # noqa: E402
from weightsync.codecs import sparse_v2 as c2  # noqa: E402
from weightsync.codecs import get_codec  # noqa: E402
from weightsync import knobs  # noqa: E402


BITSTREAM2 = c2.Sparse2Codec(bitstream=2)  # the study is of bitstream 2's streams


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return -(p * np.log2(p) + q * np.log2(q))


def _hcounts(c: np.ndarray) -> float:
    c = c[c > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


def _part_nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (c2.Rice, c2.Values)):
        return len(x.rem) + len(x.quo)
    return len(x)


def _order(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.int64)
    return np.where(x >> 15, x ^ 0xFFFF, x ^ 0x8000)


def stream_bytes(old: np.ndarray, new: np.ndarray, name: str, out: dict, per_class: list | None) -> None:
    enc = BITSTREAM2.encode(old.view(np.uint8), new.view(np.uint8), 2, 1, name)
    if enc is None:
        return
    parsed = c2.parse(enc.payload, old.nbytes, name)
    coded = 0
    for seg in parsed.segments:
        for c in seg.classes:
            sizes = {"positions": _part_nbytes(c.mask), "signs": _part_nbytes(c.signs),
                     "flags": _part_nbytes(c.flags), "sizes": _part_nbytes(c.values)}
            for key, v in sizes.items():
                out[key] += v
                coded += v
            if per_class is not None and seg.start == 0:
                per_class.append((c.lo >> 7, c.hi >> 7, c.members, c.changes, c.nbig, sizes))
    out["tables"] += len(enc.payload) - coded
    out["sparse-v1"] += len(get_codec("sparse-v1").encode(old.view(np.uint8), new.view(np.uint8), 2, 1, name).payload)
    for s0 in range(0, old.size, c2.SEG_ELEMENTS):
        o, n = old[s0 : s0 + c2.SEG_ELEMENTS], new[s0 : s0 + c2.SEG_ELEMENTS]
        changed = o != n
        k = int(changed.sum())
        if not k:
            continue
        key = ((o >> 7) & 0xFF).astype(np.int64)
        ne = np.bincount(key, minlength=256).astype(np.float64)
        ke = np.bincount(key[changed], minlength=256).astype(np.float64)
        present = ne > 0
        out["H positions"] += float((ne[present] * _h(ke[present] / ne[present])).sum()) / 8
        out["H signs"] += k / 8
        kc = key[changed]
        mag = np.abs(_order(n[changed]) - _order(o[changed])) - 1
        _, joint = np.unique(kc * 70000 + mag, return_counts=True)
        out["H flags+sizes"] += (_hcounts(joint) - _hcounts(np.bincount(kc))) / 8


# --- --history: the previous version's change as context --------------------------------


def _flip_nbytes(flips: np.ndarray) -> int:
    """Bytes of the sign flips (new sign != last sign) of k changes: raw bits, or the indices
    of the rarer outcome as Rice gaps or a bitmap, with the count, mode, parameter and
    declared size such a part would need in the table."""
    k = flips.size
    raw = -(-k // 8)
    m = int(flips.sum())
    rarer = flips if m <= k - m else ~flips
    if not rarer.any():
        return 1 + 4
    mode, _, parts = c2._positions_code(np.flatnonzero(rarer), k)
    coded = sum(len(p) for p in parts) + 1 + 4 + 1 + (4 if mode == c2.MODE_RICE else 0)
    return min(1 + raw, coded)


def _project_segment(o: np.ndarray, n: np.ndarray, h: np.ndarray | None, last_neg: np.ndarray | None,
                     penalty_bits: float) -> tuple[int, int, dict]:
    """(bytes, classes with changes, bytes per stream) of one bf16 segment coded as sparse-v2
    with its members split by ``h`` (changed in the previous step; None: no split), each part
    with its own exponent classes, and the signs of changes with ``h`` coded as flips of
    ``last_neg`` (the previous change's sign)."""
    changed = o != n
    idx = np.flatnonzero(changed)
    streams = dict.fromkeys(["positions", "signs", "flags+sizes", "tables"], 0)
    if idx.size == 0:
        streams["tables"] = 1
        return 1, 0, streams
    d = _order(n[idx]) - _order(o[idx])
    neg = d < 0
    mags = (np.abs(d) - 1).astype(np.uint16)
    key = ((o >> 7) & 0xFF).astype(np.intp)
    keys = key[idx]
    pops = [np.ones(o.size, np.bool_)] if h is None else [~h, h]
    nclasses = 0
    for p, in_pop in enumerate(pops):
        chg = np.flatnonzero(in_pop[idx])  # changes of this part, as indices into idx
        members = np.bincount(key[in_pop], minlength=256)
        if not members.any():
            continue
        changes = np.bincount(keys[chg], minlength=256)
        starts = c2.choose_boundaries(members, changes, penalty_bits)
        streams["tables"] += 1 + len(starts)
        class_of_key = np.zeros(256, np.intp)
        for b in starts:
            class_of_key[b:] += 1
        cls = class_of_key[keys[chg]]
        for c in range(len(starts) + 1):
            sel = in_pop & (class_of_key[key] == c)
            at = chg[cls == c]
            members_c, local = c2._ranks(sel, idx[at])
            if at.size == 0:
                streams["tables"] += c2.CLASS_HEAD.size
                continue
            nclasses += 1
            signs = neg[at] if p == 0 or h is None else neg[at] ^ last_neg[idx[at]]
            head, parts = c2._encode_class(members_c, local, signs, mags[at], keys[at], 2)
            nmask = 1 if head[16] == c2.MODE_BITMAP else 2  # the class head's mask mode
            streams["tables"] += len(head)
            streams["positions"] += sum(len(x) for x in parts[:nmask])
            streams["signs"] += len(parts[nmask]) if (p == 0 or h is None) else _flip_nbytes(signs)
            streams["flags+sizes"] += sum(len(x) for x in parts[nmask + 1 :])
    return sum(streams.values()), nclasses, streams


def _kt_bits(n0: np.ndarray, n1: np.ndarray) -> float:
    """Bits an adaptive binary arithmetic coder with a Krichevsky-Trofimov estimate per
    context spends on n0 zeros and n1 ones (in any order: the product of its predictions
    depends on the counts only), summed over the contexts."""
    n0 = n0.astype(np.float64)
    n1 = n1.astype(np.float64)
    lg = np.vectorize(math.lgamma, otypes=[np.float64])
    nats = lg(n0 + n1 + 1) + math.log(math.pi) - lg(n0 + 0.5) - lg(n1 + 0.5)
    return float(nats[(n0 + n1) > 0].sum()) / math.log(2)


def _hist_entropies(o: np.ndarray, n: np.ndarray, h: np.ndarray | None, last_neg: np.ndarray | None, out: dict) -> None:
    """Bits (in bytes) of one segment's streams given the exponent, and given the exponent and
    the history context: the mask given (key, changed last step), the signs given (key, the last
    change's sign) where there was one, the sizes given (key, no last change / same / other
    direction)."""
    changed = o != n
    k = int(changed.sum())
    if not k:
        return
    key = ((o >> 7) & 0xFF).astype(np.int64)
    hh = np.zeros(o.size, np.int64) if h is None else h.astype(np.int64)
    for name, ctx in (("exp", key), ("hist", key * 2 + hh)):
        ne = np.bincount(ctx, minlength=512).astype(np.float64)
        ke = np.bincount(ctx[changed], minlength=512).astype(np.float64)
        present = ne > 0
        out[f"H positions {name}"] += float((ne[present] * _h(ke[present] / ne[present])).sum()) / 8
        out[f"KT positions {name}"] += _kt_bits(ne - ke, ke) / 8 + 2  # an arithmetic coder's flush
    d = _order(n[changed]) - _order(o[changed])
    neg = (d < 0).astype(np.int64)
    out["H signs exp"] += k / 8
    out["KT signs exp"] += -(-k // 8)
    if h is None:
        out["H signs hist"] += k / 8
        out["KT signs hist"] += -(-k // 8)
        state = np.zeros(k, np.int64)
    else:
        hc = h[changed]
        ln = last_neg[changed].astype(np.int64)
        ctx = key[changed][hc] * 2 + ln[hc]  # the exponent and the last change's sign
        joint = np.bincount(ctx * 2 + neg[hc], minlength=1024)
        out["H signs hist"] += ((~hc).sum() + _hcounts(joint) - _hcounts(np.bincount(ctx, minlength=512))) / 8
        pairs = joint.reshape(512, 2)
        out["KT signs hist"] += -(-int((~hc).sum()) // 8) + _kt_bits(pairs[:, 0], pairs[:, 1]) / 8 + 2
        state = np.where(hc, 1 + (ln != neg), 0)
    kc = key[changed]
    mag = np.abs(d) - 1
    for name, ctx in (("exp", kc), ("hist", kc * 3 + state)):
        pair, joint = np.unique(ctx * 70000 + mag, return_counts=True)
        per_ctx = np.bincount(ctx)
        h_cond = _hcounts(joint) - _hcounts(per_ctx)
        out[f"H flags+sizes {name}"] += h_cond / 8
        # an adaptive multi-symbol coder per context pays about half log2(n) bits per symbol it learns
        distinct = np.bincount(pair // 70000, minlength=per_ctx.size)
        used = per_ctx > 0
        learn = float((0.5 * (distinct[used] - 1) * np.log2(per_ctx[used])).sum())
        out[f"KT flags+sizes {name}"] += (h_cond + learn) / 8 + 2


def history_rows(preset: str, steps: int, every: int) -> tuple[list, int]:
    """Per step (index, label, figures, streams without history, streams with it, whether the
    step has a history context), and the number of tensors looked at."""
    stream = RLStream(PRESETS[preset])
    v0 = stream.bf16()
    names = sorted(v0)[::every]
    prev = {nm: v0[nm].reshape(-1) for nm in names}
    del v0
    last: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # name: (changed, negative) of the previous step
    # a longer history for comparison: whether an element changed in any step since the seed, and
    # the sign of its latest change (state a puller would keep over the whole chain)
    ever = {nm: np.zeros(prev[nm].size, np.bool_) for nm in names}
    ever_neg = {nm: np.zeros(prev[nm].size, np.bool_) for nm in names}
    seg = c2.SEG_ELEMENTS
    cctx = zstandard.ZstdCompressor(level=1)
    v1 = get_codec("sparse-v1")
    rows = []
    cols = ["v1", "base", "v2", "proj0", "proj", "classes0", "classes", "segs", "ctx bytes",
            "H positions exp", "H positions hist", "H signs exp", "H signs hist", "H flags+sizes exp", "H flags+sizes hist",
            "p0", "p1", "flip", "H signs ever", "KT positions exp", "KT positions hist", "KT signs exp", "KT signs hist",
            "KT flags+sizes exp", "KT flags+sizes hist", "ntensors", "flip ever", "k ever"]
    streams0 = dict.fromkeys(["positions", "signs", "flags+sizes", "tables"], 0)
    for i, (lr, label) in enumerate(DEFAULT_STEPS[:steps], start=1):
        full = stream.step(lr)
        cur = {nm: full[nm].reshape(-1) for nm in names}
        del full
        out = dict.fromkeys(cols, 0.0)
        st0, st1 = dict(streams0), dict(streams0)
        st1["k"] = 0
        nh = kh = n0 = k0 = 0
        penalty = 8.0 * (seg * knobs.SPARSE2_CLASS_MIN_SAVING.get() + c2.CLASS_OVERHEAD_BYTES)
        now: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for nm in names:
            o, nw = prev[nm], cur[nm]
            ob, nb = o.view(np.uint8), nw.view(np.uint8)
            changed = o != nw
            neg = np.zeros(o.size, np.bool_)
            at = np.flatnonzero(changed)
            neg[at] = (_order(nw[at]) - _order(o[at])) < 0
            now[nm] = (changed, neg)
            if not at.size:
                continue
            st1["k"] += at.size
            x = np.bitwise_xor(ob, nb)
            out["base"] += len(cctx.compress(x.tobytes()))
            out["v1"] += len(v1.encode(ob, nb, 2, 1, nm).payload)
            out["v2"] += len(BITSTREAM2.encode(ob, nb, 2, 1, nm).payload)
            out["proj0"] += c2.HEADER.size
            out["ntensors"] += 1
            out["proj"] += c2.HEADER.size
            hfull, lfull = last[nm] if last is not None else (None, None)
            if hfull is not None:
                nh += int(hfull.sum())
                kh += int((hfull & changed).sum())
                n0 += int((~hfull).sum())
                k0 += int((~hfull & changed).sum())
                lc = hfull & changed
                out["flip"] += int((lfull[lc] != neg[lc]).sum())
            for s0 in range(0, o.size, seg):
                os_, ns_ = o[s0 : s0 + seg], nw[s0 : s0 + seg]
                hs = None if hfull is None else hfull[s0 : s0 + seg]
                ls = None if lfull is None else lfull[s0 : s0 + seg]
                b0, c0, s_0 = _project_segment(os_, ns_, None, None, penalty)
                out["proj0"] += b0
                out["classes0"] += c0
                out["segs"] += 1
                for key_, v in s_0.items():
                    st0[key_] += v
                if hs is None:
                    b1, c1, s_1 = b0, c0, s_0
                else:
                    b1, c1, s_1 = _project_segment(os_, ns_, hs, ls, penalty)
                out["proj"] += b1
                out["classes"] += c1
                for key_, v in s_1.items():
                    st1[key_] += v
                _hist_entropies(os_, ns_, hs, ls, out)
            e, en = ever[nm], ever_neg[nm]
            for s0 in range(0, o.size, seg):
                cs = at[(at >= s0) & (at < s0 + seg)]
                known = e[cs]
                recent = np.zeros(cs.size, np.bool_) if hfull is None else hfull[cs]
                out["H signs ever"] += int((~known).sum()) / 8
                ck = ((o[cs] >> 7) & 0xFF).astype(np.int64)
                for group in (known & recent, known & ~recent):  # changed in the last step / before it
                    flips = en[cs][group] != neg[cs][group]
                    out["k ever"] += flips.size
                    out["flip ever"] += int(flips.sum())
                    ctx = ck[group] * 2 + en[cs][group]  # exponent and last sign
                    joint = np.bincount(ctx * 2 + neg[cs][group], minlength=1024)
                    out["H signs ever"] += (_hcounts(joint) - _hcounts(np.bincount(ctx, minlength=512))) / 8
            e[at] = True
            en[at] = neg[at]
            if hfull is not None and hfull.any():  # a sidecar of the previous delta's positions and signs, Rice coded
                out["ctx bytes"] += -(-int(hfull.sum()) // 8) + sum(len(x) for x in c2._positions_code(np.flatnonzero(hfull), hfull.size)[2])
        out["p0"] = k0 / max(n0, 1)
        out["p1"] = kh / max(nh, 1)
        out["flip"] = out["flip"] / max(kh, 1)
        out["flip ever"] = out["flip ever"] / max(out["k ever"], 1)
        out["proj ever"] = out["proj"] - st1["signs"] + out["H signs ever"]  # signs at their entropy: a bound
        rows.append((i, label, out, st0, st1, last is not None))
        prev, last = cur, now
        print(f"step {i} done", file=sys.stderr, flush=True)
    return rows, len(names)


def history_table(args) -> None:
    rows, ntensors = history_rows(args.preset, args.steps, args.every)
    mb = lambda x: f"{x / 1e6:.3f}"  # noqa: E731
    print(f"every {args.every}th tensor ({ntensors} tensors); MB; proj0: this script's coder without history "
          "(calibration against the real sparse-v2), proj: with the history context\n")
    print("| step | v1 | base | v2 | v2/v1 | proj0 | proj | proj/proj0 | proj/v1 (scaled) | proj/base (scaled) | "
          "classes/seg 0 -> hist | P(chg) no-last / last | P(flip) | sidecar MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, label, out, _, _, has in rows:
        scaled = out["v2"] * out["proj"] / out["proj0"]  # the real coder's bytes times the projected saving
        print(f"| {i} {label} | {mb(out['v1'])} | {mb(out['base'])} | {mb(out['v2'])} | {out['v2'] / out['v1']:.3f}x | "
              f"{mb(out['proj0'])} | {mb(out['proj'])} | {out['proj'] / out['proj0']:.3f}x | {scaled / out['v1']:.3f}x | "
              f"{scaled / out['base']:.3f}x | {out['classes0'] / out['segs']:.1f} -> {out['classes'] / out['segs']:.1f} | "
              + (f"{out['p0']:.4f} / {out['p1']:.4f} | {out['flip']:.3f} | {mb(out['ctx bytes'])} |" if has else "- | - | - |"))
    print("\nan adaptive binary arithmetic coder instead (KT estimate per context, per segment: the mask given the "
          "exponent, or the exponent and the last step's change; the signs raw, or given the exponent and the last "
          "sign where there is one; the sizes given the exponent, or with the last change's direction, plus what an "
          "adaptive model pays to learn them; 16 table bytes per segment). mixed: sparse-v2's Rice classes for the "
          "positions and signs (with history: as in the first table), an adaptive coder for the flags and sizes only "
          "(work per change, not per element)\n")
    print("| step | positions exp -> hist | signs exp -> hist | flags+sizes exp -> hist | exp / v1 | hist / v1 | exp / base "
          "| hist / base | mixed exp / v1 | mixed hist / v1 | mixed hist / base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, label, out, st0, st1, _ in rows:
        tables = out["segs"] * 16 + out["ntensors"] * c2.HEADER.size  # a few counts per segment
        t0 = out["KT positions exp"] + out["KT signs exp"] + out["KT flags+sizes exp"] + tables
        t1 = out["KT positions hist"] + out["KT signs hist"] + out["KT flags+sizes hist"] + tables
        # sparse-v2's Rice classes for the positions and signs (split by the history context as in
        # the first table), the flags and sizes by an adaptive coder (per change, not per element)
        m0 = out["proj0"] - st0["flags+sizes"] + out["KT flags+sizes exp"]
        m1 = out["proj"] - st1["flags+sizes"] + out["KT flags+sizes hist"]
        print(f"| {i} {label} | {mb(out['KT positions exp'])} -> {mb(out['KT positions hist'])} | {mb(out['KT signs exp'])} -> "
              f"{mb(out['KT signs hist'])} | {mb(out['KT flags+sizes exp'])} -> {mb(out['KT flags+sizes hist'])} | "
              f"{t0 / out['v1']:.3f}x | {t1 / out['v1']:.3f}x | {t0 / out['base']:.3f}x | {t1 / out['base']:.3f}x | "
              f"{m0 / out['v1']:.3f}x | {m1 / out['v1']:.3f}x | {m1 / out['base']:.3f}x |")
    print("\nfor comparison, signs given the latest change since the seed (a state over the whole chain): share of "
          "changes with one, P(flip), H signs given the exponent, the last step's / an older change and its sign, and "
          "the projection with the signs at that entropy (an optimistic bound; positions as above)\n")
    print("| step | with a latest change | P(flip) | H signs | proj/v1 (scaled) | proj/base (scaled) |")
    print("|---|---|---|---|---|---|")
    for i, label, out, _, st1, _ in rows:
        scaled = out["v2"] * out["proj ever"] / out["proj0"]
        print(f"| {i} {label} | {out['k ever'] / max(st1['k'], 1):.3f} | {out['flip ever']:.3f} | {mb(out['H signs ever'])} | "
              f"{scaled / out['v1']:.3f}x | {scaled / out['base']:.3f}x |")
    print("\nentropy (MB) given the exponent -> given the exponent and the history context; streams of the projection "
          "without -> with history\n")
    print("| step | H positions | H signs | H flags+sizes | H total hist/exp | H total / v1 | positions | signs | flags+sizes | tables |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, label, out, st0, st1, _ in rows:
        he = out["H positions exp"] + out["H signs exp"] + out["H flags+sizes exp"]
        hh = out["H positions hist"] + out["H signs hist"] + out["H flags+sizes hist"]
        arrow = lambda a, b: f"{mb(a)} -> {mb(b)}"  # noqa: E731
        print(f"| {i} {label} | {arrow(out['H positions exp'], out['H positions hist'])} | "
              f"{arrow(out['H signs exp'], out['H signs hist'])} | {arrow(out['H flags+sizes exp'], out['H flags+sizes hist'])} | "
              f"{hh / he:.3f}x | {he / out['v1']:.3f}x -> {hh / out['v1']:.3f}x | {arrow(st0['positions'], st1['positions'])} | "
              f"{arrow(st0['signs'], st1['signs'])} | {arrow(st0['flags+sizes'], st1['flags+sizes'])} | "
              f"{arrow(st0['tables'], st1['tables'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=1, help="code every k-th tensor only")
    ap.add_argument("--history", action="store_true", help="the history context's table instead")
    args = ap.parse_args()
    if args.history:
        history_table(args)
        return
    stream = RLStream(PRESETS[args.preset])
    prev = stream.bf16()
    names = sorted(prev)[:: args.every]
    show = next((n for n in names if "mlp" in n), names[0])
    print("| step | positions | signs | flags | sizes | tables | v2 total | v2/v1 | H positions | H signs | H flags+sizes | v2/Hctx |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    classes: list = []
    for i, (lr, label) in enumerate(DEFAULT_STEPS[: args.steps], start=1):
        cur = stream.step(lr)
        out = dict.fromkeys(["positions", "signs", "flags", "sizes", "tables", "sparse-v1", "H positions", "H signs",
                             "H flags+sizes"], 0.0)
        for name in names:
            stream_bytes(prev[name].reshape(-1), cur[name].reshape(-1), name, out, classes if (i == 1 and name == show) else None)
        total = sum(out[k] for k in ("positions", "signs", "flags", "sizes", "tables"))
        hctx = out["H positions"] + out["H signs"] + out["H flags+sizes"]
        mb = lambda x: f"{x / 1e6:.3f}"  # noqa: E731
        print(f"| {i} {label} | {mb(out['positions'])} | {mb(out['signs'])} | {mb(out['flags'])} | {mb(out['sizes'])} | "
              f"{mb(out['tables'])} | {mb(total)} | {total / out['sparse-v1']:.3f}x | {mb(out['H positions'])} | "
              f"{mb(out['H signs'])} | {mb(out['H flags+sizes'])} | {total / hctx:.3f}x |")
        prev = cur
    print(f"\nstep 1, {show}, segment 0, per class (keys [lo, hi), bytes):")
    for lo, hi, members, k, nbig, sizes in classes:
        print(f"- keys [{lo:#x}, {hi:#x}): {members} members, {k} changed ({k / max(members, 1):.3f}), {nbig} large; {sizes}")


if __name__ == "__main__":
    main()
