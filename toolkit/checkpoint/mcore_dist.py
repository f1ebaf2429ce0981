"""megatron-core distributed checkpoints (``torch_dist``), read and written offline.

Format facts (checked against megatron-core 0.16.1 and torch 2.13):
- A checkpoint folder holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``),
  ``common.pt`` (the non-sharded part, ``torch.save``) and PyTorch DCP files: ``.metadata``
  (a pickled ``torch.distributed.checkpoint.metadata.Metadata``) plus ``__R_I.distcp`` data
  files in which each chunk is a ``torch.save``d tensor (or raw bytes for objects).
- ``GPTModel.sharded_state_dict()`` keys are layout independent: layers are stacked along a
  leading axis (``decoder.layers.self_attention.linear_qkv.weight`` has global shape
  ``(L, out, in)``), experts along a second one (``decoder.layers.mlp.experts.experts.*``,
  ``(L, E, ...)``); norms use TE-style names from the layer spec's
  ``sharded_state_dict_keys_map`` (``KEYS_MAP``: ``input_layernorm.weight`` ->
  ``self_attention.linear_qkv.layer_norm_weight``). The global tensor of a key is the tp=1
  tensor (SwiGLU ``linear_fc1`` is ``[gate; up]``), so the tp=1 megatron tensor of layer i is
  slice i. Vocab tensors keep the padding they were saved with (global shape = padded vocab).
- Each linear module has an ``_extra_state`` ShardedObject (key ``<module>._extra_state/shard_
  <offsets>_<axes>``); the local spec stores ``[None]`` there. A tied output layer is not stored.

Megatron-LM's ``--load`` wants ``latest_checkpointed_iteration.txt`` next to ``iter_XXXXXXX/``
(or ``release/``); ``common.pt`` holds ``args``, ``checkpoint_version`` and ``iteration``.
mdtk also stores the HF config (and tokenizer files) in ``hf_config/`` at the root, so its
checkpoints convert back without extra arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats
from toolkit.checkpoint.canonical import McoreFullSource, local_segments, local_tensor
from toolkit.checkpoint.hf import GENERATION_CONFIG, TOKENIZER_FILES, config_json
from toolkit.checkpoint.pipeline import read_ahead
from toolkit.checkpoint.torchfree import dcp_pickle, dtypes, torch_record
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.checkpoint.torchfree.safe_load import load_dcp_metadata, load_plain, load_torch
from toolkit.checkpoint.torchfree.segments import merge, will_need
from toolkit.lazy import torch
from toolkit.mapping import EXPERTS

FORMAT = "mcore"
TRACKER = "latest_checkpointed_iteration.txt"
HF_CONFIG_DIR = "hf_config"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
CHECKPOINT_VERSION = 3.0
_LINEAR = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_q_proj"
                     r"|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj"
                     r"|linear_kv_up_proj)\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(rf"^{re.escape(EXPERTS)}\.(\d+)\.(.*)$")


# -- Megatron-LM folder layout (shared with the legacy format) ------------------------------------

def iteration_dir_name(iteration: int | None) -> str:
    return "release" if not iteration else f"iter_{iteration:07d}"


def checkpoint_dir(path: Path, marker: Callable[[Path], bool]) -> tuple[Path, int | None]:
    """The iteration folder of a Megatron-LM checkpoint root (or the folder itself) + iteration.

    ``marker(folder)`` says whether a folder holds the format's files.
    """
    path = Path(path)
    if marker(path):
        m = re.fullmatch(r"iter_(\d+)", path.name)
        return path, int(m.group(1)) if m else None
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            sub, iteration = path / "release", None
        elif text.isdigit():
            sub, iteration = path / iteration_dir_name(int(text)), int(text)
        else:
            raise CheckpointError(f"{tracker} holds {text!r}: expected an iteration number or "
                                  "'release'.")
        if not sub.is_dir():
            raise CheckpointError(f"{tracker} points to {sub.name}, which does not exist.")
        if not marker(sub):
            raise CheckpointError(f"{sub} does not hold the checkpoint files {TRACKER} promises.")
        return sub, iteration
    raise CheckpointError(f"{path}: not a Megatron checkpoint folder (no {TRACKER}).")


def write_tracker(root: Path, iteration: int | None) -> Path:
    """Create ``root/<iteration dir>`` and the tracker file Megatron-LM reads; returns the dir."""
    sub = root / iteration_dir_name(iteration)
    sub.mkdir(parents=True, exist_ok=True)
    (root / TRACKER).write_text("release" if not iteration else str(iteration))
    return sub


def find_hf_config(path: Path) -> Path | None:
    """The ``hf_config/`` folder mdtk stores at a checkpoint root (looked up from a sub-folder)."""
    for p in (path, *list(path.parents)[:2]):
        if (p / HF_CONFIG_DIR / "config.json").is_file():
            return p / HF_CONFIG_DIR
    return None


def save_hf_config(adapter: Any, root: Path, dtype: torch.dtype) -> None:
    """config.json (+ tokenizer files) of the model, so the checkpoint describes itself.

    config.json is the adapter's HF config as JSON with the dtype of the weights
    (``hf.config_json``: no transformers import).
    """
    import shutil

    out = root / HF_CONFIG_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config_json(adapter.hf_config, dtype))
    src = adapter.source
    if src is not None:
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)


#: Megatron-LM's own defaults (``megatron/training/arguments.py``, core_v0.16.1) for the model
#: arguments its loaders read (``load_args_from_checkpoint``, ``check_checkpoint_args``,
#: ``tools/checkpoint``) that a model may leave unset; the model's values go on top.
MEGATRON_LM_DEFAULTS: dict[str, Any] = {
    "add_position_embedding": True, "use_rotary_position_embeddings": False,
    "rotary_base": 10000, "rotary_percent": 1.0, "rotary_interleaved": False,
    "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False,
    "rope_scaling_factor": 8.0, "squared_relu": False, "apply_layernorm_1p": False,
    "apply_query_key_layer_scaling": False, "qk_layernorm": False, "attention_dropout": 0.1,
    "hidden_dropout": 0.1, "window_size": None, "window_attn_skip_freq": None,
    "num_experts": None, "moe_layer_freq": 1, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather", "moe_router_pre_softmax": False,
    "moe_grouped_gemm": False, "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
    "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
    "moe_input_jitter_eps": None, "spec": None, "hybrid_override_pattern": None,
    "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0, "is_hybrid_model": False,
    "tokenizer_type": "HuggingFaceTokenizer", "consumed_train_samples": 0,
    "consumed_valid_samples": 0, "finetune": False,
}

#: ``transformer_kwargs`` / ``model_kwargs`` names whose Megatron-LM argument is named otherwise.
_ARG_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu",
              "max_sequence_length": "max_position_embeddings",
              "rope_scaling": "use_rope_scaling",
              "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor"}


def megatron_args(adapter: Any, layout: Any, padded_vocab: int, iteration: int | None,
                  ckpt_format: str, dtype: torch.dtype, tokenizer_model: str | None = None
                  ) -> argparse.Namespace:
    """The run arguments Megatron-LM writes for this model, so that its ``--load`` (with or
    without ``--use-checkpoint-args``) and ``tools/checkpoint`` loaders build the same model.

    The vocab is padded to a multiple of ``make_vocab_size_divisible_by x tp`` (Megatron-LM
    stores the multiple without tp); no rng or optimizer state is written, which
    ``no_save_rng`` / ``no_save_optim`` declare so that a plain ``--load`` skips them.
    """
    d = adapter.dims
    hf = adapter.hf_config
    out = dict(MEGATRON_LM_DEFAULTS)
    for k, v in {**adapter.family.transformer_kwargs(hf),
                 **adapter.family.model_kwargs(hf)}.items():
        out[_ARG_NAMES.get(k, k)] = v
    if isinstance(out["rotary_base"], float) and out["rotary_base"].is_integer():
        out["rotary_base"] = int(out["rotary_base"])  # Megatron-LM's --rotary-base is an int
    if isinstance(out.get("window_size"), tuple):
        out["window_size"] = list(out["window_size"])
    multiple = getattr(adapter, "vocab_multiple", 1)
    seq = out["max_position_embeddings"]
    out.update(
        num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
        num_query_groups=d.groups, kv_channels=d.head_dim,
        group_query_attention=d.groups != d.heads,
        seq_length=seq, encoder_seq_length=seq, swiglu=bool(out.get("swiglu")),
        vocab_size=d.vocab, padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=multiple if padded_vocab % (multiple * layout.tp) == 0
        else 1, untie_embeddings_and_output_weights=not d.tied, tokenizer_model=tokenizer_model,
        num_experts=d.experts or None, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if (layout.vpp or 1) > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp,
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist",
        iteration=iteration or 0, no_save_rng=True, no_save_optim=True,
        params_dtype=dtype, bf16=dtypes.name_of(dtype) == "bfloat16",
        fp16=dtypes.name_of(dtype) == "float16",
        hf_architecture=adapter.architecture,
    )
    return argparse.Namespace(**out)


#: What Megatron-LM's ``save_checkpoint`` puts next to ``args`` (core_v0.16.1): the content
#: metadata torch_dist checkpoints carry (``common.pt``) for its optimizer sharding.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


# -- keys -----------------------------------------------------------------------------------------

#: The renames of module names in sharded keys (TE-style norm names) that megatron-core's local
#: layer spec declares (``TransformerLayerSubmodules.sharded_state_dict_keys_map`` of
#: ``get_gpt_layer_local_spec``, which ``toolkit.models.layer_spec`` builds on for every family).
#: Spelled out here so naming torch_dist keys needs no megatron-core import; a test compares it
#: with the spec of every registered family.
KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def non_homogeneous(adapter: Any) -> bool:
    """Whether megatron-core stores this model's layers under per-layer keys.

    ``TransformerBlock.sharded_state_dict`` stacks layers along a leading axis only when every
    layer is alike; with ``moe_layer_freq`` (dense and MoE layers mixed) or heterogeneous
    checkpoints each layer has its own keys (``decoder.layers.<i>.<suffix>``, experts still
    stacked along one axis).
    """
    kw = adapter.family.transformer_kwargs(adapter.hf_config)
    freq = kw.get("moe_layer_freq")
    mixed = (isinstance(freq, int) and freq > 1) or isinstance(freq, (list, tuple))
    return bool(mixed or kw.get("hetereogenous_dist_checkpoint")
                or kw.get("heterogeneous_block_specs"))


def dist_key(name: str, renames: dict[str, str], flat: bool = False
             ) -> tuple[str, tuple[int, ...]]:
    """(sharded key, offsets along the stacked axes) of a global megatron-core name.

    ``flat``: per-layer keys (see ``non_homogeneous``): the layer number stays in the key.
    """
    m = _LAYER.match(name)
    if not m:
        return name, ()
    layer, rest = int(m.group(1)), m.group(2)
    base = f"decoder.layers.{layer}." if flat else "decoder.layers."
    lead = () if flat else (layer,)
    e = _EXPERT.match(rest)
    if e:
        return f"{base}mlp.experts.experts.{e.group(2)}", (*lead, int(e.group(1)))
    for old, new in renames.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"{base}{rest}", lead


def stacked_axes(key: str) -> int:
    """How many leading axes of a stored key index layers / experts."""
    if re.match(r"^decoder\.layers\.\d+\.", key):  # per-layer keys
        return 1 if ".mlp.experts.experts." in key else 0
    if key.startswith("decoder.layers.mlp.experts.experts."):
        return 2
    return 1 if key.startswith("decoder.layers.") else 0


def extra_state_module(name: str) -> str | None:
    """The module of a linear layer's weight (which carries ``_extra_state``), else None."""
    return name[: -len(".weight")] if _LINEAR.search(name) else None


