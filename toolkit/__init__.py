"""mdtk: Hugging Face <-> Megatron-core <-> DeepSpeed toolkit."""

__version__ = "0.1.0"
