"""What a model family declares, and the one description (``Dims``) it reads from an HF config.

A family (one file in ``model_adapters/``) is a ``Family`` subclass made of declarations: the HF
architecture names, config-key renames and defaults, switches (norm kind, gated MLP, biases, q/k
norm, learned positions, experts) and HF module names. The base class turns them into ``Dims``
(sizes and switches resolved for one config), megatron-core's arguments and the mapping table.
Layout validation, the mapping, the live loader and the memory model all read the same ``Dims``,
so a new family gets correct memory estimates by declaring itself.

Torch- and transformers-free: ``mdtk estimate`` / ``ds-config`` import it. The activation
function is returned by name; ``toolkit.adapters.adapter`` resolves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from toolkit import rules
from toolkit.adapters.hfconfig import (
    COUNT,
    COUNTS,
    FLAG,
    IDENTITY,
    NUMBER,
    OBJECT,
    SIZE,
    TEXT,
    TEXTS,
    Kind,
    UnsupportedModel,
    check_fields,
    dense_layers,
    rope_kwargs,
    window_kwargs,
)
from toolkit.adapters.hybrid import DeltaDims
from toolkit.mapping import Replicated, Table, builders, vocab
from toolkit.mapping.builders import SWIGLU, Rules
from toolkit.mapping.stacked import Stack

_REQUIRED = object()

#: The JSON type of each config key the families read (by Llama's name; a family's ``keys``
#: rename them, the types of its ``defaults`` add its own keys). ``Family.validate`` checks them
#: before any size is used, so a wrong type is one error naming the key (not a TypeError in the
#: memory model, or transformers' validation traceback).
FIELDS: dict[str, Kind] = {
    **IDENTITY,
    "hidden_size": SIZE, "num_hidden_layers": SIZE, "num_attention_heads": SIZE,
    "num_key_value_heads": SIZE, "head_dim": SIZE, "intermediate_size": SIZE,
    "vocab_size": SIZE, "max_position_embeddings": SIZE, "tie_word_embeddings": FLAG,
    "attention_bias": FLAG, "mlp_bias": FLAG, "hidden_act": TEXT, "rms_norm_eps": NUMBER,
    "initializer_range": NUMBER, "attention_dropout": NUMBER, "hidden_dropout": NUMBER,
    "sliding_window": COUNT, "sliding_window_pattern": COUNT, "layer_types": TEXTS,
    "rope_theta": NUMBER, "rope_scaling": OBJECT, "rope_parameters": OBJECT,
    "rope_parameters.rope_theta": NUMBER, "rope_parameters.rope_type": TEXT,
    "rope_parameters.factor": NUMBER, "partial_rotary_factor": NUMBER,
    "query_pre_attn_scalar": NUMBER, "quantization_config": OBJECT,
    # mixture of experts and multi-latent attention: counts (a dense config may hold zeros)
    "num_experts": COUNT, "num_local_experts": COUNT, "n_routed_experts": COUNT,
    "num_experts_per_tok": COUNT, "moe_intermediate_size": COUNT, "norm_topk_prob": FLAG,
    "shared_expert_intermediate_size": COUNT, "mlp_only_layers": COUNTS,
    "decoder_sparse_step": COUNT, "first_k_dense_replace": COUNT,
    "router_aux_loss_coef": NUMBER, "router_jitter_noise": NUMBER, "kv_lora_rank": COUNT,
    "q_lora_rank": COUNT, "qk_nope_head_dim": COUNT, "qk_rope_head_dim": COUNT,
    "v_head_dim": COUNT,
}
_BY_DEFAULT = {bool: FLAG, int: COUNT, float: NUMBER, str: TEXT}


class ConfigKeyError(UnsupportedModel):
    """The HF config lacks a key the family needs and has no default for."""


@dataclass(frozen=True)
class Dims:
    """A model's sizes and switches, resolved from its HF config by its family."""

    hidden: int
    layers: int
    heads: int
    groups: int  # key/value heads (query groups)
    head_dim: int
    ffn: int  # MLP size; in a MoE model the size of each routed expert
    vocab: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    dense_ffn: int = 0  # MoE model: MLP size of its dense layers (0: none)
    dense_layers: tuple[int, ...] = ()  # MoE model: layers with a dense MLP
    shared_ffn: int = 0  # MoE model: shared expert size (0: none)
    shared_gate: bool = False  # the shared expert has a sigmoid gate
    router_bias: bool = False  # per-expert score-correction bias (a stored buffer, DeepSeek-V3)
    positions: int = 0  # rows of a learned position table; 0: RoPE
    norm: str = "RMSNorm"  # or "LayerNorm" (weight and bias)
    gated: bool = True  # SwiGLU-style MLP (gate and up projections)
    qkv_bias: bool = False
    linear_bias: bool = False  # o_proj and MLP biases (megatron-core's add_bias_linear)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k
    post_norms: bool = False  # norms after the attention and MLP outputs too (Gemma)
    # Multi-latent attention (DeepSeek); kv_lora 0: GQA attention. head_dim is then v_head_dim.
    kv_lora: int = 0  # latent size of keys/values (kv_a_proj output without the RoPE part)
    q_lora: int = 0  # latent size of queries; 0: one q_proj
    qk_nope: int = 0  # per-head q/k size without RoPE
    qk_rope: int = 0  # per-head q/k RoPE size (one RoPE key shared by all heads)
    sinks: bool = False  # a learned per-head logit in every softmax (GPT-OSS's attention sinks)
    attn_gate: bool = False  # q_proj also holds a sigmoid output gate per head (Qwen3-Next)
    # Hybrid models (Qwen3-Next): the gated DeltaNet's sizes and the layers that have it.
    delta: DeltaDims | None = None
    delta_layers: tuple[int, ...] = ()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        if not self.experts:
            return ()
        return tuple(i for i in range(self.layers) if i not in self.dense_layers)


