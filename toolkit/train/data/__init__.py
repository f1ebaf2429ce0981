"""Training data: sources -> fixed-length samples on disk, memory-mapped by every rank -> the
micro-batches each data-parallel rank reads at a given optimizer step.

Every sample is ``seq_len + 1`` token ids (inputs are ``[:-1]``, labels ``[1:]``) plus a loss mask
over the ``seq_len`` labels. Two modes:

- ``pretrain`` (``pretrain``): every source is a Megatron indexed dataset (``PREFIX.bin/.idx``,
  as written by Megatron-LM's ``preprocess_data.py``, ``mdtk data preprocess`` or DeepSpeed);
  files and hub datasets are tokenised once into one (``preprocess``). megatron-core's GPTDataset
  makes the samples (documents shuffled, concatenated, cut into blocks of ``seq_len + 1`` that
  overlap by one token; the tail dropped) and its BlendedDataset mixes the sources by
  ``data.weights`` into an endless stream (``blend``).
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
  The samples are ``.npy`` arrays per split. ``data.reset_at_eod`` keeps pretraining documents
  apart the same way (position ids restart after every EOS token).

Data order (``GlobalBatchSampler``): the optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)``
of an endless stream (sft: one seeded permutation of the training set per epoch; pretrain: the
blended stream itself, in order). The global batch of a step depends only on (seed, G, step,
data), never on dp or on the run's length: resuming at any step with any dp (and any
micro_batch) that divides the same global batch G sees exactly the same samples in each global
batch. Changing G, the seed or the data is not a resume (the checkpoint manager refuses it).

One module per job: ``settings`` (DataSettings, DataError), ``sources`` (files, globs, hub
datasets, the validation split), ``fingerprint`` (the cache key), ``encoding`` (tokenizer, chat
template), ``sft_formats`` (the four row formats), ``packing``, ``segments`` (bin-packing and
the position ids that keep examples apart), ``modes`` (``data.mode``), ``progress``, ``cache``
(the sft samples on disk and their distributed preparation), ``split`` (what the trainer
reads), ``sampler``; pretraining: ``pretrain`` (the mode), ``indexed_format`` (the .bin/.idx
bytes: read, check, write, merge), ``readers`` (documents in batches, shards), ``preprocess``
(batched tokenising workers), ``fast_bpe`` (the exact byte-level BPE shortcut), ``gpt_sources``
(one GPTDataset per source and split, cached), ``blend`` (the stream, tokens per source).
"""

from toolkit.train.data.cache import (
    PreparedData,
    TokenizedSplit,
    prepare_data,
    prepare_data_distributed,
)
from toolkit.train.data.encoding import encode_chat, encode_plain, load_tokenizer
from toolkit.train.data.fingerprint import FORMAT_VERSION, cache_key
from toolkit.train.data.modes import MODES
from toolkit.train.data.packing import pack_sft
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
from toolkit.train.data.split import with_reset_at_eod

__all__ = [
    "FORMAT_VERSION", "MODES", "SFT_FORMATS", "DataError", "DataSettings", "GlobalBatchSampler",
    "PreparedData", "SftExample", "Source", "TokenizedSplit", "cache_key", "detect_format",
    "encode_chat", "encode_plain", "encode_sft_row", "eval_micro_batches", "eval_rows",
    "load_tokenizer", "pack_sft", "prepare_data", "prepare_data_distributed", "resolve_sources",
    "sft_example", "split_indices", "step_batches", "with_reset_at_eod",
]