def marker(path: Path) -> bool:
    meta = path / "metadata.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (json.JSONDecodeError, AttributeError):
        return False


def has_checkpoint(path: Path, folder_marker: Callable[[Path], bool]) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint root or iteration folder of that marker."""
    try:
        checkpoint_dir(path, folder_marker)
        return True
    except CheckpointError:
        return False


def looks_like(path: Path) -> bool:
    return has_checkpoint(path, marker)


# -- reader ---------------------------------------------------------------------------------------

@dataclass
class DistCheckpoint:
    """The parsed metadata of a torch_dist folder; tensors are read chunk by chunk on demand."""

    path: Path
    iteration: int | None
    tensors: dict[str, Any]  # key -> TensorStorageMetadata
    storage: dict[tuple[str, tuple[int, ...]], Any]  # (key, chunk offsets) -> _StorageInfo
    objects: list[str]
    common: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> DistCheckpoint:
        folder, iteration = checkpoint_dir(path, marker)
        md_file = folder / ".metadata"
        if not md_file.is_file():
            raise CheckpointError(f"{folder} has metadata.json but no .metadata (incomplete "
                                  "torch_dist checkpoint).")
        md = load_dcp_metadata(md_file)
        tensors, objects = {}, []
        for key, value in md.state_dict_metadata.items():
            if isinstance(value, dcp_pickle.TensorStorageMetadata):
                tensors[key] = value
            else:
                objects.append(key)
        storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else ()): info
                   for idx, info in md.storage_data.items()}
        for key, value in tensors.items():
            for c in value.chunks:
                info = storage.get((key, tuple(c.offsets)))
                if info is None:
                    raise CheckpointError(f"{md_file}: chunk {tuple(c.offsets)} of {key} has no "
                                          "storage entry.")
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(f"{folder}: chunk of {key} uses storage transforms "
                                          f"{info.transform_descriptors} (not supported).")
                data = folder / info.relative_path
                if not data.is_file():
                    raise CheckpointError(f"{data} (holding {key}) is missing.")
                if data.stat().st_size < info.offset + info.length:
                    raise CheckpointError(f"{data} is truncated: {key} needs bytes up to "
                                          f"{info.offset + info.length}, the file has "
                                          f"{data.stat().st_size}.")
        common = {}
        if (folder / "common.pt").is_file():
            common = load_plain(folder / "common.pt")  # no torch import when it can
            if common is None:
                common = load_torch(folder / "common.pt") or {}
        return cls(folder, iteration, tensors, storage, objects, common)

    def _chunk(self, key: str, offsets: tuple[int, ...],
               sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        info = self.storage[(key, offsets)]
        file = self.path / info.relative_path
        if sizes is not None:
            fast = torch_record.read_tensor(file, info.offset, info.length, sizes,
                                      self.tensors[key].properties.dtype)
            if fast is not None:
                return fast
        with open(file, "rb") as f:
            f.seek(info.offset)
            buf = f.read(info.length)
        try:
            t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure here is a damaged chunk
            raise CheckpointError(f"{file}: chunk {offsets} of {key} cannot be read "
                                  f"({err}).") from err
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{file}: chunk {offsets} of {key} is not a tensor.")
        return t

    def locate(self, key: str, prefix: tuple[int, ...]) -> tuple[Path, int] | None:
        """(file, byte offset) where the slice ``key[prefix]`` lies as one row-major block, when
        a single plain chunk holds all of it; else None (then only ``read`` can assemble it)."""
        md = self.tensors[key]
        n = len(prefix)
        size = tuple(md.size)
        for c in md.chunks:
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            if tuple(offs[n:]) != (0,) * (len(size) - n) or tuple(sizes[n:]) != size[n:]:
                continue
            if not all(o <= i < o + s for i, o, s in zip(prefix, offs, sizes, strict=False)):
                continue
            info = self.storage[(key, offs)]
            file = self.path / info.relative_path
            with open(file, "rb") as f:
                start = torch_record.tensor_start(f, info.offset, info.length, sizes,
                                            md.properties.dtype)
            if start is None:
                return None
            index, inner = 0, 1
            for s in size[n:]:
                inner *= s
            for i, o, s in zip(prefix, offs, sizes, strict=False):
                index = index * s + (i - o)
            return file, start + index * inner * md.properties.dtype.itemsize
        return None

    def read(self, key: str, prefix: tuple[int, ...]) -> torch.Tensor:
        """The slice ``key[prefix]`` (prefix = indices along the stacked axes), assembled."""
        md = self.tensors[key]
        size = tuple(md.size)
        n = len(prefix)
        want = tuple((i, i + 1) for i in prefix) + tuple((0, s) for s in size[n:])
        out = torch.empty(size[n:], dtype=to_torch(md.properties.dtype))
        filled = 0
        for c in md.chunks:
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            inter = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(want, offs, sizes,
                                                                         strict=True)]
            if any(lo >= hi for lo, hi in inter):
                continue
            data = self._chunk(key, offs, sizes)
            part = data[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offs,
                                                                          strict=True))]
            part = part.reshape(part.shape[n:])
            if tuple(part.shape) == tuple(out.shape) and part.numel() == data.numel():
                return part  # one chunk is the whole tensor: no copy
            out[tuple(slice(lo, hi) for lo, hi in inter[n:])] = part
            filled += part.numel()
        if filled != out.numel():
            raise CheckpointError(f"{self.path}: chunks of {key}{list(prefix)} cover {filled} of "
                                  f"{out.numel()} elements.")
        return out


def full_names(ckpt: DistCheckpoint, adapter: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Global megatron-core name -> (sharded key, stacked-axis indices) of every stored tensor.

    Stored keys the adapter's mapping does not know come back under their own name (with a
    ``[i, ...]`` suffix) so the source reports them instead of dropping them.
    """
    renames = KEYS_MAP
    flat = any(re.match(r"^decoder\.layers\.\d+\.", k) for k in ckpt.tensors)
    known: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, _ in adapter.table(1).items():
        known[dist_key(name, renames, flat)] = name
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, md in ckpt.tensors.items():
        axes = stacked_axes(key)
        if axes == 0:
            out[known.get((key, ()), key)] = (key, ())
            continue
        # Only the layers / experts some chunk holds: a stacked key spans all layers, but in a
        # model mixing dense and MoE layers each layer stores only its own kind of MLP.
        held: set[tuple[int, ...]] = set()
        for c in md.chunks:
            held.update(_indices(tuple(c.sizes)[:axes], tuple(c.offsets)[:axes]))
        for prefix in sorted(held):
            name = known.get((key, prefix), f"{key}{list(prefix)}")
            out[name] = (key, prefix)
    return out


