"""Live HF <-> megatron-core: load an HF checkpoint into this rank's chunks, export chunks to HF.

``load_hf`` builds the calling rank's GPTModel chunks (all virtual stages) and fills them reading
only this rank's slices of the safetensors files. ``export_hf`` writes the weight stream of a
live model of any layout (``stream.hf_tensors``: gathered to one rank tensor by tensor) into a
new HF folder; it needs only the adapter (config), not the original checkpoint. Both follow
the adapter's per-rank plans (``toolkit.mapping``), so loading and export cannot disagree.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from toolkit.adapters.adapter import Adapter
from toolkit.adapters.local import chunk_params, current_coord
from toolkit.adapters.spec import ConfigFile, ModelSpec
from toolkit.adapters.stream import hf_tensors
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import GENERATION_CONFIG, HFReader, open_reader
from toolkit.checkpoint.hf_writer import HFWriter
from toolkit.checkpoint.source import TensorSource
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.mapping import Coord, MappingError, TensorPlan, coalesce, stage_layers
from toolkit.parallel.layout import LayoutError, ParallelLayout

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_source(source: str | Path, *, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id fetched through HF's normal cache."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source}: no such folder, and not a hub id like 'org/name'.")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(text, revision=revision, allow_patterns=HUB_PATTERNS))


def layout_in_use(layout: ParallelLayout | None) -> ParallelLayout:
    """Initialise megatron-core's groups for ``layout``, or check it matches the ones in place."""
    from megatron.core import parallel_state as ps

    from toolkit import parallel

    if not ps.model_parallel_is_initialized():
        return parallel.initialize(layout or ParallelLayout()).layout
    c = current_coord()
    active = ParallelLayout(tp=c.tp, pp=c.pp, vpp=c.vpp if c.vpp > 1 else None, ep=c.ep,
                            etp=c.etp if c.etp != c.tp else None,
                            cp=ps.get_context_parallel_world_size())
    if layout is not None:
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            want, have = getattr(layout, name), getattr(active, name)
            if (want or 1) != (have or 1):
                raise LayoutError(f"{name}={want} differs from the initialised process groups "
                                  f"({name}={have}): call toolkit.parallel.destroy() first or "
                                  "pass the same layout.")
        return layout.resolve(dist.get_world_size())
    return active.resolve(dist.get_world_size())


def build_model(adapter: Adapter, layout: ParallelLayout, **config_overrides: Any) -> list[Any]:
    """This rank's GPTModel chunks for ``adapter`` (weights uninitialised: fill them next)."""
    from toolkit.models import build_chunks

    config = adapter.transformer_config(layout, **config_overrides)
    chunks = build_chunks(config, adapter.layer_spec(), **adapter.gpt_kwargs(layout.tp))
    if adapter.head == "score":
        from toolkit.models.score_head import attach_score_heads

        attach_score_heads(chunks)
    return chunks


def load_hf(
    source: str | Path | ModelSpec,
    layout: ParallelLayout | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    vocab_multiple: int = 1,
    revision: str | None = None,
    head: str = "lm",
    **config_overrides: Any,
) -> tuple[list[Any], Adapter]:
    """Build this rank's chunks and fill them from an HF folder or hub id, or from the folder
    of a live ``ModelSpec`` (its mapping: ``spec.adapter(dtype, vocab_multiple)``).

    Initialises megatron-core's process groups for ``layout`` unless they already exist (then
    ``layout`` must match them). Everything that can be checked before building is checked
    first: architecture, config features, layout divisibility, tensor names and shapes.
    ``head="score"``: a reward model (``Adapter.head``); a causal LM's LM head is dropped and
    the score head left at zeros for the caller to seed (``Adapter.seeds_score``).
    """
    spec = source if isinstance(source, ModelSpec) else ModelSpec.of(
        resolve_source(source, revision=revision), live=True)
    if spec.source is None:
        raise CheckpointError("load_hf needs the model's folder (its weights): got a model "
                              "description without one.")
    adapter = spec.adapter(dtype, vocab_multiple, head)
    adapter.validate(layout or ParallelLayout())
    # fp8 / mxfp4 weights: dequantized into the parameters' dtype
    with open_weights(adapter, spec.source, spec.config) as reader:
        names = adapter.match_checkpoint({n: reader.shape(n) for n in reader.names})
        active = layout_in_use(layout)
        adapter.validate(active)
        chunks = build_model(adapter, active, **config_overrides)
        fill_chunks(chunks, adapter, reader, names=names)
    return chunks, adapter


