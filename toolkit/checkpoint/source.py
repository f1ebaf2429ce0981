"""The interfaces between checkpoint readers and their callers.

- ``TensorSource``: what every reader hands the converter (HF-named tensors read region by
  region). Implemented by ``hf.HFReader``, ``fp8.DequantizingReader``,
  ``canonical.McoreFullSource`` (torch_dist, legacy and trainer checkpoints),
  ``deepspeed.HFNamedSource`` and the trainer's own initial-weights source.
- ``Opening``: what a format's opener returns (``formats``): the source, the model's adapter,
  the format's info.
- ``ModelAdapter``: what the readers need of the model's adapter. Adapters are a layer above
  checkpoints (docs/architecture.md), so this package describes the part it uses and never
  imports ``toolkit.adapters``; ``toolkit.adapters.Adapter`` has it all.

Optional abilities of a source, looked up with ``getattr`` by the converter: ``byte_range(name,
region)`` (where whole rows lie in a file, for copies file to file), ``locate(name)`` (the file
holding a tensor, for error messages), ``segments(name)`` (a whole tensor as byte ranges),
``dequantize_to(dtype)`` (fp8 sources: the dtype dequantized weights come out in).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from toolkit.mapping.rules import Region

if TYPE_CHECKING:
    import torch

    from toolkit.mapping import Table
    from toolkit.mapping.stacked import Stack

__all__ = ["ModelAdapter", "ModelDims", "ModelFamily", "Opening", "Region", "TensorSource"]


class TensorSource(Protocol):
    """HF-named tensors of a checkpoint, read region by region."""

    @property
    def names(self) -> list[str]:
        """Every tensor's name, in the checkpoint's order."""
        ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> Any:
        """A ``torchfree.dtypes.DType`` or a torch dtype (they compare equal by name)."""
        ...

    def read(self, name: str, region: Region) -> torch.Tensor:
        """The region ``((start, stop), ...)`` of tensor ``name``, reading only that region
        where the format allows."""
        ...

    def close(self) -> None: ...


class ModelDims(Protocol):
    """The sizes of a model the readers and writers use (``toolkit.adapters.Dims``)."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    vocab: int
    tied: bool  # the output layer is the embedding
    experts: int  # routed experts (0: a dense model)


class ModelFamily(Protocol):
    """What the readers and writers ask of a model family (``toolkit.adapters.Family``)."""

    base_prefix: str  # the prefix checkpoints saved from the base model class lack

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]: ...

    def model_kwargs(self, hf: Any) -> dict[str, Any]: ...

    def table(self, hf: Any, d: Any, padded_vocab: int) -> Table: ...


class ModelAdapter(Protocol):
    """What the readers and writers ask of the model's adapter (``toolkit.adapters.Adapter``):
    its HF config, family and sizes, the mapping table at a tensor-parallel size, and the folder
    its config came from (tokenizer files are copied from there)."""

    hf_config: Any
    family: ModelFamily
    source: Path | None

    @property
    def dims(self) -> ModelDims: ...

    @property
    def architecture(self) -> str: ...

    def table(self, tp: int) -> Table:
        """The mapping at tensor-parallel size ``tp``, the vocab padded as the adapter pads."""
        ...

    def table_at(self, padded_vocab: int) -> Table:
        """The mapping with the vocab padded to ``padded_vocab`` rows (a checkpoint's own)."""
        ...

    @property
    def stacks(self) -> list[Stack]:
        """Stored HF tensors holding many of the table's tensors (``toolkit.mapping.stacked``)."""
        ...


class Opening(NamedTuple):
    """A checkpoint opened by its format: ``source`` (close it when done), the model's
    ``adapter`` (built by the caller's factory from the config the checkpoint carries) and
    ``info`` (optional keys ``iteration``, ``layout``, ``files``, ``folder``,
    ``quantization``)."""

    source: TensorSource
    adapter: ModelAdapter
    info: dict[str, Any]