def _indices(shape: tuple[int, ...], start: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    start = start or (0,) * len(shape)
    out: list[tuple[int, ...]] = [()]
    for n, s in zip(shape, start, strict=True):
        out = [(*p, i) for p in out for i in range(s, s + n)]
    return out


def layout_of(args: Any) -> dict[str, Any]:
    """tp / pp / vpp / ep of Megatron-LM run arguments (``common.pt``'s ``args``)."""
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}
    return {k: getattr(args, v, None) for k, v in keys.items()} if args is not None else {}


def open_source(path: Path, make_adapter: formats.AdapterFactory
                ) -> tuple[McoreFullSource, Any, dict]:
    """A torch_dist checkpoint as an HF-named source, its adapter (``make_adapter(hf_dir,
    common)``) and info (the ``formats`` opener)."""
    ckpt = DistCheckpoint.open(path)
    adapter = make_adapter(find_hf_config(ckpt.path), {**ckpt.common, "root": ckpt.path.parent})
    names = full_names(ckpt, adapter)
    shapes = {}
    for name, (key, prefix) in names.items():
        md = ckpt.tensors[key]
        shapes[name] = (tuple(md.size)[len(prefix):], md.properties.dtype)
    source = McoreFullSource(adapter, adapter.hf_config, shapes,
                             lambda name: ckpt.read(*names[name]),
                             locate=lambda name: ckpt.locate(*names[name]))
    return source, adapter, {"iteration": ckpt.iteration, "folder": ckpt.path,
                             "layout": layout_of(ckpt.common.get("args")),
                             "files": sorted(p.name for p in ckpt.path.iterdir())}