def open_weights(adapter: Adapter, folder: str | Path, config: Any = None) -> TensorSource:
    """The slice reader of ``adapter``'s HF folder (``config``: its config.json as read; by
    default the adapter's): quantized weights dequantized into the parameters' dtype, members
    of stacked tensors (GPT-OSS's experts) under their own names."""
    hf = config if config is not None else adapter.hf_config
    return open_reader(folder, hf if hasattr(hf, "get") else hf.to_dict(),
                       adapter.params_dtype, stacks=adapter.stacks,
                       base_prefix=adapter.family.base_prefix)


def check_plans(chunks: list[Any], plans: list[TensorPlan], coord: Coord, num_layers: int) -> None:
    """The plans must name exactly the chunks' parameters, with the same shapes and layers."""
    params = chunk_params(chunks)
    planned = {(t.chunk, t.name): t for t in plans}
    no_rule = sorted(f"chunk {c}: {n}" for c, n in params.keys() - planned.keys())
    no_param = sorted(f"chunk {c}: {n}" for c, n in planned.keys() - params.keys())
    if no_rule or no_param:
        raise MappingError(f"mapping and megatron-core model disagree. Parameters without a rule: "
                           f"{no_rule or 'none'}; rules without a parameter: {no_param or 'none'}.")
    bad = [f"{n}: model {tuple(params[k].shape)}, plan {t.shape}" for k, t in planned.items()
           for n in [k[1]] if tuple(params[k].shape) != t.shape]
    if bad:
        raise MappingError("local shapes differ from the plan: " + "; ".join(bad))
    for i, chunk in enumerate(chunks):
        want = list(stage_layers(num_layers, coord, i))
        have = [layer.layer_number - 1 for layer in chunk.decoder.layers]
        if have != want:
            raise MappingError(f"chunk {i} holds layers {have}, the plan expects {want} "
                               "(uneven pipeline splits are not supported).")


def fill_chunks(chunks: list[Any], adapter: Adapter, reader: HFReader, *,
                names: dict[str, str] | None = None, coord: Coord | None = None) -> None:
    """Copy this rank's slices from ``reader`` into ``chunks`` (one coalesced read per block)."""
    coord = coord or current_coord()
    names = names or adapter.match_checkpoint({n: reader.shape(n) for n in reader.names})
    plans = adapter.plan(coord)
    check_plans(chunks, plans, coord, adapter.dims.layers)
    params = chunk_params(chunks)
    with torch.no_grad():
        for t in plans:
            param = params[(t.chunk, t.name)]
            covered = sum(p.numel for p in t.pieces)
            if covered != param.numel():
                param.zero_()  # vocab padding rows
            by_source: dict[str, list[int]] = defaultdict(list)
            for i, piece in enumerate(t.pieces):
                if piece.source not in names and adapter.seeds_score:
                    continue  # a causal LM's reward head: seeded by the caller
                by_source[piece.source].append(i)
            for source, idx in by_source.items():
                for box, members in coalesce([t.pieces[i].src for i in idx]):
                    data = reader.read(names[source], box)
                    for m in members:
                        piece = t.pieces[idx[m]]
                        part = data[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in
                                          zip(piece.src, box, strict=True))]
                        param[tuple(slice(a, b) for a, b in piece.dst)].copy_(
                            piece.to_local(part))


