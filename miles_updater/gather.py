"""Gather a Megatron model's weights as the HF checkpoint's tensors, on one source rank per PP stage.

Role: turn the trainer's sharded parameters into exactly the bytes ``--hf-checkpoint`` would hold
for them: all-gather tensor-parallel shards into full TP=1 tensors, gather experts over the
expert-parallel group, hand each to the converter (``converters``: our ``hf_mapping`` or the
trainer's own) under its global Megatron name, trim vocab padding, cast float to float into the
checkpoint's dtype (Megatron keeps routers in fp32; the checkpoint usually does not; never into
FP8/int), and copy into staging buffers that are allocated once and reused every sync.

Invariants:
- Every rank runs the same collectives in the same order (parameters iterate in module order,
  identical across a TP/EP group); only source ranks (TP rank 0, DP rank 0, one per PP stage)
  keep results.
- A mismatch with the checkpoint (unknown name, shape, dtype, byte length, a tensor no stage
  emits), a converter that raises, or one that emits a name twice or not at all in a gather (a
  half-emitted pair) fails *every* rank with the same message, so no rank waits forever in a
  collective; the next gather starts clean (``reset()``, staging overwritten).
- Every checkpoint tensor is published exactly once per version: by the lowest stage that emits
  it, or, for those listed static, with the seed's bytes by the first source rank.
- A tensor two PP stages both emit (tied embeddings) is kept by the lower stage only, after
  checking the copies are identical: publishing it twice would apply an xor delta twice,
  reverting it.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from weightsync import RawTensor
from weightsync.format.layout import INDEX_NAME, SINGLE_FILE_NAME
from weightsync.format.safetensors_io import local_tensor_table

from .converters import MegatronToHF, converter_label, hf_model_type, resolve_converter
from .hf_mapping import AttentionLayout, expert_local_index, is_expert_param

log = logging.getLogger(__name__)

ST_TO_TORCH = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
# Quantized checkpoint dtypes: a tensor must arrive in exactly this dtype (with its scales); the gather
# never casts into them (a cast would not quantize, it would publish wrong values).
_NO_CAST = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


class GatherError(RuntimeError):
    """The gathered weights do not match ``--hf-checkpoint``; raised on every rank together."""


@dataclass(frozen=True)
class HFTensorSpec:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_hf_specs(hf_dir: str) -> dict[str, HFTensorSpec]:
    """Name -> dtype/shape/byte length of every tensor of an HF safetensors checkpoint."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(hf_dir, SINGLE_FILE_NAME)):
        files = [SINGLE_FILE_NAME]
    else:
        raise GatherError(f"--hf-checkpoint {hf_dir} has neither {INDEX_NAME} nor {SINGLE_FILE_NAME}")
    return {
        name: HFTensorSpec(entry.dtype, tuple(entry.shape), entry.nbytes)
        for name, (_, entry) in local_tensor_table(hf_dir, files).items()
    }


def _weight_files(hf_dir: str, names) -> dict[str, list[str]]:
    """File -> the given tensor names it holds, for an indexed or single-file checkpoint."""
    index = os.path.join(hf_dir, INDEX_NAME)
    where: dict[str, list[str]] = {}
    weight_map = None
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    for n in names:
        where.setdefault(weight_map[n] if weight_map else SINGLE_FILE_NAME, []).append(n)
    return where