# -- writer ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One chunk to write: the tp=1 tensor of ``name`` at ``prefix`` of sharded key ``key``."""

    name: str
    key: str
    prefix: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    axes: tuple[int, ...] = ()  # sizes of the stacked axes ``prefix`` indexes


def plan_items(adapter: Any, tp: int, dtype_of: Callable[[str], torch.dtype]) -> list[Item]:
    """Every tensor chunk of the checkpoint (one per layer / expert), in table order."""
    renames = KEYS_MAP
    flat = non_homogeneous(adapter)
    table = adapter.table(tp)
    d = adapter.dims
    items = []
    for name, rule in table.items():
        if name == "output_layer.weight" and table.tied:
            continue  # megatron-core stores the tied output layer as the embedding
        key, prefix = dist_key(name, renames, flat)
        axes = ((d.experts,) if flat else (d.layers, d.experts))[: len(prefix)]
        shape = rule.local_shape(1)
        numel = 1
        for s in shape:
            numel *= s
        items.append(Item(name, key, prefix, shape,
                          numel * dtype_of(rule.sources[0]).itemsize, axes))
    return items


def write_data_file(path: Path, items: list[Item], table: Any, read: Callable,
                    dtype_of: Callable[[str], torch.dtype],
                    tick: Callable[[int], None] = lambda n: None,
                    byte_range: Callable[[str, Any, torch.dtype], Any] | None = None
                    ) -> list[dict]:
    """Write ``items`` into one DCP data file; returns their storage records.

    ``byte_range(name, region, dtype)`` (optional): where a source region lies as stored
    (``Opened.byte_range``). An item made of whole rows of such regions (every layer tensor,
    ``[gate; up]``, fused QKV, the embedding of a safetensors source without a cast) is copied
    file to file into its ``torch.save`` record (``torch_record``); the others are assembled in
    memory, the next one read in a thread while this one is written."""
    rules = dict(table.items())
    records = []

    def produce(it: Item) -> Any:
        rule = rules[it.name]
        dtype = dtype_of(rule.sources[0])
        if byte_range is not None:
            segs = local_segments(rule, 0, 1, lambda n, r: byte_range(n, r, dtype),
                                  dtype.itemsize)
            if segs is not None:
                segs = merge(segs)
                will_need(segs)  # the disk reads them while the current chunk is copied
                return segs, dtype
        t = local_tensor(rule, 0, 1, read, dtype)
        return t.reshape((1,) * len(it.prefix) + tuple(t.shape)).contiguous()

    # the next chunk is read (in a thread) while this one is written: two chunks in memory
    with open(path, "wb") as f, contextlib.closing(read_ahead(items, produce)) as chunks:
        for it, t in chunks:
            offset = f.tell()
            shape = (1,) * len(it.prefix) + tuple(it.shape)
            if isinstance(t, tuple):
                f.flush()
                torch_record.save_segments(f.fileno(), shape, t[1], t[0])
                f.seek(0, 2)  # the buffered file learns the position the copies moved to
                dtype = t[1]
            else:
                torch.save(t, f)
                shape, dtype = tuple(t.shape), t.dtype
            records.append({"key": it.key, "offsets": (*it.prefix, *(0,) * len(it.shape)),
                            "sizes": shape, "dtype": dtype, "file": path.name,
                            "offset": offset, "length": f.tell() - offset})
            tick(it.nbytes)
            del t
    return records


