"""``encoding="auto"``: the publisher picks ``sparse-v1`` or ``sparse-v2`` for each version by
what its pullers pay, wire time against apply time.

``delta_encoding`` is one value per version in the index (docs/FORMAT.md), so the choice is
per version; a dense step still becomes a full version (``Publisher.choose_kind``, after this).

The rule, with its inputs (``Cost``; knobs in ``knobs.py``):

1. Sample: every K-th window of 2^20 elements (sparse-v2's segment, so a sampled window is coded
   exactly as in the version), K = 1 / ``sample_fraction``, taken systematically over the
   passed tensors in name order, starting at ``version mod K``; at least ``MIN_WINDOWS``
   windows, all of them in a small model. Each window is encoded both ways on the publisher's
   pool; the sums scale by elements to the whole version. The publish pays the sample on top of
   the one real encode (about ``3.4 x sample_fraction`` of a sparse-v1 publish: sparse-v2's
   bitstream 3 encodes about 2.4x slower), never a second encode of the model.
2. A step the sample shows dense (more than ``full_above_changed_fraction`` of the elements
   changed) is encoded with sparse-v1, the cheaper encode: a full version is likely, and the
   exact totals decide.
3. ``saved_s`` = (sparse-v1 bytes - sparse-v2 bytes) / ``link_bytes_per_s``: the wire time one
   puller saves with sparse-v2 (``link_bytes_per_s``: that puller's share of the link).
4. ``extra_s`` = ``pass_ns`` x (elements of bitstream-2 segments with several classes x the
   passes the apply makes over them: one for the magnitudes, one per class with changes) +
   ``coded_ns`` x elements of bitstream-3 segments with changes (the range decoder makes one
   decision per element) + ``change_ns`` x changed elements: the apply time sparse-v2 costs that
   puller beyond sparse-v1, charged on one core (conservative: bitstream 2's pull scaled 1.14x
   from one to two workers on the benchmark, bitstream 3's 1.66x). The defaults were measured
   on the 2-core CI box.
5. sparse-v2 when ``saved_s > extra_s``, else sparse-v1. Put another way: sparse-v2 below a
   break-even bandwidth of ``saved bytes / extra_s``, which the reason states.

Invariant: the choice is a function of the version's bytes, the version number and the knobs,
so a retried version chooses the same, and ranks that sum their samples all choose alike.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from typing import Iterable

import msgspec

from .. import knobs
from ..codecs import get_codec, sparse_v2
from ..codecs.sparse_v1 import _width
from ..errors import InvalidKnobError
from ..format.safetensors_io import DTYPE_NBYTES
from .snapshot import EncodeJob

AUTO = "auto"
CANDIDATES = ("sparse-v1", "sparse-v2")
WINDOW_ELEMENTS = sparse_v2.SEG_ELEMENTS
MIN_WINDOWS = 4


class Cost(msgspec.Struct, frozen=True):
    """The rule's inputs: the declared link and what sparse-v2 costs a puller."""

    link_bytes_per_s: float  # one puller's share of the link
    pass_ns: float  # per element and pass over a sparse-v2 segment with several classes
    change_ns: float  # per changed element, sparse-v2 beyond sparse-v1
    sample_fraction: float  # share of the windows encoded both ways
    coded_ns: float = 0.0  # per element of a range-coded (bitstream 3) segment with changes

    @classmethod
    def from_knobs(cls, link_bytes_per_s: float | None = None, sample_fraction: float | None = None) -> "Cost":
        """Arguments override the knobs; every value is checked (``InvalidKnobError``)."""
        link = _chosen("link_bytes_per_s", link_bytes_per_s, knobs.LINK_BYTES_PER_S)
        if not (math.isfinite(link) and link > 0):
            raise InvalidKnobError(
                knobs.LINK_BYTES_PER_S.env if link_bytes_per_s is None else "link_bytes_per_s", link,
                "the bytes per second one puller gets from the source dir, a finite number > 0 (encoding "
                "'auto' trades wire time against apply time, so it needs the link: pass link_bytes_per_s= "
                f"or set {knobs.LINK_BYTES_PER_S.env})",
            )
        per_unit = {knob: _chosen(name, None, knob) for name, knob in (
            ("pass_ns", knobs.SPARSE2_PASS_NS), ("change_ns", knobs.SPARSE2_CHANGE_NS), ("coded_ns", knobs.SPARSE2_CODED_NS))}
        for knob, value in per_unit.items():
            if not (math.isfinite(value) and value >= 0):
                raise InvalidKnobError(knob.env, value, "a finite number of nanoseconds >= 0")
        fraction = _chosen("sample_fraction", sample_fraction, knobs.AUTO_SAMPLE_FRACTION)
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise InvalidKnobError(
                knobs.AUTO_SAMPLE_FRACTION.env if sample_fraction is None else "sample_fraction", fraction,
                "a share of the windows in (0, 1]",
            )
        return cls(link, per_unit[knobs.SPARSE2_PASS_NS], per_unit[knobs.SPARSE2_CHANGE_NS], fraction,
                   per_unit[knobs.SPARSE2_CODED_NS])