def export_hf(
    chunks: list[Any],
    adapter: Adapter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    dst: int = 0,
) -> Path | None:
    """Gather the live model (any layout) to rank ``dst`` and write an HF folder there.

    Collective: every rank of the world calls it. The folder is the weight stream
    (``stream.hf_tensors``: HF names, vocab padding stripped, stacked experts stacked, kept
    tensors last) written by ``HFWriter``; ``dst`` holds at most one HF tensor group plus one
    output shard. Returns the folder on ``dst``, None elsewhere.
    """
    writer = _open_writer(out_dir, max_shard_bytes, overwrite, dst)
    dtype = to_torch(dtype or adapter.hf_dtype)
    try:
        for item in hf_tensors(chunks, adapter, dtype=dtype, dst=dst):
            if writer is not None:
                writer.add(item.name, item.tensor)
        result = None
        if writer is not None:
            result = writer.finish(ConfigFile(adapter.export_config(dtype)),
                                   generation_config=generation_config(adapter.source,
                                                                       adapter.hf_config),
                                   copy_from=adapter.source)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    dist.barrier()
    return result


def _open_writer(out_dir: str | Path, max_shard_bytes: int, overwrite: bool, dst: int
                 ) -> HFWriter | None:
    """The writer on ``dst`` (None elsewhere); a failure to open it is raised on every rank."""
    writer, problem = None, [None]
    if dist.get_rank() == dst:
        try:
            writer = HFWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
        except (OSError, ValueError) as err:
            problem = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(problem, src=dst)  # fail on every rank, not only on dst
    if problem[0] is not None:
        raise CheckpointError(f"export to {out_dir} on rank {dst}: {problem[0]}")
    return writer


def generation_config(source: Path | None, hf: Any) -> Any:
    """The generation config to write beside a model: ``source``'s own file when it has one,
    else transformers' defaults for its config ``hf`` (a transformers config)."""
    from transformers import GenerationConfig

    if source is not None and (source / GENERATION_CONFIG).is_file():
        return GenerationConfig.from_pretrained(str(source))
    return GenerationConfig.from_model_config(hf)


@torch.no_grad()
def forward_logits(chunks: list[Any], tokens: torch.Tensor, vocab_size: int,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, seq, vocab_size]`` (padding stripped, float32) on every rank.
    ``position_ids``: restarting at 0 where a packed example starts (``models.packed``).

    Runs the pipeline one stage at a time (virtual stages in order), which is enough for
    checking numerics; training uses megatron-core's schedules. At cp > 1 each CP rank runs its
    two load-balanced chunks (as the trainer cuts them) and the logits are gathered back.
    """
    from megatron.core import parallel_state as ps

    from toolkit.models.cp_attention import context_parallel_share
    from toolkit.models.packed import localise, segments_of

    b, s = tokens.shape
    device = next(chunks[0].parameters()).device  # CPU, or the GPU the chunks were moved to
    tokens = tokens.to(device)
    pos = (torch.arange(s).unsqueeze(0).expand(b, s) if position_ids is None
           else position_ids).to(device).contiguous()
    segments = segments_of(pos)
    cp = ps.get_context_parallel_world_size()
    cut = context_parallel_share({"tokens": tokens, "position_ids": pos})
    tokens, pos = cut["tokens"], cut["position_ids"]
    segments = localise(segments, pos)
    coord = current_coord()
    config = chunks[0].config
    seq = tokens.shape[1] // coord.tp if config.sequence_parallel else tokens.shape[1]
    hidden = None
    logits = None
    for v, chunk in enumerate(chunks):
        chunk.eval()
        first = coord.pp_rank == 0 and v == 0
        last = coord.pp_rank == coord.pp - 1 and v == len(chunks) - 1
        if not first:
            hidden = torch.empty(seq, b, config.hidden_size, dtype=config.params_dtype,
                                 device=device)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(tokens, pos, None, packed_seq_params=segments)
        if last:
            logits = out
        else:
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
    if logits is not None and coord.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(coord.tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    if logits is not None and cp > 1:
        from toolkit.models.cp_attention import gather_sequence

        with torch.no_grad():
            logits = gather_sequence(logits.transpose(0, 1).contiguous(),
                                     ps.get_context_parallel_group()).transpose(0, 1)
    if logits is None:
        logits = torch.empty(b, s, vocab_size, dtype=torch.float32, device=device)
    else:
        logits = logits[..., :vocab_size].float().contiguous()
    if coord.pp > 1:
        dist.broadcast(logits, ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return logits.cpu()