def write_metadata(folder: Path, items: list[Item], records: list[dict], num_layers: int,
                   num_experts: int, common: dict[str, Any]) -> None:
    """``.metadata`` (DCP; pickled from ``dcp_pickle``'s stand-ins, so torch.distributed is not
    imported), the ``_extra_state`` objects file, ``metadata.json``, ``common.pt``."""
    d = dcp_pickle
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    chunks: dict[str, list] = {}
    for r in records:
        chunks.setdefault(r["key"], []).append(r)
    shapes: dict[str, tuple[int, ...]] = {}
    for it in items:
        shapes[it.key] = (*it.axes, *it.shape)
    for key, rs in chunks.items():
        md_chunks = []
        for i, r in enumerate(rs):
            md_chunks.append(d.ChunkStorageMetadata.make(offsets=d.Size(r["offsets"]),
                                                         sizes=d.Size(r["sizes"])))
            storage[d.MetadataIndex.make(fqn=key, index=i, offset=d.Size(r["offsets"]))] = \
                d.StorageInfo.make(relative_path=r["file"], offset=r["offset"],
                                   length=r["length"])
        props = d.TensorProperties.make(dtype=d.dtype_ref(rs[0]["dtype"]), layout=d.STRIDED,
                                        requires_grad=False, memory_format=d.CONTIGUOUS,
                                        pin_memory=False)
        state[key] = d.TensorStorageMetadata.make(properties=props, size=d.Size(shapes[key]),
                                                  chunks=md_chunks)
    # _extra_state of every linear module: megatron-core's local layers store [None].
    data = torch_record.dumps([None])
    objects = sorted({(f"{extra_state_module(it.key)}._extra_state", it.prefix, it.axes)
                      for it in items if extra_state_module(it.key)})
    with open(folder / "__extra_0.distcp", "wb") as f:
        for key, prefix, axes in objects:
            fqn = (f"{key}/shard_{'.'.join(map(str, prefix))}_{'.'.join(map(str, axes))}"
                   if prefix else f"{key}/shard_0_1")
            state[fqn] = d.BytesStorageMetadata.make()
            storage[d.MetadataIndex.make(fqn=fqn, index=None, offset=None)] = \
                d.StorageInfo.make(relative_path="__extra_0.distcp", offset=f.tell(),
                                   length=len(data))
            f.write(data)
    md = d.Metadata.make(state_dict_metadata=state, planner_data=None, storage_data=storage,
                         storage_meta=d.StorageMeta.make(checkpoint_id=None,
                                                         save_id=str(uuid.uuid4()),
                                                         load_id=None, modules=[]),
                         version=d.DCP_VERSION)
    (folder / ".metadata").write_bytes(d.dumps(md))
    with open(folder / "common.pt", "wb") as f:
        torch_record.save_bytes(f, common)  # torch.save's bytes, written without torch
    (folder / "metadata.json").write_text(json.dumps(BACKEND))


formats.register(FORMAT, open_source, looks_like)  # see toolkit.checkpoint.formats