def unwrap_model(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@dataclass(frozen=True)
class ParamRef:
    chunk: int
    name: str  # inside the chunk, chunk-local layer numbers
    param: torch.Tensor
    global_layer: int | None


_EXPERT_LOCAL_RE = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_EXPERT_GROUPED_RE = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_FC1_RE = re.compile(r"linear_fc1\.(weight|bias)\d*$")
# Buffers that are checkpoint tensors (the rest, e.g. token counters, are training state).
_CHECKPOINT_BUFFERS = (".mlp.router.expert_bias",)


def global_name(ref: ParamRef, global_expert: int | None = None) -> str:
    """The converter contract's name: global layer number, routed experts as ``…weight{global expert}``."""
    name = ref.name
    if ref.global_layer is not None and name.startswith("decoder.layers."):
        _, _, _, rest = name.split(".", 3)
        name = f"decoder.layers.{ref.global_layer}.{rest}"
    m = _EXPERT_LOCAL_RE.match(name)
    if m:
        prefix, local, fc, kind = m.groups()
        return f"{prefix}{fc}.{kind}{local if global_expert is None else global_expert}"
    m = _EXPERT_GROUPED_RE.match(name)
    if m:
        prefix, fc, kind, local = m.groups()
        return f"{prefix}{fc}.{kind}{local if global_expert is None else global_expert}"
    return name


def iter_params(model_chunks) -> list[ParamRef]:
    """Every parameter of this rank's model chunks, and the buffers that are checkpoint tensors
    (routers' ``expert_bias``), with their global layer numbers, in module order."""
    refs = []
    for ci, chunk in enumerate(model_chunks):
        m = unwrap_model(chunk)
        layer_of = {}
        if getattr(m, "decoder", None) is not None:
            # layer_number is Megatron's 1-based *global* number: robust to uneven/virtual PP.
            layer_of = {i: layer.layer_number - 1 for i, layer in enumerate(m.decoder.layers)}
        tensors = list(m.named_parameters())
        tensors += [(n, b) for n, b in m.named_buffers() if b is not None and n.endswith(_CHECKPOINT_BUFFERS)]
        for name, p in tensors:
            gl = None
            if name.startswith("decoder.layers."):
                gl = layer_of[int(name.split(".")[2])]
            refs.append(ParamRef(ci, name, p, gl))
    return refs


@dataclass
class ParallelInfo:
    tp_group: object
    tp_size: int
    etp_group: object
    etp_size: int
    ep_group: object
    ep_size: int
    ep_rank: int
    pp_rank: int
    is_source: bool

    @classmethod
    def from_megatron(cls) -> "ParallelInfo":
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep_group=ps.get_expert_model_parallel_group(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            is_source=(tp_rank == 0 and dp_rank == 0),
        )


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


def all_ranks_ok(error: str | None, group=None) -> None:
    """Raise GatherError on every rank if any rank reports an error (a collective)."""
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        msg = "; ".join(f"rank {r}: {e}" for r, e in bad[:5])
        raise GatherError(f"weight gather failed on {len(bad)} rank(s): {msg}")


@dataclass
class GatherPlan:
    """Which HF tensors this rank emits and keeps (static for a model; computed once)."""

    owned: list[str]  # names this source rank publishes (after PP de-duplication)
    duplicates: list[str]  # names this rank also emits but a lower stage owns
    shared: list[str]  # names this rank emits that another source rank emits too
    source_rank: int  # index among source ranks (the Publisher rank)
    num_sources: int
    is_source: bool
    emitted: list[str] = field(default_factory=list)  # every name this rank's converter emits, once each
    static: list[str] = field(default_factory=list)  # seed tensors this rank publishes unchanged


class HFWeightGatherer:
    """Gathers HF tensors from Megatron model chunks into reused staging buffers.

    Args:
        model_chunks: this rank's model chunks (a list, as Megatron's virtual pipeline gives).
        hf_checkpoint: the local HF checkpoint dir; its tensors define the names, dtypes and
            shapes to emit.
        group: process group spanning every trainer rank (default: the world).
        parallel: the parallel layout (default: read from ``megatron.core.parallel_state``).
        converter: ``None``/``"builtin"`` (``hf_mapping``), ``"trainer"`` (miles' or slime's
            ``convert_to_hf``), ``"pkg.mod.fn"`` (``fn(args)`` returns one) or a converter
            (``converters.MegatronToHF``).
        args: the trainer's args (what ``trainer`` and ``pkg.mod.fn`` converters are bound with).
        static_tensors: names or ``fnmatch`` patterns of checkpoint tensors the trainer does not
            train (a vision tower, MTP layers trained elsewhere): published with the seed's bytes.
    """

    def __init__(self, model_chunks, hf_checkpoint: str, *, group=None, parallel: ParallelInfo | None = None,
                 converter: str | MegatronToHF | None = None, args=None, static_tensors=()):
        self.chunks = list(model_chunks)
        self.hf_checkpoint = hf_checkpoint
        self.group = group
        self.par = parallel or ParallelInfo.from_megatron()
        self.specs = read_hf_specs(hf_checkpoint)
        first = unwrap_model(self.chunks[0])
        self.config = first.config
        self.att = AttentionLayout.from_megatron_config(self.config)
        self.tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
        self.gated = bool(getattr(self.config, "gated_linear_unit", False))
        self.num_local_experts = (self.config.num_moe_experts or 0) // max(1, self.par.ep_size)
        self.params = iter_params(self.chunks)
        self.static_patterns = tuple(static_tensors or ())
        self._staging: dict[str, torch.Tensor] = {}
        self.converter = None
        error = None
        try:
            self.converter = resolve_converter(converter, args=args, hf_checkpoint=hf_checkpoint, att=self.att,
                                               tied_embeddings=self.tied, num_layers=self.config.num_layers)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"binding the converter {converter!r}: {type(e).__name__}: {e}"
        all_ranks_ok(error, self.group)
        self.converter_name = converter_label(self.converter)
        self._lm_head_copy = False
        self.plan = self._make_plan()

    # --- the converter, its names, and the full tensors it gets ------------------------------

    def _hf_name(self, hf: str, megatron: str) -> str:
        """A converter's ``lm_head.weight`` from a tied model's ``output_layer`` is the embedding when the
        checkpoint ties them (no ``lm_head.weight``): the last stage's copy, de-duplicated by digest."""
        if hf == "lm_head.weight" and self.tied and megatron == "output_layer.weight" and hf not in self.specs:
            return "model.embed_tokens.weight"
        return hf

    def _convert(self, megatron: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self._hf_name(n, megatron), t) for n, t in self.converter(megatron, full)]

    def _reset_converter(self) -> None:
        reset = getattr(self.converter, "reset", None)
        if callable(reset):
            reset()

    def _split(self, ref: ParamRef) -> tuple[object, int, int | None, bool]:
        """(group, size, partition dim or None, expert) of a parameter's tensor-parallel split."""
        expert = is_expert_param(ref.name)
        group, size = (self.par.etp_group, self.par.etp_size) if expert else (self.par.tp_group, self.par.tp_size)
        split = bool(getattr(ref.param, "tensor_model_parallel", False)) and size > 1
        return group, size, (getattr(ref.param, "partition_dim", 0) if split else None), expert

    def _merge(self, ref: ParamRef, shards: list[torch.Tensor], pdim: int | None) -> torch.Tensor:
        """The TP=1 tensor from rank-ordered shards: a gated fc1 holds [gate; up] per shard, so the
        full one is [every rank's gate; every rank's up]."""
        if pdim is None or len(shards) == 1:
            return shards[0]
        if self.gated and _FC1_RE.search(ref.name):
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=pdim)

    def _full_names(self, ref: ParamRef) -> list[str]:
        """The global names this parameter stands for (every EP rank's experts for an expert slot)."""
        if not is_expert_param(ref.name):
            return [global_name(ref)]
        local = expert_local_index(ref.name)
        if local is None:
            return [global_name(ref)]
        return [global_name(ref, r * self.num_local_experts + local) for r in range(self.par.ep_size)]

    def _full_tensors(self, ref: ParamRef) -> list[tuple[str, torch.Tensor]]:
        """Collective (every rank, same order): the parameter's full tensors under their global names."""
        group, size, pdim, expert = self._split(ref)
        p = ref.param.detach()
        shards = _all_gather(p, group, size) if pdim is not None else [p]
        names = self._full_names(ref)
        if not expert or len(names) == 1:
            # only source ranks convert: the others join the collective and skip the concatenation
            return [(names[0], self._merge(ref, shards, pdim) if self.par.is_source else p)]
        full = self._merge(ref, shards, pdim)
        # Every EP rank holds the same local expert slots: slot `local` of EP rank r is global r*n_local+local.
        return list(zip(names, _all_gather(full, self.par.ep_group, self.par.ep_size)))

    def _meta_tensors(self, ref: ParamRef) -> list[tuple[str, torch.Tensor]]:
        """The same names with storage-free tensors of the full shapes (planning without data)."""
        _, size, pdim, _ = self._split(ref)
        shape = list(ref.param.shape)
        if pdim is not None:
            shape[pdim] *= size
        return [(n, torch.empty(shape, dtype=ref.param.dtype, device="meta")) for n in self._full_names(ref)]

    # --- planning (collective) --------------------------------------------------------------

    def _qkv_layout_problem(self, ref: ParamRef) -> str | None:
        """Why ``linear_qkv``'s TP shards cannot hold the attention layout (checked once, at start-up)."""
        if not ref.name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
            return None
        att = self.att
        split = bool(getattr(ref.param, "tensor_model_parallel", False)) and self.par.tp_size > 1
        rows = ref.param.shape[0] * (self.par.tp_size if split else 1)
        expected = att.num_query_groups * (att.q_per_group + 2) * att.head_dim
        if att.num_attention_heads % att.num_query_groups == 0 and rows == expected:
            return None
        return (f"{ref.name}: {self.par.tp_size} tensor-parallel shard(s) of {ref.param.shape[0]} rows hold {rows} "
                f"rows, but the layout ({att.describe()}) needs {expected}; the Megatron config does not match "
                f"--hf-checkpoint {self.hf_checkpoint}")

    def _names_by_converting(self, on_meta: bool) -> list[str]:
        """Every HF name this rank's converter emits, in order (a real pass runs the collectives)."""
        self._reset_converter()
        emitted: list[str] = []
        for ref in self.params:
            fulls = self._meta_tensors(ref) if on_meta else self._full_tensors(ref)
            if not self.par.is_source:
                continue
            for megatron, t in fulls:
                emitted += [n for n, _ in self._convert(megatron, t)]
        self._reset_converter()
        return emitted

    def _plan_names(self) -> list[str]:
        """This rank's emitted names: from storage-free tensors, or, when the converter cannot run on
        them (on any rank: a quantizing kernel), from one real gather that every rank joins."""
        error = None
        for ref in self.params:
            error = error or self._qkv_layout_problem(ref)
        all_ranks_ok(error, self.group)
        emitted, meta_error = [], None
        try:
            emitted = self._names_by_converting(on_meta=True)
        except Exception as e:  # noqa: BLE001 - decided together below
            meta_error = f"{type(e).__name__}: {e}"
        world = dist.get_world_size(self.group)
        errors: list = [None] * world
        dist.all_gather_object(errors, meta_error, group=self.group)
        if any(errors):
            log.info("converter %s cannot plan on storage-free tensors (%s); planning from a real gather",
                     self.converter_name, next(e for e in errors if e))
            error = None
            try:
                emitted = self._names_by_converting(on_meta=False)
            except Exception as e:  # noqa: BLE001 - a converter failing on real data: every rank raises
                error = f"converter {self.converter_name} failed while planning: {type(e).__name__}: {e}"
            all_ranks_ok(error, self.group)
        return emitted

    def _make_plan(self) -> GatherPlan:
        emitted = self._plan_names()
        error = None
        twice = sorted({n for n in emitted if emitted.count(n) > 1})
        if twice:
            error = (f"converter {self.converter_name} emits {twice[:5]} more than once per gather; each checkpoint "
                     f"tensor must come from exactly one Megatron parameter")
        if self.tied and "lm_head.weight" in self.specs and "model.embed_tokens.weight" in emitted \
                and "lm_head.weight" not in emitted:
            self._lm_head_copy = True  # a tied checkpoint that still stores lm_head
            emitted.append("lm_head.weight")
        all_ranks_ok(error, self.group)
        world = dist.get_world_size(self.group)
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, (self.par.is_source, self.par.pp_rank, emitted), group=self.group)
        sources = sorted((pp, r) for r, (src, pp, _) in enumerate(per_rank) if src)
        my_rank = dist.get_rank(self.group)
        owner: dict[str, int] = {}
        emitters: dict[str, int] = {}
        for _, r in sources:
            for n in dict.fromkeys(per_rank[r][2]):
                owner.setdefault(n, r)
                emitters[n] = emitters.get(n, 0) + 1
        problems = []
        unknown = sorted(set(owner) - set(self.specs))
        if unknown:
            problems.append(f"the model emits tensors --hf-checkpoint lacks: {unknown[:5]}"
                            f"{' ...' if len(unknown) > 5 else ''} (wrong --hf-checkpoint or model type?"
                            f"{self._lm_head_hint(unknown)} converter: {self.converter_name})")
        missing = sorted(set(self.specs) - set(owner))
        static = [n for n in missing if any(fnmatch.fnmatchcase(n, p) for p in self.static_patterns)]
        missing = [n for n in missing if n not in static]
        if missing:
            problems.append(f"no pipeline stage emits these --hf-checkpoint tensors: {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''}; they would never be updated (converter "
                            f"{self.converter_name}; list tensors the trainer does not train with "
                            f"--update-weight-static-tensors)")
        if problems:
            raise GatherError("; ".join(problems))
        first_source = sources[0][1]
        mine_static = static if my_rank == first_source else []
        if static and my_rank == 0:
            log.warning("%d checkpoint tensor(s) no Megatron parameter produces keep the seed's bytes in every "
                        "version (--update-weight-static-tensors): %s", len(static), static)
        mine = per_rank[my_rank][2] if self.par.is_source else []
        owned = [n for n in dict.fromkeys(mine) if owner[n] == my_rank] + mine_static
        dups = [n for n in dict.fromkeys(mine) if owner[n] != my_rank]
        src_index = [r for _, r in sources].index(my_rank) if self.par.is_source else -1
        shared = [n for n in dict.fromkeys(mine) if emitters[n] > 1]
        if dups:
            log.info("pipeline stage %d also emits %s; the lower stage publishes them", self.par.pp_rank, dups)
        return GatherPlan(owned, dups, shared, src_index, len(sources), self.par.is_source,
                          emitted=list(dict.fromkeys(mine)), static=mine_static)

    def _lm_head_hint(self, unknown: list[str]) -> str:
        if "lm_head.weight" in unknown and "model.embed_tokens.weight" in self.specs:
            return (" --hf-checkpoint ties its embeddings (it stores no lm_head.weight): only a tied Megatron "
                    "model's output_layer.weight may map to lm_head.weight, and it is published as "
                    "model.embed_tokens.weight;")
        return ""

    # --- gathering (collective) -------------------------------------------------------------

    def _stage(self, name: str, t: torch.Tensor, megatron_name: str) -> str | None:
        """Trim, check, cast and copy one HF tensor into its staging buffer; an error or None."""
        spec = self.specs.get(name)
        if spec is None:
            return (f"{name} (from {megatron_name}, converter {self.converter_name}) is not in --hf-checkpoint "
                    f"{self.hf_checkpoint}{self._lm_head_hint([name])}")
        dtype = ST_TO_TORCH.get(spec.dtype)
        if dtype is None:
            return f"{name}: checkpoint dtype {spec.dtype} is not supported by the gather"
        if spec.dtype in _NO_CAST and t.dtype != dtype:
            return (f"{name} (from {megatron_name}): converter {self.converter_name} gave {t.dtype} for a "
                    f"{spec.dtype} checkpoint tensor; quantized tensors must arrive in the checkpoint's dtype "
                    f"with their scales (the gather never casts into {spec.dtype})")
        if megatron_name in _VOCAB_PARALLEL and t.dim() and t.shape[0] > spec.shape[0]:
            t = t[: spec.shape[0]]  # Megatron pads the vocab to a multiple of TP x 128
        if tuple(t.shape) != spec.shape:
            return (f"{name} (from {megatron_name}, converter {self.converter_name}): gathered shape "
                    f"{list(t.shape)} != checkpoint shape {list(spec.shape)}; does the Megatron config match "
                    f"--hf-checkpoint?")
        buf = self._staging.get(name)
        if buf is None:
            buf = torch.empty(spec.shape, dtype=dtype, device="cpu")
            self._staging[name] = buf
        buf.copy_(t)  # casts (e.g. an fp32 router to the checkpoint's bf16) and moves to host
        nbytes = buf.numel() * buf.element_size()
        if buf.dtype != dtype or nbytes != spec.nbytes:
            return f"{name}: staged {buf.dtype} with {nbytes} bytes, checkpoint has {spec.dtype} with {spec.nbytes}"
        return None

    def _stage_emitted(self, megatron: str, full: torch.Tensor, seen: dict[str, str]) -> str | None:
        """Convert one full tensor and stage its outputs, checking each name is planned and new."""
        for name, t in self._convert(megatron, full):
            if name in seen:
                return (f"{name} emitted twice in one gather by converter {self.converter_name} (from {seen[name]} "
                        f"and from {megatron})")
            if name in self.specs and name not in self._planned:
                return (f"{name} (from {megatron}): converter {self.converter_name} emitted a tensor it did not "
                        f"emit when planning; a converter must emit the same names every gather")
            error = self._stage(name, t, megatron)
            if error:
                return error
            seen[name] = megatron
            if self._lm_head_copy and name == "model.embed_tokens.weight":
                error = self._stage("lm_head.weight", t, megatron)
                seen["lm_head.weight"] = megatron
                if error:
                    return error
        return None

    @property
    def _planned(self) -> set[str]:
        planned = getattr(self, "_planned_set", None)
        if planned is None:
            planned = self._planned_set = set(self.plan.emitted)
        return planned

    def gather(self) -> dict[str, RawTensor]:
        """Collective: this source rank's owned HF tensors as RawTensors ({} on other ranks).

        The returned buffers are the staging buffers: valid until the next ``gather``.

        Raises:
            GatherError: on every rank, when any rank's converter raised or its tensors disagree with
                the checkpoint (a name unknown, twice or never emitted, a shape, a dtype), or tied copies
                differ between pipeline stages.
        """
        error = None
        seen: dict[str, str] = {}
        if self.par.is_source:
            try:
                self._reset_converter()
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"converter {self.converter_name}.reset() raised {type(e).__name__}: {e}"
        for ref in self.params:
            fulls = self._full_tensors(ref)  # collectives: every rank, always
            if not self.par.is_source or error:
                continue
            for megatron, full in fulls:
                try:
                    error = self._stage_emitted(megatron, full, seen)
                except Exception as e:  # noqa: BLE001 - the converter's own failure, on this rank only
                    error = f"converter {self.converter_name} raised on {megatron}: {type(e).__name__}: {e}"
                if error:
                    break
        if self.par.is_source and not error:
            never = [n for n in self.plan.emitted if n not in seen]
            if never:
                error = (f"converter {self.converter_name} never emitted {never[:5]} in this gather (it did when "
                         f"planning): a tensor it holds back until its partner arrives was left half-emitted?")
        if self.par.is_source and not error and self.plan.static:
            error = self._stage_static()
        all_ranks_ok(error, self.group)
        self._check_duplicates()
        return {n: self._raw(n) for n in self.plan.owned}

    def _stage_static(self) -> str | None:
        """The seed's bytes of the tensors the trainer does not train (read once, then kept)."""
        todo = [n for n in self.plan.static if n not in self._staging]
        if not todo:
            return None
        from safetensors import safe_open

        try:
            where = _weight_files(self.hf_checkpoint, todo)
            for fname, names in where.items():
                with safe_open(os.path.join(self.hf_checkpoint, fname), framework="pt") as f:
                    for n in names:
                        spec = self.specs[n]
                        buf = torch.empty(spec.shape, dtype=ST_TO_TORCH[spec.dtype])
                        buf.copy_(f.get_tensor(n))
                        self._staging[n] = buf
        except Exception as e:  # noqa: BLE001 - reported on every rank
            return f"reading the static tensors from {self.hf_checkpoint}: {type(e).__name__}: {e}"
        return None

    def _raw(self, name: str) -> RawTensor:
        spec = self.specs[name]
        buf = self._staging[name]
        data = buf.view(-1).view(torch.uint8).numpy() if buf.numel() else np.empty(0, np.uint8)
        return RawTensor(spec.dtype, spec.shape, data)

    def _check_duplicates(self) -> None:
        """Tensors two stages emit must be identical; compare digests, fail every rank if not."""
        import xxhash

        digests = {n: xxhash.xxh3_128_hexdigest(self._raw(n).data) for n in self.plan.shared}
        world = dist.get_world_size(self.group)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, digests, group=self.group)
        seen: dict[str, tuple[int, str]] = {}
        differ = []
        for r, d in enumerate(everyone):
            for n, h in (d or {}).items():
                if n in seen and seen[n][1] != h:
                    differ.append(f"{n} (rank {seen[n][0]} vs rank {r})")
                seen.setdefault(n, (r, h))
        if differ:
            raise GatherError(
                f"tensors emitted by two pipeline stages differ: {differ[:5]}; tied embeddings must be "
                f"kept identical across stages (is the embedding-group all-reduce running?)")

    def owned_tensors(self) -> dict[str, RawTensor]:
        """The tensors this rank published last (its staging buffers; {} before the first gather)."""
        return {n: self._raw(n) for n in self.plan.owned if n in self._staging}

    def staging_nbytes(self) -> int:
        """Host bytes held by the staging buffers (allocated on the first gather, then reused)."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())


def load_hf_checkpoint(model_chunks, hf_dir: str, parallel: ParallelInfo | None = None) -> None:
    """Copy an HF checkpoint's tensors into this rank's Megatron parameters (the inverse mapping).

    Each rank reads only the tensors its own shards need (lazily, with safetensors' mmap).
    """
    from safetensors import safe_open

    from .hf_mapping import from_hf, mtp_names, shard_for_rank

    from megatron.core import parallel_state as ps

    par = parallel or ParallelInfo.from_megatron()
    specs = read_hf_specs(hf_dir)
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        where = {n: SINGLE_FILE_NAME for n in specs}
    handles: dict[str, object] = {}

    class _Lazy(dict):
        def __missing__(self, name):
            fname = where[name]
            if fname not in handles:
                handles[fname] = safe_open(os.path.join(hf_dir, fname), framework="pt")
            return handles[fname].get_tensor(name)

    first = unwrap_model(model_chunks[0])
    att = AttentionLayout.from_megatron_config(first.config)
    tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
    family = hf_model_type(hf_dir)
    n_local = (first.config.num_moe_experts or 0) // max(1, par.ep_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    hf = _Lazy()
    with torch.no_grad():
        for ref in iter_params(model_chunks):
            name, global_layer = ref.name, ref.global_layer
            decoder, own = mtp_names(name, first.config.num_layers)  # MTP: HF layer num_layers + i
            if own is not None:
                full = hf[own]
            else:
                if decoder is not None:
                    name, global_layer = decoder, None
                expert = is_expert_param(name)
                local = expert_local_index(name) if expert else None
                gexp = None if local is None else par.ep_rank * n_local + local
                full = from_hf(name, hf, att, global_layer=global_layer, global_expert=gexp, tied_embeddings=tied,
                               family=family)
            expert = is_expert_param(ref.name)
            split = bool(getattr(ref.param, "tensor_model_parallel", False))
            pdim = getattr(ref.param, "partition_dim", 0) if split else None
            size, rank = (par.etp_size, etp_rank) if expert else (par.tp_size, tp_rank)
            if ref.name in _VOCAB_PARALLEL and full.shape[0] < ref.param.shape[0] * (size if split else 1):
                pad = ref.param.shape[0] * (size if split else 1) - full.shape[0]
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
            shard = shard_for_rank(ref.name, full, pdim, rank, size)
            if tuple(shard.shape) != tuple(ref.param.shape):
                raise GatherError(f"{ref.name}: checkpoint gives shape {list(shard.shape)} for a parameter of "
                                  f"shape {list(ref.param.shape)}; the Megatron config does not match {hf_dir}")
            ref.param.data.copy_(shard)
