"""The adapter (the mapping): a family bound to one HF checkpoint's config, a dtype and a vocab
padding.

A ``Family`` (``toolkit.adapters.family``; one small file per family in ``model_adapters/``)
declares how an HF config translates. The ``Adapter`` adds what needs torch: the dtypes, the
activation function, the TransformerConfig, layer spec and GPTModel arguments for a layout, and
the per-rank plans. It knows no process groups and no files except the source folder it copies
tokenizer files from on export. A command gets it from its ``ModelSpec`` (``spec.adapter``),
which builds it (``bind``) once per dtype and vocab padding.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from toolkit.adapters.family import Dims, Family
from toolkit.adapters.hfconfig import HFConfig, UnsupportedModel, config_text, declared_dtype
from toolkit.adapters.registry import SEQ_CLS, family_of
from toolkit.checkpoint.torchfree import dtypes
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.errors import UserError
from toolkit.lazy import torch
from toolkit.mapping import (
    Coord,
    Replicated,
    Table,
    TensorPlan,
    padded_vocab_size,
    plan_rank,
)
from toolkit.mapping.stacked import Stack
from toolkit.parallel.layout import LayoutError, ParallelLayout


class CheckpointMismatch(UserError):
    """The checkpoint's tensors differ from what the mapping expects (missing, extra, shape)."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF ``gelu_new`` / ``gelu_pytorch_tanh`` (OpenAI's tanh GELU), without torch.compile.

    megatron-core's ``openai_gelu`` is the same formula but wrapped in its jit fuser
    (torch.compile), which needs a compiler toolchain on CPU.
    """
    return torch.nn.functional.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """HF ``quick_gelu``, ``x * sigmoid(1.702 x)``: GPT-OSS's expert activation (its
    ``swiglu_alpha``), as transformers computes it (megatron-core's own is jit-compiled)."""
    return x * torch.sigmoid(1.702 * x)


#: HF activation name -> its function in ``torch.nn.functional`` (``gelu_tanh``, ``quick_gelu``:
#: above); by name, so that checking a config (every conversion does) does not import torch.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
               "relu": "relu", "quick_gelu": "quick_gelu"}


def check_activation(name: str) -> str:
    """``name`` if mdtk supports that HF activation, else UnsupportedModel listing those it does."""
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported; supported: "
                               f"{sorted(ACTIVATIONS)}.")
    return name


def activation(name: str) -> Any:
    """The torch function of an HF activation name (families declare activations by name)."""
    fn = ACTIVATIONS[check_activation(name)]
    own = {"gelu_tanh": gelu_tanh, "quick_gelu": quick_gelu}
    return own[fn] if fn in own else getattr(torch.nn.functional, fn)


