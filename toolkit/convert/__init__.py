"""Checkpoint conversion, ``inspect`` and ``verify``: the layer above ``toolkit.checkpoint``.

One job per module:
  sources           any format of the registry opened as HF-named tensors through its adapter
  run               ``convert()``: argument checks, the target branch, the report
  megatron_targets  torch_dist and legacy rank files, written by jobs
  pool              jobs balanced by bytes, in this process or in worker processes
  hf_target         the HF target (safetensors shards, transformers' config files)
  readback          ``--verify``: the result read back and compared bit-exactly
  progress          the progress bar
  inspection        ``inspect()``: what a checkpoint folder holds and what is wrong with it
  fp8_quantize      an HF folder quantized into DeepSeek-V3's FP8 layout (tests, benchmarks)
  verify            ``mdtk verify``: two checkpoints' logits on the same tokens (not imported
                    here: it is the only one that builds models)
"""

from toolkit.convert.inspection import Info, inspect
from toolkit.convert.run import DTYPES, TARGETS, Report, convert
from toolkit.convert.sources import Opened, adapter_factory, detect, open_checkpoint

__all__ = ["DTYPES", "TARGETS", "Info", "Opened", "Report", "adapter_factory", "convert",
           "detect", "inspect", "open_checkpoint"]