class EncodingSample(msgspec.Struct, frozen=True):
    """What one rank's sample measured; ranks add theirs (``merge_samples``) before choosing."""

    elements: int  # elements of the tensors passed (what the sample stands for)
    sampled_elements: int
    changed_elements: int  # in the sample
    v1_nbytes: int  # the sampled windows' sparse-v1 payloads
    v2_nbytes: int
    v2_pass_elements: int  # segment elements x passes sparse-v2's apply makes over them
    v2_coded_elements: int = 0  # elements of range-coded segments with changes


class Estimate(msgspec.Struct, frozen=True):
    """A sample scaled to the whole version."""

    changed_fraction: float
    v1_nbytes: float
    v2_nbytes: float
    extra_apply_s: float  # what sparse-v2 costs one puller core beyond sparse-v1


class EncodingChoice(msgspec.Struct, frozen=True):
    """The encoding a version is prepared with, and why (logged, and in ``PublishResult``)."""

    encoding: str
    reason: str


def merge_samples(samples: Iterable[EncodingSample]) -> EncodingSample:
    """The sum of several ranks' samples (each rank samples the tensors it owns)."""
    fields = [0] * len(EncodingSample.__struct_fields__)
    for s in samples:
        for i, value in enumerate(msgspec.structs.astuple(s)):
            fields[i] += value
    return EncodingSample(*fields)


class EncodingChooser:
    """Samples a version's tensors both ways and applies the rule above."""

    def __init__(self, cost: Cost, level: int, pool: Executor):
        self.cost = cost
        self.level = level
        self.pool = pool

    def sample(self, version: int, jobs: list[EncodeJob]) -> EncodingSample:
        frame = [j for j in sorted(jobs, key=lambda j: j.name) if not j.untouched and j.new.nbytes]
        windows = [(job, s) for job in frame for s in range(_window_count(job))]
        picked = pick_windows(len(windows), version, self.cost.sample_fraction)
        units = [(windows[i], name) for i in picked for name in CANDIDATES]
        results = list(self.pool.map(lambda unit: self._encode_window(*unit), units))
        sampled = sum(_window_elements(*windows[i]) for i in picked)
        v1 = [r for (_, name), r in zip(units, results) if name == "sparse-v1"]
        v2 = [r for (_, name), r in zip(units, results) if name == "sparse-v2"]
        return EncodingSample(
            elements=sum(_elements(j) for j in frame),
            sampled_elements=sampled,
            changed_elements=sum(r[1] for r in v1),
            v1_nbytes=sum(r[0] for r in v1),
            v2_nbytes=sum(r[0] for r in v2),
            v2_pass_elements=sum(r[2] for r in v2),
            v2_coded_elements=sum(r[3] for r in v2),
        )

    def choose(self, sample: EncodingSample, full_above_changed_fraction: float) -> EncodingChoice:
        if sample.sampled_elements == 0 or sample.changed_elements == 0:
            return EncodingChoice("sparse-v1", "auto: the sample changed nothing (sparse-v1 costs a puller least)")
        est = self.estimate(sample)
        changed = est.changed_fraction
        if changed > full_above_changed_fraction:
            return EncodingChoice("sparse-v1", (
                f"auto: the sample shows a dense step ({changed:.0%} of the elements changed, threshold "
                f"{full_above_changed_fraction:.0%}); a full version is likely, so the cheaper encode"
            ))
        v1_nbytes, v2_nbytes, extra_s = est.v1_nbytes, est.v2_nbytes, est.extra_apply_s
        saved = v1_nbytes - v2_nbytes
        c = self.cost
        sizes = f"~{v2_nbytes / 1e6:.3g} MB against ~{v1_nbytes / 1e6:.3g} MB ({v2_nbytes / max(v1_nbytes, 1):.2f}x)"
        if saved <= 0:
            return EncodingChoice("sparse-v1", f"auto: sparse-v2 would not be smaller ({sizes})")
        saved_s = saved / c.link_bytes_per_s
        breakeven = saved / extra_s if extra_s > 0 else math.inf
        why = (
            f"sparse-v2 {sizes} saves {saved_s:.3g}s per puller at {c.link_bytes_per_s / 1e6:.3g} MB/s and costs it "
            f"~{extra_s:.3g}s more apply (sparse-v2 pays below ~{breakeven / 1e6:.3g} MB/s)"
        )
        if saved_s > extra_s:
            return EncodingChoice("sparse-v2", f"auto: {why}")
        return EncodingChoice("sparse-v1", f"auto: {why}")

    def estimate(self, sample: EncodingSample) -> Estimate:
        scale = sample.elements / max(sample.sampled_elements, 1)
        c = self.cost
        extra_ns = (c.pass_ns * sample.v2_pass_elements + c.coded_ns * sample.v2_coded_elements
                    + c.change_ns * sample.changed_elements)
        return Estimate(sample.changed_elements / max(sample.sampled_elements, 1), sample.v1_nbytes * scale,
                        sample.v2_nbytes * scale, 1e-9 * extra_ns * scale)

    def _encode_window(self, window: tuple[EncodeJob, int], encoding: str) -> tuple[int, int, int, int]:
        """(payload bytes, changed elements, sparse-v2 pass elements, sparse-v2 range-coded
        elements) of one window, coded alone as the named encoding codes a tensor."""
        job, s = window
        itemsize = DTYPE_NBYTES[job.dtype]
        width = _width(job.new.nbytes, itemsize)
        a = s * WINDOW_ELEMENTS * width
        b = min(job.new.nbytes, a + WINDOW_ELEMENTS * width)
        old, new = job.snap.buf[a:b], job.new[a:b]
        enc = get_codec(encoding).encode(old, new, itemsize, self.level, job.name)
        if enc is None:
            return 0, 0, 0, 0
        passes, coded = v2_apply_work(enc.payload, b - a, job.name) if encoding == "sparse-v2" else (0, 0)
        return len(enc.payload), enc.changed_elements, passes, coded


