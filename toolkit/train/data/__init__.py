"""Training data: HF ``datasets`` sources -> tokenised fixed-length samples cached on disk ->
the micro-batches each data-parallel rank reads at a given optimizer step.

Every sample is ``seq_len + 1`` token ids (inputs are ``[:-1]``, labels ``[1:]``) plus a loss mask
over the ``seq_len`` labels, stored as two ``.npy`` arrays that every rank memory-maps. Two modes:

- ``pretrain``: each document is tokenised (the tokenizer's own BOS convention), EOS appended,
  all documents concatenated and cut into blocks of ``seq_len + 1`` that overlap by one token
  (every token is a label once); the tail shorter than a block is dropped. Loss mask all ones.
- ``sft``: each row is read in one of four formats, detected per row from its keys (so each
  source, and each row of a mixed file, may have its own) or forced by ``data.format``:
  OpenAI-style ``{messages: [{role, content}, ...]}``, ``{prompt, response}``, Alpaca
  ``{instruction, input?, output}`` and ShareGPT ``{conversations: [{from, value}, ...]}``
  (see ``SftExample``). With the tokenizer's chat template (``data.template`` chat, or auto and
  the tokenizer has one) every row is rendered as a conversation and the loss mask is 1 exactly
  on the tokens of assistant turns (what the template renders after the generation prompt,
  including its end-of-turn marker). Without it, prompt/response and Alpaca rows are
  ``tokens(prompt) + tokens(response) + [EOS]`` with the mask on response + EOS (Alpaca's prompt
  is the Stanford Alpaca template); conversations then need a template and are refused. Rows
  longer than ``seq_len + 1`` are truncated (rows left with no response token are dropped);
  shorter ones are right-padded (mask 0), or, with ``pack``, bin-packed several to a sequence
  (``segments``: first-fit decreasing under the seed) with their boundaries recorded, and the
  micro-batch's position ids restart at every example, so the model keeps them apart
  (``toolkit.models.packed``). A row that cannot be read is reported with its file and line.
  ``data.reset_at_eod`` does the same for pretraining documents (position ids restart after
  every EOS token).

Data order (``GlobalBatchSampler``): the optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)``
of an endless stream made of one seeded permutation of the training set per epoch. The global
batch of a step depends only on (seed, G, step, data), never on dp: resuming at any step with any
dp (and any micro_batch) that divides the same global batch G sees exactly the same samples in
each global batch. Changing G, the seed or the data is not a resume (the checkpoint manager
refuses it).

One module per job: ``settings`` (DataSettings, DataError), ``sources`` (files, globs, hub
datasets, the validation split), ``fingerprint`` (the cache key), ``encoding`` (tokenizer, chat
template), ``sft_formats`` (the four row formats), ``packing``, ``segments`` (bin-packing and
the position ids that keep examples apart), ``modes`` (``data.mode``: one
module each, ``pretrain`` and ``sft``), ``progress``, ``cache`` (disk cache and its distributed
preparation) and ``sampler``. A new data mode is a module and its line in ``modes.MODES``.
"""

from toolkit.train.data.cache import (
    PreparedData,
    TokenizedSplit,
    prepare_data,
    prepare_data_distributed,
    with_reset_at_eod,
)
from toolkit.train.data.encoding import encode_chat, encode_plain, load_tokenizer
from toolkit.train.data.fingerprint import FORMAT_VERSION, cache_key
from toolkit.train.data.modes import MODES
from toolkit.train.data.packing import pack_pretrain, pack_sft
from toolkit.train.data.sampler import (
    GlobalBatchSampler,
    eval_micro_batches,
    eval_rows,
    step_batches,
)
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sft_formats import (
    SFT_FORMATS,
    SftExample,
    detect_format,
    encode_sft_row,
    sft_example,
)
from toolkit.train.data.sources import Source, resolve_sources, split_indices

__all__ = [
    "FORMAT_VERSION", "MODES", "SFT_FORMATS", "DataError", "DataSettings", "GlobalBatchSampler",
    "PreparedData", "SftExample", "Source", "TokenizedSplit", "cache_key", "detect_format",
    "encode_chat", "encode_plain", "encode_sft_row", "eval_micro_batches", "eval_rows",
    "load_tokenizer",
    "pack_pretrain", "pack_sft", "prepare_data", "prepare_data_distributed", "resolve_sources",
    "sft_example", "split_indices", "step_batches", "with_reset_at_eod",
]
