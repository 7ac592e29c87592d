"""Gather a Megatron model's weights as the HF checkpoint's tensors, on one source rank per PP stage.

Role: turn the trainer's sharded parameters into exactly the bytes ``--hf-checkpoint`` would hold
for them: all-gather tensor-parallel shards, gather experts over the expert-parallel group, map
names and layouts (``hf_mapping``), trim vocab padding, cast to the checkpoint's dtype (Megatron
keeps routers in fp32; the checkpoint usually does not), and copy into staging buffers that are
allocated once and reused every sync.

Invariants:
- Every rank runs the same collectives in the same order (parameters iterate in module order,
  identical across a TP/EP group); only source ranks (TP rank 0, DP rank 0, one per PP stage)
  keep results.
- A mismatch with the checkpoint (unknown name, shape, dtype, byte length, a tensor no stage
  emits) fails *every* rank with the same message, so no rank waits forever in a collective.
- A tensor two PP stages both emit (tied embeddings) is kept by the lower stage only, after
  checking the copies are identical: publishing it twice would apply an xor delta twice,
  reverting it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from weightsync import RawTensor
from weightsync.format.layout import INDEX_NAME, SINGLE_FILE_NAME
from weightsync.format.safetensors_io import local_tensor_table

from .hf_mapping import AttentionLayout, MappingError, expert_local_index, is_expert_param, to_hf, to_hf_names

log = logging.getLogger(__name__)

ST_TO_TORCH = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
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


def iter_params(model_chunks) -> list[ParamRef]:
    """Every parameter of this rank's model chunks with its global layer number."""
    refs = []
    for ci, chunk in enumerate(model_chunks):
        m = unwrap_model(chunk)
        layer_of = {}
        if getattr(m, "decoder", None) is not None:
            # layer_number is Megatron's 1-based *global* number: robust to uneven/virtual PP.
            layer_of = {i: layer.layer_number - 1 for i, layer in enumerate(m.decoder.layers)}
        for name, p in m.named_parameters():
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


