"""Which projections of a model LoRA can adapt, checked against the family's mapping table.

The valid targets are the HF projection names (``q_proj``, ``gate_up_proj``, GPT-2's ``c_attn``,
DeepSeek's ``kv_a_proj_with_mqa``, ...) of the decoder layers' linear weights in the family's
table, the names PEFT matches with ``target_modules``. Routed experts are refused: transformers 5
holds them as fused 3-D parameters, which PEFT adapts as one parameter over all experts
(attention, dense MLPs and shared experts are adapted; where PEFT reads their names as the
experts, ``Family.peft_expert_aliases``, they are left alone). Torch-free: the memory model
counts with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from toolkit.lora.plan import COLUMN, ROW, hf_module, linear_rules, target_of
from toolkit.lora.spec import LoraError, LoraSpec
from toolkit.mapping import EXPERTS, Row, Table


@dataclass(frozen=True)
class Projection:
    """One adaptable HF projection of the model: its module, layer and full sizes."""

    module: str
    layer: int
    kind: str  # COLUMN or ROW (megatron-core's split of the layer it sits in)
    in_features: int
    out_features: int

    @property
    def target(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    def numel(self, r: int, dora: bool) -> tuple[int, int]:
        """(TP-sharded, replicated) adapter elements: A is whole in column-parallel layers."""
        a, b = r * self.in_features, self.out_features * (r + int(dora))
        return (b, a) if self.kind == COLUMN else (a, b)


def projections(table: Table) -> list[Projection]:
    """Every adaptable projection of the model, in checkpoint order."""
    out: list[Projection] = []
    for key, rule in linear_rules(table):
        transpose = getattr(rule, "transpose", False)
        for source, shape in rule.hf_shapes().items():
            n_out, n_in = (shape[1], shape[0]) if transpose else shape
            out.append(Projection(hf_module(source), int(key.split(".")[2]),
                                  ROW if isinstance(rule, Row) else COLUMN, n_in, n_out))
    return out


def fan_in_fan_out(table: Table, targets: Iterable[str]) -> bool:
    """Whether the adapted weights are stored ``[in, out]`` (GPT-2's ``Conv1D``): PEFT's
    ``fan_in_fan_out``."""
    wanted = set(targets)
    return any(getattr(rule, "transpose", False) and
               any(target_of(s) in wanted for s in rule.hf_shapes())
               for _, rule in linear_rules(table))


def valid_targets(table: Table) -> list[str]:
    return sorted({p.target for p in projections(table)})


def expert_targets(table: Table) -> list[str]:
    names = {target_of(s) for key, rule in table.items() if f".{EXPERTS}." in key
             for s in rule.hf_shapes()}
    return sorted(names - set(valid_targets(table)))


def resolve_targets(table: Table, wanted: Iterable[str] | None, family: str,
                    peft_experts: frozenset[str] = frozenset()) -> frozenset[str]:
    """The targets to adapt (None: every linear layer of the blocks but ``peft_experts``, the
    names PEFT reads as the routed experts: ``Family.peft_expert_aliases``); LoraError naming
    the valid names for any the model lacks."""
    valid = [t for t in valid_targets(table) if t not in peft_experts]
    if not valid:
        raise LoraError(f"{family}: its mapping has no linear projection LoRA can adapt (mdtk "
                        "maps adapters through the family's split rules).")
    if wanted is None:
        return frozenset(valid)
    wanted = list(wanted)
    if not wanted:
        raise LoraError(f"peft.target_modules is empty: name some of {', '.join(valid)} (or "
                        "leave it out to adapt every linear layer of the blocks).")
    experts = [t for t in wanted if t in expert_targets(table)]
    if experts:
        raise LoraError(f"peft.target_modules {experts}: routed experts of {family} are not "
                        "adapted by mdtk's LoRA (transformers 5 holds them as fused 3-D "
                        "parameters, PEFT as one adapter over all experts: not mapped to "
                        f"megatron-core's experts). Valid targets: {', '.join(valid)}.")
    if aliased := sorted(set(wanted) & peft_experts):
        raise LoraError(f"peft.target_modules {aliased}: PEFT (under transformers 5) reads these "
                        f"names of {family} as its fused routed experts, so an adapter of the "
                        "dense or shared-expert MLPs would load into the experts instead. Valid "
                        f"targets: {', '.join(valid)}.")
    bad = [t for t in wanted if t not in valid]
    if bad:
        raise LoraError(f"peft.target_modules {bad}: {family} has no such projection. Valid "
                        f"targets: {', '.join(valid)}.")
    return frozenset(wanted)


def adapter_spec(adapter: Any, spec: LoraSpec) -> LoraSpec:
    """``spec`` with its targets resolved (empty: all) for a model adapter's family."""
    return spec.with_targets(resolve_targets(
        adapter.table(1), spec.targets or None, adapter.architecture,
        adapter.family.peft_expert_aliases(adapter.hf_config)))


def adapter_numel(table: Table, spec: LoraSpec) -> int:
    """Adapter parameters of the whole model."""
    return sum(sum(p.numel(spec.r, spec.dora)) for p in projections(table)
               if p.target in spec.targets)


def check_adapter(adapter: Any, spec: LoraSpec,
                  shapes: Mapping[str, Mapping[str, tuple[int, ...]]], where: str) -> None:
    """An adapter's tensors (``shapes[module][kind]``) must fit the model: LoraError naming the
    first difference (targets the family lacks, layers past the model's, other sizes)."""
    table = adapter.table(1)
    resolve_targets(table, spec.targets, adapter.architecture,
                    adapter.family.peft_expert_aliases(adapter.hf_config))
    known = {p.module: p for p in projections(table)}
    layers = adapter.dims.layers
    for module, kinds in shapes.items():
        p = known.get(module)
        if p is None:
            raise LoraError(f"{where}: adapter tensor of {module!r}, a module this "
                            f"{adapter.architecture} model ({layers} layers) does not have: the "
                            "adapter was made for another base model.")
        want = {"lora_A": (spec.r, p.in_features), "lora_B": (p.out_features, spec.r),
                "lora_magnitude_vector": (p.out_features,)}
        for kind, shape in kinds.items():
            if tuple(shape) != want[kind]:
                raise LoraError(f"{where}: {module}.{kind} has shape {tuple(shape)}, this model "
                                f"needs {want[kind]} (r={spec.r}, hidden_size="
                                f"{adapter.dims.hidden}): the adapter was made for another base "
                                "model.")
    needed = {p.module for p in known.values() if p.target in spec.targets}
    if missing := sorted(needed - set(shapes)):
        raise LoraError(f"{where}: the adapter lacks {len(missing)} targeted module(s), e.g. "
                        f"{missing[0]}: the adapter was made for another base model (layers).")


def model_projections(hf: Any, spec: LoraSpec) -> tuple[LoraSpec, list[Projection]]:
    """The spec with its targets resolved (empty: all) and the projections it adapts, for an
    HF config (dict view or transformers config) through its family's table (torch-free)."""
    from toolkit.adapters.registry import family_of

    family = family_of(hf)
    dims = family.dims(hf)
    table = family.table(hf, dims, dims.vocab)
    name = type(family).__name__
    spec = spec.with_targets(resolve_targets(table, spec.targets or None, name,
                                             family.peft_expert_aliases(hf)))
    return spec, [p for p in projections(table) if p.target in spec.targets]