@dataclass(frozen=True)
class Moe:
    """Declared mixture-of-experts switches: HF config keys and module names of the sparse block."""

    #: Config key(s) of the expert count; transformers 5 writes ``num_local_experts`` for
    #: configs whose hub files say ``num_experts`` (its attribute_map): both are read.
    experts_key: str | tuple[str, ...] = ("num_experts", "num_local_experts")
    ffn_key: str = "moe_intermediate_size"
    block: str = "mlp."  # HF module of the router (``gate.weight``) and ``experts.<e>.``
    expert_names: tuple[str, str, str] = SWIGLU  # gate, up, down projections of an expert
    renormalise: bool | str = "norm_topk_prob"  # top-k weights renormalised (or the key)
    shared: bool = False  # ``shared_expert`` MLP with a sigmoid ``shared_expert_gate``
    dense_layers: bool = False  # ``mlp_only_layers`` / ``decoder_sparse_step`` (Qwen-MoE rule)
    jitter: bool = False  # ``router_jitter_noise`` (Mixtral)
    #: Model types whose routed experts PEFT (under transformers 5) addresses by
    #: ``expert_names`` in ``target_modules`` (its MoE conversion of Qwen-MoE-style types):
    #: there those names mean the experts, never the dense or shared-expert MLPs.
    peft_fused: tuple[str, ...] = ()


