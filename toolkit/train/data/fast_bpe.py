"""A faster encoder for byte-level BPE tokenizers (GPT-2's pipeline: no normalizer, the
``ByteLevel`` pre-tokenizer with its regex, a BPE model), exact on the documents it accepts.

The Rust pipeline splits a text into words with GPT-2's pattern (``'s|'t|'re|'ve|'m|'ll|'d|
?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``), maps each word's bytes to
characters and runs BPE on each word. Here the split is the standard library's ``re`` with the
pattern's ASCII form, and each word's ids come from the tokenizer's own BPE model
(``model.tokenize``), remembered per word. Accepted documents are those where both are provably
the same: only printable ASCII, tab, newline and carriage return (there ``\\p{L}`` is [A-Za-z],
``\\p{N}`` is [0-9] and ``\\s`` is space, tab, newline, CR in every regex engine), and none of the
tokenizer's added tokens (which the Rust pipeline cuts out first). Other documents, and any
tokenizer of another shape, go through the Rust pipeline.
"""

from __future__ import annotations

import json
import re

#: GPT-2's pattern on the accepted alphabet (printable ASCII, \t, \n, \r).
ASCII_PATTERN = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+"
                           r"|\s+(?!\S)|\s+")
_OUTSIDE = re.compile(r"[^\t\n\r\x20-\x7e]")
_CACHE_WORDS = 1 << 20  # the word cache starts over beyond this many entries


def _byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode for the ASCII bytes: printable ones stand for themselves, the
    others (space, tab, ...) for 256 + their rank among the bytes that are not."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return {b: c for b, c in table.items() if b < 128}


class ByteLevelBPE:
    """The fast path of one tokenizer; ``of`` returns None when it has another shape."""

    def __init__(self, model, added: list[str]):
        self.model = model
        self.added = [a for a in added if a]
        self.first = "".join(sorted({a[0] for a in self.added}))
        self.to_chars = str.maketrans({chr(b): c for b, c in _byte_chars().items()})
        self.cache: dict[str, list[int]] = {}

    @classmethod
    def of(cls, rust) -> ByteLevelBPE | None:
        """For a ``tokenizers.Tokenizer`` with GPT-2's pipeline (as written in its JSON)."""
        spec = json.loads(rust.to_str())
        pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        if (spec.get("normalizer") is not None or pre.get("type") != "ByteLevel"
                or pre.get("add_prefix_space") or not pre.get("use_regex", True)
                or model.get("type") != "BPE" or model.get("dropout")):
            return None
        return cls(rust.model, [t["content"] for t in spec.get("added_tokens", [])])

    def accepts(self, text: str) -> bool:
        if _OUTSIDE.search(text):
            return False
        if self.first and any(c in text for c in self.first):
            return not any(a in text for a in self.added)
        return True

    def ids(self, text: str) -> list[int]:
        """The ids the Rust pipeline gives ``text`` without special tokens (accepted texts)."""
        out: list[int] = []
        cache = self.cache
        for word in ASCII_PATTERN.findall(text):
            got = cache.get(word)
            if got is None:
                got = [t.id for t in self.model.tokenize(word.translate(self.to_chars))]
                if len(cache) >= _CACHE_WORDS:
                    cache.clear()
                cache[word] = got
            out.extend(got)
        return out