class HFWeightGatherer:
    """Gathers HF tensors from Megatron model chunks into reused staging buffers.

    Args:
        model_chunks: this rank's model chunks (a list, as Megatron's virtual pipeline gives).
        hf_checkpoint: the local HF checkpoint dir; its tensors define the names, dtypes and
            shapes to emit.
        group: process group spanning every trainer rank (default: the world).
        parallel: the parallel layout (default: read from ``megatron.core.parallel_state``).
    """

    def __init__(self, model_chunks, hf_checkpoint: str, *, group=None, parallel: ParallelInfo | None = None):
        self.chunks = list(model_chunks)
        self.hf_checkpoint = hf_checkpoint
        self.group = group
        self.par = parallel or ParallelInfo.from_megatron()
        self.specs = read_hf_specs(hf_checkpoint)
        first = unwrap_model(self.chunks[0])
        self.config = first.config
        self.att = AttentionLayout.from_megatron_config(self.config)
        self.tied = bool(getattr(first, "share_embeddings_and_output_weights", False))
        self.num_local_experts = (self.config.num_moe_experts or 0) // max(1, self.par.ep_size)
        self.params = iter_params(self.chunks)
        self._staging: dict[str, torch.Tensor] = {}
        self.plan = self._make_plan()

    # --- planning (collective) --------------------------------------------------------------

    def _names_of(self, ref: ParamRef) -> list[str]:
        if is_expert_param(ref.name) and self.par.ep_size > 1:
            local = expert_local_index(ref.name)
            names = []
            for r in range(self.par.ep_size):
                names += to_hf_names(ref.name, self.att, global_layer=ref.global_layer,
                                     global_expert=r * self.num_local_experts + local, tied_embeddings=self.tied)
            return names
        expert = None
        if is_expert_param(ref.name):
            expert = expert_local_index(ref.name)
        return to_hf_names(ref.name, self.att, global_layer=ref.global_layer, global_expert=expert,
                           tied_embeddings=self.tied)

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

    def _make_plan(self) -> GatherPlan:
        error = None
        emitted: list[str] = []
        try:
            for ref in self.params:
                emitted += self._names_of(ref)
                error = error or self._qkv_layout_problem(ref)
            if self.tied and "lm_head.weight" in self.specs and "model.embed_tokens.weight" in emitted:
                emitted.append("lm_head.weight")  # a tied checkpoint that still stores lm_head
        except MappingError as e:
            error = str(e)
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
                            f"{' ...' if len(unknown) > 5 else ''} (wrong --hf-checkpoint or model type?)")
        missing = sorted(set(self.specs) - set(owner))
        if missing:
            problems.append(f"no pipeline stage emits these --hf-checkpoint tensors: {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''}; they would never be updated")
        if problems:
            raise GatherError("; ".join(problems))
        mine = per_rank[my_rank][2] if self.par.is_source else []
        owned = [n for n in dict.fromkeys(mine) if owner[n] == my_rank]
        dups = [n for n in dict.fromkeys(mine) if owner[n] != my_rank]
        src_index = [r for _, r in sources].index(my_rank) if self.par.is_source else -1
        shared = [n for n in dict.fromkeys(mine) if emitters[n] > 1]
        if dups:
            log.info("pipeline stage %d also emits %s; the lower stage publishes them", self.par.pp_rank, dups)
        return GatherPlan(owned, dups, shared, src_index, len(sources), self.par.is_source)

    # --- gathering (collective) -------------------------------------------------------------

    def _emit(self, ref: ParamRef) -> list[tuple[str, torch.Tensor]]:
        p = ref.param.detach()
        expert = is_expert_param(ref.name)
        group, size = (self.par.etp_group, self.par.etp_size) if expert else (self.par.tp_group, self.par.tp_size)
        split = bool(getattr(ref.param, "tensor_model_parallel", False)) and size > 1
        pdim = getattr(ref.param, "partition_dim", 0) if split else None
        shards = _all_gather(p, group, size) if split else [p]
        kw = dict(global_layer=ref.global_layer, tied_embeddings=self.tied)
        if not expert:
            return to_hf(ref.name, shards, pdim, self.att, **kw)
        local = expert_local_index(ref.name)
        if self.par.ep_size == 1:
            return to_hf(ref.name, shards, pdim, self.att, global_expert=local, **kw)
        # Every EP rank holds the same local expert slots: gather shard i of slot `local` from all.
        per_ep = [_all_gather(s, self.par.ep_group, self.par.ep_size) for s in shards]
        out = []
        for r in range(self.par.ep_size):
            out += to_hf(ref.name, [g[r] for g in per_ep], pdim, self.att,
                         global_expert=r * self.num_local_experts + local, **kw)
        return out

    def _stage(self, name: str, t: torch.Tensor, megatron_name: str) -> str | None:
        """Cast, trim, check and copy one HF tensor into its staging buffer; an error or None."""
        spec = self.specs.get(name)
        if spec is None:
            return f"{name} (from {megatron_name}) is not in --hf-checkpoint {self.hf_checkpoint}"
        dtype = ST_TO_TORCH.get(spec.dtype)
        if dtype is None:
            return f"{name}: checkpoint dtype {spec.dtype} is not supported by the gather"
        if megatron_name in _VOCAB_PARALLEL and t.shape[0] > spec.shape[0]:
            t = t[: spec.shape[0]]  # Megatron pads the vocab to a multiple of TP x 128
        if tuple(t.shape) != spec.shape:
            return (f"{name} (from {megatron_name}): gathered shape {list(t.shape)} != checkpoint shape "
                    f"{list(spec.shape)}; does the Megatron config match --hf-checkpoint?")
        buf = self._staging.get(name)
        if buf is None:
            buf = torch.empty(spec.shape, dtype=dtype, device="cpu")
            self._staging[name] = buf
        buf.copy_(t)  # casts (e.g. an fp32 router to the checkpoint's bf16) and moves to host
        nbytes = buf.numel() * buf.element_size()
        if buf.dtype != dtype or nbytes != spec.nbytes:
            return f"{name}: staged {buf.dtype} with {nbytes} bytes, checkpoint has {spec.dtype} with {spec.nbytes}"
        return None

    def gather(self) -> dict[str, RawTensor]:
        """Collective: this source rank's owned HF tensors as RawTensors ({} on other ranks).

        The returned buffers are the staging buffers: valid until the next ``gather``.

        Raises:
            GatherError: on every rank, when any rank's tensors disagree with the checkpoint or
                tied copies differ between pipeline stages.
        """
        error = None
        emitted: set[str] = set()
        for ref in self.params:
            pairs = self._emit(ref)  # collectives: every rank, always
            if not self.par.is_source or error:
                continue
            for name, t in pairs:
                error = self._stage(name, t, ref.name)
                if error:
                    break
                emitted.add(name)
                if self.tied and name == "model.embed_tokens.weight" and "lm_head.weight" in self.specs:
                    error = self._stage("lm_head.weight", t, ref.name)
                    emitted.add("lm_head.weight")
        all_ranks_ok(error, self.group)
        self._check_duplicates()
        return {n: self._raw(n) for n in self.plan.owned}

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

    from .hf_mapping import from_hf, shard_for_rank

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
    n_local = (first.config.num_moe_experts or 0) // max(1, par.ep_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    hf = _Lazy()
    with torch.no_grad():
        for ref in iter_params(model_chunks):
            expert = is_expert_param(ref.name)
            local = expert_local_index(ref.name) if expert else None
            gexp = None if local is None else par.ep_rank * n_local + local
            full = from_hf(ref.name, hf, att, global_layer=ref.global_layer, global_expert=gexp, tied_embeddings=tied)
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