@dataclass
class Adapter:
    """A family bound to one HF config (and the folder it came from, if any)."""

    family: Family
    hf_config: Any
    source: Path | None = None
    params_dtype: Any = dtypes.FLOAT32  # a torch dtype or a ``DType``
    #: Pad the vocab to a multiple of ``vocab_multiple * tp`` (1 = the least padding; set 128
    #: for GPU-friendly sizes). Padded rows are zeros and are stripped on export.
    vocab_multiple: int = 1
    #: ``lm``: the LM head; ``score``: a reward model's scalar head in its place (HF's
    #: ``score.weight`` [1, hidden], replicated; ``toolkit.models.score_head``)
    head: str = "lm"
    pad_token_id: int | None = None  # a reward model's export: the tokenizer's, when it has one
    #: The config.json as read, when transformers reads it with another model type's class
    #: (``Family.transformers_types``: Kimi K2 as DeepSeek-V3): exports write it back as read.
    written_config: Any = None
    _tables: dict[int, Table] = field(default_factory=dict, repr=False)

    @cached_property
    def dims(self) -> Dims:
        return self.family.dims(self.hf_config)

    @cached_property
    def stacks(self) -> list[Stack]:
        """Stored tensors that hold many mapped tensors (GPT-OSS's fused experts): the HF
        folder's readers and writers apply them (``toolkit.checkpoint.stacked``)."""
        return self.family.stacks(self.hf_config, self.dims)

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def hf_dtype(self) -> dtypes.DType:
        """The dtype the HF checkpoint declares (float32 when it declares none)."""
        return declared_dtype(self.hf_config)

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.dims.vocab, tp, self.vocab_multiple)

    def validate(self, layout: ParallelLayout) -> None:
        """Raise LayoutError if this model cannot be split as ``layout`` says."""
        d = self.dims
        if layout.cp > 1 and (why := self.family.cp_refusal(self.hf_config)):
            raise LayoutError(f"context parallelism (cp={layout.cp}): {why}; set cp=1.")
        layout.validate_model(num_layers=d.layers, num_heads=d.heads, num_query_groups=d.groups,
                              num_experts=d.experts or None, vocab_size=d.vocab,
                              ffn_hidden_size=d.ffn)
        if d.experts and d.linear_bias and layout.expert_tp != 1:
            raise LayoutError(
                f"etp={layout.expert_tp}: this model's experts have biases, and megatron-core "
                "supports expert biases only without tensor parallelism inside experts; set "
                "parallel.etp=1 (`mdtk convert --etp 1`): experts whole on each rank, or split "
                "by ep.")

    def transformer_config(self, layout: ParallelLayout, **overrides: Any):
        from toolkit.models import transformer_config

        vpp = layout.vpp if layout.vpp and layout.vpp > 1 else None
        half = {"bfloat16": {"bf16": True}, "float16": {"fp16": True}}
        kwargs = {
            **self.family.transformer_kwargs(self.hf_config),
            "activation_func": activation(self.family.activation(self.hf_config)),
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "context_parallel_size": layout.cp,
            "expert_model_parallel_size": layout.ep,
            "expert_tensor_parallel_size": layout.etp,
            "sequence_parallel": layout.sequence_parallel,
            "params_dtype": to_torch(self.params_dtype),
            "pipeline_dtype": to_torch(self.params_dtype),
            # Every weight is overwritten from the checkpoint: skip megatron-core's CPU init,
            # which builds each full master weight on every rank before splitting it.
            "perform_initialization": False,
            **half.get(dtypes.of(self.params_dtype).name, {}),
            **overrides,
        }
        return transformer_config(**kwargs)

    def layer_spec(self):
        from toolkit.models import layer_spec

        return layer_spec(**self.family.spec_kwargs(self.hf_config))

    def gpt_kwargs(self, tp: int) -> dict[str, Any]:
        return {
            "vocab_size": self.padded_vocab(tp),
            "share_embeddings_and_output_weights": self.dims.tied,
            **self.family.model_kwargs(self.hf_config),
        }

    def table(self, tp: int) -> Table:
        """The mapping at tensor-parallel size ``tp`` (the vocab padded as this adapter pads)."""
        return self.table_at(self.padded_vocab(tp))

    def table_at(self, padded_vocab: int) -> Table:
        """The mapping with the vocab padded to ``padded_vocab`` rows (a checkpoint's own
        padding; ``dims.vocab``: none), made once per size."""
        if padded_vocab not in self._tables:
            table = self.family.table(self.hf_config, self.dims, padded_vocab)
            self._tables[padded_vocab] = score_table(table, self.dims.hidden) \
                if self.head == "score" else table
        return self._tables[padded_vocab]

    @property
    def seeds_score(self) -> bool:
        """A reward model made from a causal LM: its checkpoint has no ``score.weight`` (the
        head is drawn by ``score_head.seed_score``; an HF sequence-classification folder's is
        read as it is)."""
        return self.head == "score" and not self.architecture.endswith(SEQ_CLS)

    def plan(self, coord: Coord) -> list[TensorPlan]:
        return plan_rank(self.table(coord.tp), coord)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Stored HF tensor names and full shapes the mapping reads (layout-independent)."""
        return self.table(1).hf_shapes()

    def match_checkpoint(self, stored: dict[str, tuple[int, ...]]) -> dict[str, str]:
        """Map each expected name to the stored name; raise naming what is missing or extra.

        Accepts checkpoints saved from the base model class (names without ``base_prefix``) and
        a stored ``lm_head.weight`` in a tied model (HF ties it to the embedding and ignores it).
        """
        expected = self.expected_tensors()
        if self.seeds_score:  # a causal LM's head is dropped, the score head seeded
            expected.pop(SCORE)
            stored = {k: v for k, v in stored.items() if k != "lm_head.weight"}
        prefix = self.family.base_prefix
        resolved: dict[str, str] = {}
        missing = []
        for name in expected:
            bare = name[len(prefix):] if prefix and name.startswith(prefix) else None
            if name in stored:
                resolved[name] = name
            elif bare is not None and bare in stored:
                resolved[name] = bare
            else:
                missing.append(name)
        if missing:
            raise CheckpointMismatch(
                f"checkpoint lacks {len(missing)} tensor(s) the {self.architecture} mapping "
                f"expects: {_listing(missing)}. Is the config.json from the same model?"
            )
        used = set(resolved.values())
        ignored = [re.compile(p) for p in self.family.ignored]
        extra = []
        for name in stored:
            canonical = name if name in expected or not prefix else prefix + name
            if name in used or any(p.search(name) or p.search(canonical) for p in ignored):
                continue
            if self.dims.tied and name == "lm_head.weight":
                continue
            if self.family.kept_aside(self.hf_config, name):
                continue  # copied through by exports and conversions (``kept``)
            extra.append(name)
        if extra:
            raise CheckpointMismatch(
                f"checkpoint has {len(extra)} tensor(s) the {self.architecture} mapping does not "
                f"use: {_listing(extra)}. Refusing to drop weights silently: check that "
                "config.json matches the weights, or add the tensors to the family's mapping."
            )
        bad = [f"{n}: stored {tuple(stored[resolved[n]])}, expected {expected[n]}"
               for n in expected if tuple(stored[resolved[n]]) != expected[n]]
        if bad:
            raise CheckpointMismatch("tensor shapes differ from config.json (the weights and "
                                     "config.json must be of the same model): " + _listing(bad))
        return resolved

    def kept(self, stored: Any) -> list[str]:
        """The stored names (of ``stored``) the family keeps aside: no weights of the megatron-core
        model, copied unchanged by exports and conversions (DeepSeek-V3's MTP layers)."""
        return [n for n in stored if self.family.kept_aside(self.hf_config, n)]

    def export_config(self, dtype: torch.dtype | None = None) -> Any:
        """The HF config to write next to exported weights (dtype updated); a config
        transformers reads with another model type's class is written back as read; a reward
        model's: HF's sequence-classification class of the family, one label."""
        if self.written_config is not None:
            cfg = HFConfig(json.loads(config_text(self.written_config,
                                                  dtype or self.hf_dtype)))
        else:
            cfg = export_config(self.hf_config, dtype or self.hf_dtype)
        if self.head == "score":
            base = self.architecture.removesuffix(SEQ_CLS).removesuffix("ForCausalLM")
            cfg.architectures = [base + SEQ_CLS]
            cfg.num_labels = 1
            if self.pad_token_id is not None:  # where transformers reads each reward
                cfg.pad_token_id = self.pad_token_id
        return cfg

    def with_score_head(self) -> Adapter:
        """This mapping with a reward model's scalar head in place of the LM head."""
        return dataclasses.replace(self, head="score", _tables={})


SCORE = "score.weight"  # HF's reward-model head (``AutoModelForSequenceClassification``)


def score_table(table: Table, hidden: int) -> Table:
    """``table`` with the LM head replaced by HF's ``score.weight`` [1, hidden] (replicated)
    and the embedding untied (a reward model has no LM head to share it with)."""
    head = {**table.head, "output_layer.weight": Replicated(SCORE, (1, hidden))}
    return dataclasses.replace(table, head=head, tied=False)


def export_config(hf: Any, dtype: Any) -> Any:
    """A copy of transformers' config ``hf`` to write next to weights of ``dtype``: the dtype
    updated, an fp8 ``quantization_config`` dropped (the weights written are not quantized)."""
    cfg = copy.deepcopy(hf)
    cfg.dtype = to_torch(dtypes.of(dtype))
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    return cfg


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def family_for_config(hf: Any) -> Family:
    """The family of an adapter's config: by ``architectures[0]``, which an adapter needs."""
    if not getattr(hf, "architectures", None):
        raise UnsupportedModel("config.json has no 'architectures' entry: cannot pick an adapter.")
    return family_of(hf)


def bind(hf: Any, source: Path | None, dtype: Any, vocab_multiple: int) -> Adapter:
    """A new adapter reading ``hf`` (made by ``ModelSpec.adapter``, which keeps it): the
    family's checks, the activation, the parameters' ``dtype`` (None: the declared one)."""
    family = family_for_config(hf)
    family.check(hf)
    check_activation(family.activation(hf))
    head = "score" if hf.architectures[0].endswith(SEQ_CLS) else "lm"  # a reward model's
    adapter = Adapter(family, hf, source=source, vocab_multiple=vocab_multiple, head=head)
    adapter.params_dtype = dtypes.of(dtype) if dtype is not None else adapter.hf_dtype
    return adapter
