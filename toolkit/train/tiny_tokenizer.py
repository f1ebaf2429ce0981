"""A small real tokenizer built offline: byte-level BPE trained on the bundled example data.

No hub download is possible in CI or on air-gapped clusters, yet tests and the demo need a real
``PreTrainedTokenizerFast`` (special tokens, EOS/pad, a chat template, offsets). This builds one in
about a second and saves it as a normal HF tokenizer folder that ``AutoTokenizer`` loads.

    python -m toolkit.train.tiny_tokenizer OUT_DIR [--vocab-size 512]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from toolkit import bundled
from toolkit.atomic import building

EOS, PAD = "<|endoftext|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

# Each turn is "<|role|>\n{content}<|end|>\n"; the generation prompt is "<|assistant|>\n", so an
# assistant turn's trainable part is "{content}<|end|>\n" (the model learns to stop).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


#: The files the tiny tokenizer learns from: the preference pairs (dpo.jsonl) reuse their texts,
#: and leaving them out keeps the tokenizer (and every test's token ids) as it was.
TEXT_FILES = ("pretrain.jsonl", "sft.jsonl")


def bundled_texts(folder: Path | None = None) -> Iterator[str]:
    """Every text in the pretraining and SFT jsonl files of ``folder`` (default: the demo data
    shipped with mdtk): documents, prompts, responses, chat turns."""
    folder = folder or bundled.path(bundled.DATA)
    files = sorted(f for f in folder.glob("*.jsonl") if f.name in TEXT_FILES)
    if not files:
        raise FileNotFoundError(f"no *.jsonl files in {folder}: pass texts= explicitly.")
    for path in files:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                for key in ("text", "prompt", "response"):
                    if row.get(key):
                        yield row[key]
                for message in row.get("messages") or []:
                    yield message["content"]


def build_tiny_tokenizer(out_dir: str | Path, texts: Iterable[str] | None = None,
                         vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on ``texts`` (default: the bundled example data), wrap it as a
    ``PreTrainedTokenizerFast`` with EOS, pad and a chat template, and save it to ``out_dir``
    (written to a temporary sibling, then renamed). Deterministic for the same inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    special = [EOS, PAD, *ROLE_TOKENS]
    if vocab_size < 256 + len(special):
        raise ValueError(f"vocab_size={vocab_size} is below the 256 byte tokens + "
                         f"{len(special)} special tokens.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts if texts is not None else bundled_texts()), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                      additional_special_tokens=list(ROLE_TOKENS),
                                      model_max_length=1 << 20)
    wrapped.chat_template = CHAT_TEMPLATE

    with building(out) as tmp:
        wrapped.save_pretrained(str(tmp))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    size = 512
    if "--vocab-size" in args:
        i = args.index("--vocab-size")
        size = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        raise SystemExit("usage: python -m toolkit.train.tiny_tokenizer OUT_DIR [--vocab-size N]")
    print(build_tiny_tokenizer(args[0], vocab_size=size))
