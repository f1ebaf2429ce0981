"""One value that describes how a job is split across ranks, validated in one place.

Every process group, every shard plan and every DeepSpeed batch identity is derived from a
``ParallelLayout``; ``resolve(world_size)`` derives dp once and returns a ``ResolvedLayout``, the
type every function that needs dp or the world size takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.errors import UserError


class LayoutError(UserError):
    """A layout that cannot work: the message names the number and what to change."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension. ``dp=None`` means "infer from the world size".

    vpp is the number of virtual pipeline stages per pipeline rank (None = not interleaved).
    etp is the tensor-parallel size inside experts (None = same as tp, megatron-core's default).
    Rank order follows megatron-core: tp fastest, then cp, (ep inside dp), dp, pp slowest.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    vpp: int | None = None
    etp: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "dp", "vpp", "etp"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r}: every parallel size must be an integer >= 1.")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise LayoutError(
                f"vpp={self.vpp} needs pipeline parallelism: set pp >= 2 or drop vpp."
            )
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError(
                "sequence_parallel=True needs tp >= 2 (it splits activations across the "
                "tensor-parallel group): set tp >= 2 or sequence_parallel=False."
            )

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def model_parallel(self) -> int:
        """Ranks that hold different pieces of one model replica (dp excluded)."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def experts_whole_on_tp_ranks(self) -> bool:
        """Expert-TP 1 below TP without expert parallelism: every tp rank holds all experts
        and runs them on its share of the tokens (their grads summed over tp like replicated
        weights: ``toolkit.parallel.grads``)."""
        return self.expert_tp == 1 < self.tp and self.ep == 1

    @property
    def virtual_stages(self) -> int:
        return self.pp * (self.vpp or 1)

    def resolve(self, world_size: int) -> ResolvedLayout:
        """This layout on ``world_size`` ranks: dp filled in and every cross-dimension constraint
        checked. Resolve once where the world size becomes known (a command, the trainer) and
        pass the ``ResolvedLayout`` down."""
        if world_size < 1:
            raise LayoutError(f"world size {world_size} must be >= 1.")
        mp = self.model_parallel
        if world_size % mp:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*"
                f"{self.cp} = {mp}: launch a multiple of {mp} ranks or change tp/pp/cp."
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise LayoutError(
                f"world size {world_size} != dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*"
                f"{self.cp} = {self.dp * mp}: launch {self.dp * mp} ranks, or set dp={dp} "
                "(or leave dp unset to infer it)."
            )
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelLayout)}
        return ResolvedLayout(**{**fields, "dp": dp})

    def validate_model(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_query_groups: int | None = None,
        num_experts: int | None = None,
        vocab_size: int | None = None,
        ffn_hidden_size: int | None = None,
        seq_len: int | None = None,
    ) -> None:
        """Raise LayoutError if the model cannot be split this way; each message says the fix."""
        groups = num_query_groups or num_heads
        if num_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_heads} is not divisible by tp={self.tp}: choose tp "
                f"from {_divisors(num_heads)}."
            )
        if groups % self.tp:
            raise LayoutError(
                f"num_key_value_heads (query groups)={groups} is not divisible by tp={self.tp}: "
                f"choose tp from {_divisors(groups)}."
            )
        stages = self.virtual_stages
        if num_layers % stages:
            what = f"pp*vpp = {self.pp}*{self.vpp}" if self.vpp else f"pp={self.pp}"
            raise LayoutError(
                f"num_hidden_layers={num_layers} is not divisible by {what} = {stages}: choose "
                f"pp (x vpp) from {_divisors(num_layers)}."
            )
        if self.vpp and num_layers // stages < 1:
            raise LayoutError(f"num_hidden_layers={num_layers} too small for {stages} stages.")
        if num_experts:
            if num_experts % self.ep:
                raise LayoutError(
                    f"num_experts={num_experts} is not divisible by ep={self.ep}: choose ep "
                    f"from {_divisors(num_experts)}."
                )
        elif self.ep > 1:
            raise LayoutError(f"ep={self.ep} needs a mixture-of-experts model; set ep=1.")
        if ffn_hidden_size is not None and ffn_hidden_size % self.tp:
            raise LayoutError(
                f"intermediate_size={ffn_hidden_size} is not divisible by tp={self.tp}: choose "
                f"tp from {_divisors(ffn_hidden_size)}."
            )
        if vocab_size is not None and vocab_size < self.tp:
            raise LayoutError(f"vocab_size={vocab_size} is smaller than tp={self.tp}.")
        if seq_len is not None:
            self.validate_seq_len(seq_len)

    def validate_seq_len(self, seq_len: int) -> None:
        """Raise LayoutError if sequences of ``seq_len`` cannot be split over cp / sp ranks (a
        training-shape check, usable before the model's sizes are known)."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise LayoutError(
                f"seq_len={seq_len} is not divisible by 2*cp = {2 * self.cp} (context "
                "parallelism splits each sequence into 2*cp chunks): change seq_len or cp."
            )
        if self.sequence_parallel and seq_len % (self.tp * self.cp):
            where = f"tp={self.tp}" if self.cp == 1 else f"tp*cp = {self.tp}*{self.cp}"
            raise LayoutError(
                f"seq_len={seq_len} is not divisible by {where} (sequence parallelism "
                "splits each context-parallel rank's part of the sequence across tensor-parallel "
                "ranks): change seq_len or tp."
            )

    def describe(self) -> str:
        parts = [f"dp={self.dp if self.dp is not None else '?'}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp:
            parts.append(f"vpp={self.vpp}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.etp is not None:
            parts.append(f"etp={self.etp}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


@dataclass(frozen=True)
class ResolvedLayout(ParallelLayout):
    """A layout for a known world size (``ParallelLayout.resolve`` makes it): dp derived, every
    cross-dimension constraint checked. Functions that need dp or the world size take this
    type, so a layout is resolved once, where the world size becomes known, and passed down."""

    dp: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        # megatron-core folds experts into the dp*cp*tp block: ep*etp must divide it.
        block = self.dp * self.cp * self.tp
        if block % (self.ep * self.expert_tp):
            raise LayoutError(
                f"ep*etp = {self.ep}*{self.expert_tp} = {self.ep * self.expert_tp} must divide "
                f"dp*cp*tp = {self.dp}*{self.cp}*{self.tp} = {block}: lower ep/etp or add "
                "data-parallel ranks."
            )

    @property
    def world_size(self) -> int:
        return self.model_parallel * self.dp

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Itself on its own world size (nothing to derive again); another world size is refused
        as for any layout whose dp is set."""
        return self if world_size == self.world_size else super().resolve(world_size)

    @property
    def dp_cp(self) -> int:
        """DeepSpeed's data-parallel group (mdtk's mpu): dp x cp. The cp ranks of a dp rank hold
        the same weights, so ZeRO partitions, gradient averaging and the batch identity
        (train_batch_size = micro x accumulation x dp_cp) span them; the sampler uses dp only."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: megatron-core's expert-data-parallel size."""
        return self.world_size // (self.ep * self.expert_tp * self.pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