def pick_windows(count: int, version: int, fraction: float) -> list[int]:
    """Every K-th of ``count`` windows from ``version mod K`` (K = 1 / fraction), at least
    ``MIN_WINDOWS`` of them (all when there are no more)."""
    if count <= MIN_WINDOWS:
        return list(range(count))
    stride = max(1, min(round(1 / fraction), count // MIN_WINDOWS))
    return list(range(version % stride, count, stride))


def v2_apply_work(payload: bytes, nbytes: int, tensor: str) -> tuple[int, int]:
    """(pass elements, coded elements) applying this sparse-v2 payload costs. Bitstream 2: a
    segment with several classes is read once for the magnitudes and once per class with
    changes; a one-class segment costs only its changes. Bitstream 3: the range decoder reads
    every element of a segment with changes once."""
    parsed = sparse_v2.parse(payload, nbytes, tensor)
    passes = coded = 0
    for seg in parsed.segments:
        if not seg.nchanged:
            continue
        if isinstance(seg, sparse_v2.CodedSegment):
            coded += seg.length
        elif len(seg.classes) > 1:
            passes += seg.length * (1 + sum(1 for c in seg.classes if c.changes))
    return passes, coded


def _elements(job: EncodeJob) -> int:
    """The tensor's elements as the sparse codecs count them (units of their element width)."""
    return job.new.nbytes // _width(job.new.nbytes, DTYPE_NBYTES[job.dtype])


def _window_count(job: EncodeJob) -> int:
    return -(-_elements(job) // WINDOW_ELEMENTS)


def _window_elements(job: EncodeJob, s: int) -> int:
    return min(WINDOW_ELEMENTS, _elements(job) - s * WINDOW_ELEMENTS)


def _chosen(name: str, value: float | None, knob: knobs.Knob) -> float:
    """The argument when given, else the knob's value; a number either way."""
    if value is None:
        return knob.get()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidKnobError(name, value, f"a number ({knob.help})") from None


def check_candidates() -> None:
    """Both candidates are registered codecs (the optional ones load on first use)."""
    for name in CANDIDATES:
        get_codec(name)


__all__ = ["AUTO", "Cost", "EncodingChoice", "EncodingChooser", "EncodingSample", "Estimate", "merge_samples", "pick_windows"]
