"""mdtk: Hugging Face <-> Megatron-core <-> DeepSpeed toolkit."""

from toolkit import eager_jit as _eager_jit

__version__ = "0.1.0"

_eager_jit.install()