class Family:
    """Base class of a model family: declarations, with Llama's layout as every default.

    Override a method only for what declarations cannot say (GPT-2's fused ``c_attn``).
    ``check`` raises ``UnsupportedModel`` for config features the translation cannot represent
    exactly (never translate approximately).
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()  # config.json ``model_type`` values
    #: Model types transformers does not know, by the type whose config class reads them
    #: (checkpoints published with remote code: Kimi K2's ``kimi_k2`` is ``deepseek_v3``).
    transformers_types: ClassVar[dict[str, str]] = {}
    #: Prefix of the base model's names; hub checkpoints saved from the base class lack it
    #: (GPT-2's ``h.0.ln_1.weight`` instead of ``transformer.h.0.ln_1.weight``).
    base_prefix: ClassVar[str] = "model."
    #: Regexes of stored tensors that are not weights (HF ignores them too); say why in the file.
    ignored: ClassVar[tuple[str, ...]] = ()
    #: This family's names of the config keys, where they differ from Llama's.
    keys: ClassVar[dict[str, str]] = {}
    #: Values transformers' config class gives keys a config.json may omit (by this family's name).
    defaults: ClassVar[dict[str, Any]] = {
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "router_aux_loss_coef": 0.001,
    }
    norm: ClassVar[str] = "RMSNorm"
    gated: ClassVar[bool] = True
    qk_norm: ClassVar[bool] = False
    post_norms: ClassVar[bool] = False  # a norm after the attention and after the MLP (Gemma)
    #: Activations the gated MLP may have (the adapter resolves them by name).
    gated_activations: ClassVar[tuple[str, ...]] = ("silu", "swish")
    #: Bias switches: fixed, or the config key that holds them.
    qkv_bias: ClassVar[bool | str] = "attention_bias"
    linear_bias: ClassVar[bool | str] = "attention_bias"  # o_proj
    mlp_bias: ClassVar[bool | str] = "mlp_bias"  # must equal linear_bias (one megatron switch)
    learned_positions: ClassVar[bool] = False
    ffn_factor: ClassVar[int] = 0  # intermediate_size null: ffn = ffn_factor * hidden
    #: Stored layers numbered past ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction
    #: modules) are no part of the model: kept aside and written back by exports/conversions.
    extra_layers: ClassVar[bool] = False
    moe: ClassVar[Moe | None] = None
    #: Why cp > 1 is refused for this family ("": context parallelism computes it exactly).
    refuses_cp: ClassVar[str] = ""
    # HF module names (Llama's layout).
    embed: ClassVar[str] = "model.embed_tokens.weight"
    position_table: ClassVar[str] = ""
    layer: ClassVar[str] = "model.layers.{i}."
    input_norm: ClassVar[str] = "input_layernorm."
    post_norm: ClassVar[str] = "post_attention_layernorm."
    final_norm: ClassVar[str] = "model.norm."

    # -- reading the config ---------------------------------------------------------------------
    def value(self, hf: Any, key: str | tuple[str, ...], default: Any = _REQUIRED) -> Any:
        """Config key ``key`` (Llama's name; a tuple: the first one present), else the declared
        default, else ``default``."""
        names = [self.keys.get(k, k) for k in ((key,) if isinstance(key, str) else key)]
        found = next((v for v in (getattr(hf, n, None) for n in names) if v is not None), None)
        if found is None:
            found = self.defaults.get(names[0], default)
        if found is _REQUIRED:
            raise ConfigKeyError(f"config has no {' or '.join(map(repr, names))}: the "
                                 f"{type(self).__name__} family needs it (is config.json "
                                 "complete?).")
        return found

    def fields(self) -> dict[str, Kind]:
        """This family's config keys (its names) and the JSON type each must have."""
        own = {self.keys.get(k, k): kind for k, kind in FIELDS.items()}
        for name, default in self.defaults.items():
            if name not in own and type(default) in _BY_DEFAULT:
                own[name] = _BY_DEFAULT[type(default)]
        return own

    def validate(self, hf: Any) -> None:
        """Refuse a config key of the wrong JSON type (``hfconfig.check_fields``), naming it."""
        check_fields(hf, self.fields(), f"the {type(self).__name__} family")

    def _switch(self, hf: Any, declared: bool | str) -> bool:
        return declared if isinstance(declared, bool) else bool(self.value(hf, declared, False))

    def peft_expert_aliases(self, hf: Any) -> frozenset[str]:
        """HF projection names PEFT reads as this config's routed experts (``Moe.peft_fused``):
        LoRA leaves the dense and shared-expert MLPs of these names alone, since an adapter of
        theirs would load into the experts."""
        model_type = getattr(hf, "model_type", None)  # as transformers' class has it (Kimi K2)
        if self.moe is None or self.transformers_types.get(model_type, model_type) not in \
                self.moe.peft_fused:
            return frozenset()
        return frozenset(self.moe.expert_names)

    def kept_aside(self, hf: Any, name: str) -> bool:
        """Whether stored tensor ``name`` is kept aside (copied through, never loaded)."""
        if not self.extra_layers:
            return False
        head, _, rest = self.layer.partition("{i}")
        for prefix in {head, head.removeprefix(self.base_prefix)}:
            number = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
            if number.isdigit() and int(number) >= self.value(hf, "num_hidden_layers"):
                return True
        return False

    def activation(self, hf: Any) -> str:
        """The MLP activation's HF name (the adapter resolves it to a function)."""
        return self.value(hf, "hidden_act")

    def dims(self, hf: Any) -> Dims:
        """The model's sizes and switches from its config and this family's declarations."""
        self.validate(hf)
        v = self.value
        hidden, heads, layers = (v(hf, "hidden_size"), v(hf, "num_attention_heads"),
                                 v(hf, "num_hidden_layers"))
        ffn = v(hf, "intermediate_size", None if self.ffn_factor else _REQUIRED) or \
            self.ffn_factor * hidden
        linear, mlp = self._switch(hf, self.linear_bias), self._switch(hf, self.mlp_bias)
        if linear != mlp:
            raise UnsupportedModel(
                f"{self.linear_bias}={linear} with {self.mlp_bias}={mlp}: megatron-core has one "
                "switch (add_bias_linear) for the o_proj and MLP biases; both must be equal.")
        moe: dict[str, Any] = {}
        if (m := self.moe) is not None:
            experts = v(hf, m.experts_key)
            moe = dict(experts=experts, top_k=v(hf, "num_experts_per_tok"), ffn=v(hf, m.ffn_key),
                       shared_ffn=v(hf, "shared_expert_intermediate_size") if m.shared else 0,
                       shared_gate=m.shared, dense_ffn=ffn if m.dense_layers else 0,
                       dense_layers=dense_layers(hf, layers, experts) if m.dense_layers else ())
        return Dims(**{
            "hidden": hidden, "layers": layers, "heads": heads,
            "groups": v(hf, "num_key_value_heads", None) or heads,
            "head_dim": v(hf, "head_dim", None) or hidden // heads, "ffn": ffn,
            "vocab": v(hf, "vocab_size"), "tied": bool(v(hf, "tie_word_embeddings")),
            "positions": v(hf, "max_position_embeddings") if self.learned_positions else 0,
            "norm": self.norm, "gated": self.gated, "qkv_bias": self._switch(hf, self.qkv_bias),
            "linear_bias": linear, "qk_norm": self.qk_norm, "post_norms": self.post_norms,
            **moe})

    def check(self, hf: Any) -> None:
        """Raise UnsupportedModel for anything megatron-core cannot represent exactly."""
        self.validate(hf)
        act = self.activation(hf)
        if self.gated and act not in self.gated_activations:
            raise UnsupportedModel(f"hidden_act={act!r}: this family's gated MLP takes "
                                   f"{', '.join(self.gated_activations)}.")
        self.model_kwargs(hf)  # refuses RoPE settings megatron-core cannot compute
        d = self.dims(hf)
        if (m := self.moe) is None:
            return
        if m.dense_layers and len(d.dense_layers) == d.layers:
            experts_key = m.experts_key if isinstance(m.experts_key, str) else m.experts_key[0]
            raise UnsupportedModel(
                f"{experts_key}={d.experts}, mlp_only_layers="
                f"{list(getattr(hf, 'mlp_only_layers', None) or [])}, decoder_sparse_step="
                f"{getattr(hf, 'decoder_sparse_step', 1)}: no layer is sparse; megatron-core "
                "needs at least one MoE layer in a MoE model.")
        if d.top_k == 1 and self._switch(hf, m.renormalise):
            how = f"{m.renormalise}=True" if isinstance(m.renormalise, str) else "renormalising"
            raise UnsupportedModel(
                f"num_experts_per_tok=1 with {how} (every routing weight is 1): megatron-core "
                "refuses top-1 routing without moe_router_pre_softmax.")
        if m.shared and not d.shared_ffn > 0:
            raise UnsupportedModel(
                f"shared_expert_intermediate_size={d.shared_ffn}: megatron-core's shared expert "
                "needs a positive size.")

    # -- megatron-core arguments ----------------------------------------------------------------
    def cp_refusal(self, hf: Any) -> str:
        """Why context parallelism cannot run this config ("" when it can): the family's
        ``refuses_cp``, or what mdtk's context-parallel attention lacks (sliding windows,
        learnable softmax offsets). Asked before any model is built, and by the planner."""
        if self.refuses_cp:
            return self.refuses_cp
        kw = self.transformer_kwargs(hf)
        return rules.cp_attention_problem(kw.get("window_size"),
                                          kw.get("softmax_type", "vanilla")) or ""

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig arguments (model shape and numerics; no parallel sizes, no
        activation function: the adapter adds those)."""
        d, v = self.dims(hf), self.value
        kw: dict[str, Any] = dict(
            num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
            num_query_groups=d.groups, kv_channels=d.head_dim, ffn_hidden_size=d.dense_ffn or d.ffn,
            normalization=d.norm, layernorm_epsilon=v(hf, "rms_norm_eps"),
            gated_linear_unit=d.gated, add_bias_linear=d.linear_bias, add_qkv_bias=d.qkv_bias,
            qk_layernorm=d.qk_norm, hidden_dropout=float(v(hf, "hidden_dropout")),
            attention_dropout=float(v(hf, "attention_dropout")),
            init_method_std=v(hf, "initializer_range"), **window_kwargs(hf))
        if (m := self.moe) is None:
            return kw
        kw.update(num_moe_experts=d.experts, moe_router_topk=d.top_k, moe_ffn_hidden_size=d.ffn,
                  moe_router_pre_softmax=not self._switch(hf, m.renormalise),
                  moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
                  moe_aux_loss_coeff=float(v(hf, "router_aux_loss_coef")))
        if m.jitter:
            kw["moe_input_jitter_eps"] = float(v(hf, "router_jitter_noise", 0.0)) or None
        if d.shared_ffn:
            kw.update(moe_shared_expert_intermediate_size=d.shared_ffn,
                      moe_shared_expert_gate=d.shared_gate)
        if d.dense_layers:
            kw["moe_layer_freq"] = [int(i not in d.dense_layers) for i in range(d.layers)]
        return kw

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        """Arguments of ``toolkit.models.layer_spec``."""
        d = self.dims(hf)
        return {"normalization": d.norm, "qk_layernorm": d.qk_norm,
                **({"num_experts": d.experts} if self.moe else {}),
                **({"multi_latent_attention": True} if d.kv_lora else {})}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        """GPTModel arguments besides vocab_size and share_embeddings_and_output_weights."""
        out = {"max_sequence_length": self.value(hf, "max_position_embeddings")}
        if self.learned_positions:
            return {**out, "position_embedding_type": "learned_absolute"}
        return {**out, **rope_kwargs(hf)}

    # -- the mapping table ----------------------------------------------------------------------
    def stacks(self, hf: Any, d: Dims) -> list[Stack]:
        """Stored tensors that hold many of the table's tensors (``toolkit.mapping.stacked``:
        GPT-OSS's fused experts); none by default."""
        return []

    def attention_rules(self, d: Dims, p: str) -> Rules:
        return builders.attention(p + "self_attn.", d)

    def mlp_rules(self, d: Dims, i: int, p: str) -> Rules:
        m = self.moe
        if m is None or i in d.dense_layers:
            return builders.gated_mlp(p + "mlp.", d.hidden, d.dense_ffn or d.ffn,
                                      bias=d.linear_bias)
        rules = builders.router(f"{p}{m.block}gate.weight", d)
        if d.shared_ffn:
            gate = p + "mlp.shared_expert_gate.weight" if d.shared_gate else None
            rules.update(builders.shared_experts(p + "mlp.shared_expert.", gate, d.hidden,
                                                 d.shared_ffn))
        return rules

    def expert_rules(self, d: Dims, i: int) -> list[Rules]:
        m = self.moe
        if m is None or i in d.dense_layers:
            return []
        block = f"{self.layer.format(i=i)}{m.block}experts."
        return builders.experts(block, d.experts, d.hidden, d.ffn, m.expert_names)

    def layer_rules(self, d: Dims, i: int) -> Rules:
        p = self.layer.format(i=i)
        return {**builders.norm("input_layernorm", p + self.input_norm, d),
                **self.attention_rules(d, p),
                **builders.norm("pre_mlp_layernorm", p + self.post_norm, d),
                **self.mlp_rules(d, i, p)}

    def table(self, hf: Any, d: Dims, padded_vocab: int) -> Table:
        """The mapping: megatron-core name -> split rule over HF tensor names."""
        embedding: Rules = {"embedding.word_embeddings.weight": vocab(self.embed, d.vocab,
                                                                      padded_vocab, d.hidden)}
        if d.positions:
            embedding["embedding.position_embeddings.weight"] = Replicated(
                self.position_table, (d.positions, d.hidden))
        head = self.embed if d.tied else "lm_head.weight"
        return Table(
            embedding=embedding,
            layers=[self.layer_rules(d, i) for i in range(d.layers)],
            experts=[self.expert_rules(d, i) for i in range(d.layers)],
            head={**builders.norm("decoder.final_layernorm", self.final_norm, d),
                  "output_layer.weight": vocab(head, d.vocab, padded_vocab, d.hidden)},
            tied=d.tied)
