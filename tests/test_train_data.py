"""Data pipeline: SFT masks checked by hand, packing, cache, split, sources, sampler order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from toolkit import bundled
from toolkit.train.data import (
    DataError,
    DataSettings,
    GlobalBatchSampler,
    SftExample,
    cache_key,
    encode_chat,
    encode_plain,
    eval_micro_batches,
    load_tokenizer,
    pack_sft,
    prepare_data,
    resolve_sources,
    sft_example,
    split_indices,
    step_batches,
)
from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

BUNDLED_DATA = bundled.path(bundled.DATA)

# A word-level tokenizer whose token sequence can be written down by hand.
WORDS = ["<eos>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>", "two", "plus", "three", "is",
         "five", "and", "one", "[UNK]", "<|system|>", "<|tool|>", "be", "brief", "sum", "call"]
HAND_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHAT = [{"role": "user", "content": "two plus three"}, {"role": "assistant", "content": "is five"},
        {"role": "user", "content": "and one"}, {"role": "assistant", "content": "is one"}]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="[UNK]",
                                   additional_special_tokens=["<|user|>", "<|assistant|>",
                                                              "<|end|>", "<|system|>",
                                                              "<|tool|>"])
    fast.chat_template = HAND_TEMPLATE
    path = tmp_path_factory.mktemp("word_tok")
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok"))


def _ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_mask_equals_hand_computed_positions(word_tokenizer):
    tok = load_tokenizer(word_tokenizer)
    ids, mask = encode_chat(CHAT, tok)
    # <|user|> two plus three <|end|> <|assistant|> is five <|end|> <|user|> and one <|end|>
    # <|assistant|> is one <|end|>   -> assistant tokens at 6, 7, 8 and 14, 15, 16
    assert ids == _ids("<|user|>", "two", "plus", "three", "<|end|>", "<|assistant|>", "is",
                       "five", "<|end|>", "<|user|>", "and", "one", "<|end|>", "<|assistant|>",
                       "is", "one", "<|end|>")
    assert [i for i, m in enumerate(mask) if m] == [6, 7, 8, 14, 15, 16]


def test_plain_mask_equals_hand_computed_positions(word_tokenizer):
    ids, mask = encode_plain("two plus three", "is five", load_tokenizer(word_tokenizer))
    assert ids == _ids("two", "plus", "three", "is", "five", "<eos>")
    assert mask == [0, 0, 0, 1, 1, 1]


def test_prepared_sft_batch_masks_exactly_the_response_labels(word_tokenizer, tmp_path):
    src = _write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": CHAT, "prompt": None, "response": None},
        {"messages": None, "prompt": "two plus three", "response": "is five"},
    ])
    for template in ("auto", "plain"):
        settings = DataSettings(mode="sft", sources=(str(src),), seq_len=20, template=template)
        if template == "plain":  # chat rows need the template: refused with the reason
            with pytest.raises(DataError, match="data.template=plain"):
                prepare_data(settings, word_tokenizer, tmp_path / "cache")
            continue
        data = prepare_data(settings, word_tokenizer, tmp_path / "cache")
        assert len(data.train) == 2 and data.validation is None
        b = data.train.batch([0, 1])
        assert b["tokens"].shape == (2, 20) and b["loss_mask"].shape == (2, 20)
        # labels are shifted by one: label t predicts token t+1
        chat_pos = b["loss_mask"][0].nonzero().flatten().tolist()
        assert chat_pos == [5, 6, 7, 13, 14, 15]
        assert b["labels"][0, chat_pos].tolist() == _ids("is", "five", "<|end|>", "is", "one",
                                                         "<|end|>")
        # the prompt/response row went through the chat template (template=auto, one exists)
        qa_pos = b["loss_mask"][1].nonzero().flatten().tolist()
        assert qa_pos == [5, 6, 7]
        assert b["tokens"][1, :9].tolist() == _ids("<|user|>", "two", "plus", "three", "<|end|>",
                                                   "<|assistant|>", "is", "five", "<|end|>")
        assert b["tokens"][1, 9:].tolist() == [WORDS.index("<pad>")] * 11
        assert b["position_ids"][1].tolist() == list(range(20))


# Alpaca rows: an empty input, an input, no input key at all.
ALPACA = [{"instruction": "two plus three", "input": "", "output": "is five"},
          {"instruction": "sum", "input": "two plus three", "output": "is five"},
          {"instruction": "and one", "output": "is one"}]
# ShareGPT rows: a system turn and two exchanges; "user"/"assistant" aliases and a tool turn.
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "be brief"},
                       {"from": "human", "value": "two plus three"},
                       {"from": "gpt", "value": "is five"},
                       {"from": "human", "value": "and one"},
                       {"from": "gpt", "value": "is one"}]},
    {"conversations": [{"from": "user", "value": "sum two plus three"},
                       {"from": "assistant", "value": "call sum"},
                       {"from": "tool", "value": "five"},
                       {"from": "gpt", "value": "is five"}]},
]
# What HAND_TEMPLATE renders for each row, and the positions of its assistant tokens.
ALPACA_CHAT = [
    (("<|user|>", "two", "plus", "three", "<|end|>", "<|assistant|>", "is", "five", "<|end|>"),
     [6, 7, 8]),
    (("<|user|>", "sum", "two", "plus", "three", "<|end|>", "<|assistant|>", "is", "five",
      "<|end|>"), [7, 8, 9]),
    (("<|user|>", "and", "one", "<|end|>", "<|assistant|>", "is", "one", "<|end|>"), [5, 6, 7]),
]
SHAREGPT_CHAT = [
    (("<|system|>", "be", "brief", "<|end|>", "<|user|>", "two", "plus", "three", "<|end|>",
      "<|assistant|>", "is", "five", "<|end|>", "<|user|>", "and", "one", "<|end|>",
      "<|assistant|>", "is", "one", "<|end|>"), [10, 11, 12, 18, 19, 20]),
    (("<|user|>", "sum", "two", "plus", "three", "<|end|>", "<|assistant|>", "call", "sum",
      "<|end|>", "<|tool|>", "five", "<|end|>", "<|assistant|>", "is", "five", "<|end|>"),
     [7, 8, 9, 14, 15, 16]),
]
# The Stanford Alpaca prompts, written out (the reference the plain rendering must equal).
STANFORD_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                     "appropriately completes the request.\n\n### Instruction:\n{}\n\n"
                     "### Response:\n")
STANFORD_INPUT = ("Below is an instruction that describes a task, paired with an input that "
                  "provides further context. Write a response that appropriately completes the "
                  "request.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n")


def test_alpaca_and_sharegpt_chat_masks_equal_hand_computed_positions(word_tokenizer, tmp_path):
    alpaca = _write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    sharegpt = _write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)
    # two sources with different columns, each read in its own format (detected per row)
    settings = DataSettings(mode="sft", sources=(str(alpaca), str(sharegpt)), seq_len=24)
    data = prepare_data(settings, word_tokenizer, tmp_path / "cache")
    assert len(data.train) == 5 and data.meta["train"]["truncated"] == 0
    b = data.train.batch(np.arange(5))
    for i, (words, answer) in enumerate(ALPACA_CHAT + SHAREGPT_CHAT):
        assert b["tokens"][i, : len(words)].tolist() == _ids(*words), i
        assert b["tokens"][i, len(words):].tolist() == [WORDS.index("<pad>")] * (24 - len(words))
        # label t predicts token t+1: the mask sits one position before each answer token
        pos = b["loss_mask"][i].nonzero().flatten().tolist()
        assert pos == [p - 1 for p in answer], i
        assert b["labels"][i, pos].tolist() == [_ids(words[p])[0] for p in answer], i
    # the same rows mixed in one file tokenise the same (the format is read per row)
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [ALPACA[0], SHAREGPT[0], ALPACA[1],
                                                    SHAREGPT[1], ALPACA[2]])
    again = prepare_data(DataSettings(mode="sft", sources=(str(mixed),), seq_len=24),
                         word_tokenizer, tmp_path / "cache")
    order = [0, 3, 1, 4, 2]
    assert np.array_equal(again.train.tokens, np.asarray(data.train.tokens)[order])
    assert np.array_equal(again.train.loss_mask, np.asarray(data.train.loss_mask)[order])
    # forcing the format reads the same, and is part of the cache key
    forced = DataSettings(mode="sft", sources=(str(alpaca),), seq_len=24, sft_format="alpaca")
    assert cache_key(forced, word_tokenizer) != cache_key(
        DataSettings(mode="sft", sources=(str(alpaca),), seq_len=24), word_tokenizer)
    got = prepare_data(forced, word_tokenizer, tmp_path / "cache")
    assert np.array_equal(got.train.tokens, np.asarray(data.train.tokens)[:3])


def test_alpaca_chat_turns_and_sharegpt_roles():
    s = DataSettings(mode="sft", sources=(), seq_len=8)
    assert sft_example(ALPACA[1], s) == SftExample(
        "alpaca", [{"role": "user", "content": "sum\n\ntwo plus three"},
                   {"role": "assistant", "content": "is five"}],
        (STANFORD_INPUT.format("sum", "two plus three"), "is five"))
    assert sft_example(ALPACA[0], s).plain == (STANFORD_NO_INPUT.format("two plus three"),
                                               "is five")
    assert sft_example({**ALPACA[0], "input": " \n"}, s).messages[0]["content"] == "two plus three"
    got = sft_example(SHAREGPT[1], s)
    assert got.plain is None  # a conversation has no template-free rendering
    assert [m["role"] for m in got.messages] == ["user", "assistant", "tool", "assistant"]
    roles = {"Human": "user", "GPT": "assistant", "chatgpt": "assistant",
             "observation": "tool", "system": "system"}
    for who, role in roles.items():
        row = {"conversations": [{"from": who, "value": "x"}]}
        assert sft_example(row, s).messages == [{"role": role, "content": "x"}]


def test_alpaca_plain_is_the_stanford_template(tiny_tokenizer, tmp_path):
    rows = [{"instruction": "Spell the word sheep backwards.", "input": "", "output": "p e e h s."},
            {"instruction": "Answer the question.", "input": "What is 5 plus 4?",
             "output": "5 plus 4 is 9."}]
    prompts = [STANFORD_NO_INPUT.format(rows[0]["instruction"]),
               STANFORD_INPUT.format(rows[1]["instruction"], rows[1]["input"])]
    tok = load_tokenizer(tiny_tokenizer)
    hand = []
    for row, prompt in zip(rows, prompts, strict=True):
        p = tok(prompt)["input_ids"]
        r = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        hand.append((p + r, list(range(len(p), len(p) + len(r)))))
    seq_len = max(len(ids) for ids, _ in hand) + 1
    src = _write_jsonl(tmp_path / "alpaca.jsonl", rows)
    data = prepare_data(DataSettings(mode="sft", sources=(str(src),), seq_len=seq_len,
                                     template="plain"), tiny_tokenizer, tmp_path / "cache")
    b = data.train.batch([0, 1])
    for i, (ids, answer) in enumerate(hand):
        assert b["tokens"][i, : len(ids)].tolist() == ids
        pos = b["loss_mask"][i].nonzero().flatten().tolist()
        assert pos == [p - 1 for p in answer]
        assert tok.decode(b["labels"][i, pos]) == rows[i]["output"] + "<|endoftext|>"
    # a conversation has no plain rendering: refused, naming the row and the reason
    conv = _write_jsonl(tmp_path / "conv.jsonl", SHAREGPT)
    with pytest.raises(DataError, match=r"conv\.jsonl:1: the row is a conversation \(sharegpt\)"
                       r" but data\.template=plain"):
        prepare_data(DataSettings(mode="sft", sources=(str(conv),), seq_len=32,
                                  template="plain"), tiny_tokenizer, tmp_path / "cache")


def _sft_error(tokenizer: str, tmp_path: Path, text: str, name: str = "bad.jsonl",
               **settings) -> str:
    src = tmp_path / name
    src.write_text(text)
    with pytest.raises(DataError) as e:
        prepare_data(DataSettings(mode="sft", sources=(str(src),), seq_len=24, **settings),
                     tokenizer, tmp_path / "cache")
    return str(e.value)


def test_sft_row_errors_name_file_line_keys_and_formats(word_tokenizer, tmp_path):
    good = json.dumps(ALPACA[0]) + "\n"
    msg = _sft_error(word_tokenizer, tmp_path,
                     good + "\n" + json.dumps({"question": "two", "answer": "five"}) + "\n")
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:3: the sft row has keys "
                          "['answer', 'question'], which fit no known format.")
    for fmt in ("messages ('messages'", "prompt_response ('prompt' + 'response')",
                "alpaca ('instruction' + 'output', optional 'input')",
                "sharegpt ('conversations'", "data.prompt_field", "Rename the columns"):
        assert fmt in msg
    both = {**ALPACA[0], "prompt": "two", "response": "five"}
    msg = _sft_error(word_tokenizer, tmp_path, json.dumps(both) + "\n")
    assert (":1: the sft row has keys ['input', 'instruction', 'output', 'prompt', 'response'],"
            " which fit several formats (prompt_response, alpaca): set data.format") in msg
    msg = _sft_error(word_tokenizer, tmp_path, good + json.dumps(SHAREGPT[0]) + "\n",
                     sft_format="alpaca")
    assert ":2: data.format=alpaca but the row has no ['instruction', 'output'] (its keys: " \
           "['conversations'])" in msg
    turns = [{"from": "human", "value": "two"}, {"from": "bot", "value": "five"}]
    msg = _sft_error(word_tokenizer, tmp_path, json.dumps({"conversations": turns}) + "\n")
    assert "turn 1 of 'conversations' is from 'bot', not a ShareGPT role" in msg
    msg = _sft_error(word_tokenizer, tmp_path, json.dumps({"conversations": CHAT}) + "\n")
    assert "set data.format=messages and data.messages_field=conversations" in msg
    msg = _sft_error(word_tokenizer, tmp_path,
                     json.dumps({"messages": SHAREGPT[0]["conversations"]}) + "\n")
    assert "set data.format=sharegpt and data.conversations_field=messages" in msg
    msg = _sft_error(word_tokenizer, tmp_path, json.dumps({"instruction": ["two"],
                                                           "output": "five"}) + "\n")
    assert "bad.jsonl:1: 'instruction' must be a string, got list" in msg
    msg = _sft_error(word_tokenizer, tmp_path, good + '{"instruction": "two",\n' + good)
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:2: not valid JSON (")
    msg = _sft_error(word_tokenizer, tmp_path, "two plus three\n", name="plain.txt")
    assert "row 1: the sft row has keys ['text'] (plain text is data.mode=pretrain)" in msg


def test_sft_error_line_survives_split_and_multi_file_sources(word_tokenizer, tmp_path):
    folder = tmp_path / "rows"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", ALPACA)
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SHAREGPT) + "\n"
                                    + json.dumps({"instruction": "two"}) + "\n")
    for split in (0.0, 0.5):  # the bad row lands in either split: its line is the same
        for seed in (1, 2):
            with pytest.raises(DataError, match=r"b\.jsonl:4: the sft row has keys "
                               r"\['instruction'\]"):
                prepare_data(DataSettings(mode="sft", sources=(str(folder),), seq_len=24,
                                          validation_split=split, seed=seed),
                             word_tokenizer, tmp_path / "cache")


def test_data_format_in_config():
    from toolkit.train.config import ConfigError, load_config

    yaml = BUNDLED_DATA.parent / "sft_tiny.yaml"
    cfg = load_config(yaml, ["data.format=sharegpt", "data.conversations_field=turns"])
    s = DataSettings.from_config(cfg)
    assert (s.sft_format, s.conversations_field) == ("sharegpt", "turns")
    assert DataSettings.from_config(load_config(yaml)).sft_format == "auto"
    with pytest.raises(ConfigError, match="data.format='vicuna' is not allowed: choose one of "
                       "auto, messages, prompt_response, alpaca, sharegpt"):
        load_config(yaml, ["data.format=vicuna"])
    with pytest.raises(ConfigError, match="data.format=alpaca applies to sft only"):
        load_config(yaml, ["data.mode=pretrain", "data.format=alpaca"])


def test_bundled_sft_masks_decode_to_the_assistant_text(tiny_tokenizer, tmp_path):
    rows = [json.loads(x) for x in (BUNDLED_DATA / "sft.jsonl").read_text().splitlines()[:40]]
    src = _write_jsonl(tmp_path / "part.jsonl", rows)
    data = prepare_data(DataSettings(mode="sft", sources=(str(src),), seq_len=128),
                        tiny_tokenizer, tmp_path / "cache")
    assert data.meta["train"]["truncated"] == 0 and len(data.train) == 40
    tok = load_tokenizer(tiny_tokenizer)
    b = data.train.batch(np.arange(40))
    for i, row in enumerate(rows):
        answers = ([m["content"] for m in row["messages"] if m["role"] == "assistant"]
                   if row.get("messages") else [row["response"]])
        got = tok.decode(b["labels"][i][b["loss_mask"][i] > 0])
        assert got == "".join(a + "<|end|>\n" for a in answers)


def test_pack_sft_pad_pack_truncate_drop():
    a = ([5, 6, 7], [0, 1, 1])
    b = ([8, 9], [0, 1])
    tokens, mask, stats, where = pack_sft([a, b], seq_len=5, pad_id=0, pack=False)
    assert tokens.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert where["examples"].tolist() == [[0, 3], [0, 2]]
    assert where["row_offsets"].tolist() == [0, 1, 2]
    tokens, mask, _, where = pack_sft([a, b], seq_len=5, pad_id=0, pack=True)
    assert tokens.tolist() == [[5, 6, 7, 8, 9, 0]]
    assert mask.tolist() == [[1, 1, 0, 1, 0]]
    assert where["examples"].tolist() == [[0, 3], [3, 2]]
    long_ok = (list(range(10, 18)), [0, 0, 1, 1, 1, 1, 1, 1])
    only_prompt_left = (list(range(10, 18)), [0] * 6 + [1, 1])
    tokens, mask, stats, _ = pack_sft([long_ok, only_prompt_left], seq_len=3, pad_id=0,
                                      pack=False, formats=["alpaca", "sharegpt"])
    assert tokens.tolist() == [[10, 11, 12, 13]] and mask.tolist() == [[0, 1, 1]]
    assert stats == {"examples": 2, "truncated": 2, "dropped": 1,
                     "formats": {"alpaca": {"rows": 1, "truncated": 1, "dropped": 0},
                                 "sharegpt": {"rows": 1, "truncated": 1, "dropped": 1}}}


def test_pretrain_cache_split_and_key(tiny_tokenizer, tmp_path):
    src = tmp_path / "docs.jsonl"
    shutil.copy(BUNDLED_DATA / "pretrain.jsonl", src)
    cache = tmp_path / "cache"
    s = DataSettings(mode="pretrain", sources=(str(src),), seq_len=32, validation_split=0.1)
    first = prepare_data(s, tiny_tokenizer, cache)
    meta = first.meta
    assert meta["validation"]["documents"] == 160 and meta["train"]["documents"] == 1440
    assert len(first.train) == (meta["train"]["tokens"] - 1) // 32  # one epoch, tail dropped
    epoch = first.train.batch(np.arange(len(first.train)))  # the stream's first epoch
    assert epoch["loss_mask"].shape == (len(first.train), 32)
    assert int(epoch["loss_mask"].sum()) == len(first.train) * 32
    # the samples cut the training documents (seeded split) + EOS each, concatenated in
    # GPTDataset's document order, into blocks that overlap by one token (every token a label)
    tok = load_tokenizer(tiny_tokenizer)
    docs = [json.loads(x)["text"] for x in src.read_text().splitlines()]
    train_rows, _ = split_indices(len(docs), 0.1, s.seed)
    gpt = first.train.datasets[0].gpt
    assert sorted(np.asarray(gpt.document_index).tolist()) == train_rows.tolist()
    stream = [t for i in gpt.document_index for t in tok(docs[i])["input_ids"] +
              [tok.eos_token_id]]
    order = np.argsort(np.asarray(gpt.shuffle_index))  # sample j of the unshuffled blocks
    blocks = np.concatenate([epoch["tokens"].numpy(), epoch["labels"][:, -1:].numpy()], 1)[order]
    assert (blocks[:-1, -1] == blocks[1:, 0]).all()
    covered = np.concatenate([blocks[:, :-1].reshape(-1), blocks[-1, -1:]])
    assert covered.tolist() == stream[: len(covered)]
    assert len(stream) - len(covered) < 32  # only the tail shorter than a block is dropped

    tokenised = next((cache / "tokenized").glob("*/*.idx"))
    stamp = tokenised.stat().st_mtime_ns
    again = prepare_data(s, tiny_tokenizer, cache)  # cache hit: nothing rewritten
    assert again.key == first.key and tokenised.stat().st_mtime_ns == stamp
    assert np.array_equal(again.train.batch(np.arange(8))["tokens"], epoch["tokens"][:8])
    assert not list(cache.rglob(".*tmp*"))

    moved = tmp_path / "renamed.jsonl"
    shutil.copy(src, moved)  # same content elsewhere: same key
    assert cache_key(DataSettings(**{**s.__dict__, "sources": (str(moved),)}),
                     tiny_tokenizer) == first.key
    assert cache_key(DataSettings(**{**s.__dict__, "seq_len": 33}), tiny_tokenizer) != first.key
    with open(moved, "a") as f:
        f.write(json.dumps({"text": "One more document."}) + "\n")
    assert cache_key(DataSettings(**{**s.__dict__, "sources": (str(moved),)}),
                     tiny_tokenizer) != first.key


def test_split_indices_deterministic_disjoint():
    tr, va = split_indices(100, 0.1, seed=3)
    assert len(va) == 10 and len(tr) == 90
    assert sorted(np.concatenate([tr, va]).tolist()) == list(range(100))
    tr2, va2 = split_indices(100, 0.1, seed=3)
    assert np.array_equal(va, va2) and not np.array_equal(va, split_indices(100, 0.1, 4)[1])
    assert len(split_indices(5, 0.01, 0)[1]) == 1  # never an empty validation set
    assert len(split_indices(5, 0.0, 0)[1]) == 0


def test_sources_text_parquet_and_errors(tiny_tokenizer, tmp_path):
    import datasets

    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text("Two plus two is four.\nStill the same paragraph.\n\n"
                                  "The cat is small.\n")
    datasets.Dataset.from_dict({"text": ["The dog barks."] * 20}).to_parquet(folder / "b.parquet")
    srcs = resolve_sources([str(folder)])
    assert [(s.builder, len(s.files)) for s in srcs] == [("text", 1), ("parquet", 1)]
    data = prepare_data(DataSettings(mode="pretrain", sources=(str(folder),), seq_len=8),
                        tiny_tokenizer, tmp_path / "cache")
    assert data.meta["train"]["documents"] == 22  # 20 rows + 2 paragraphs
    assert resolve_sources([str(folder / "*.txt")])[0].files == (str(folder / "a.txt"),)
    with pytest.raises(DataError, match=r"missing\.jsonl.*no such file"):
        resolve_sources([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="matches no file"):
        resolve_sources([str(tmp_path / "*.json")])
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(DataError, match="unknown type '.csv'"):
        resolve_sources([str(tmp_path / "x.csv")])
    assert resolve_sources(["someone/dataset"])[0].builder == "hub"
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="data.prompt_field"):
        prepare_data(DataSettings(mode="sft", sources=(str(bad),), seq_len=8), tiny_tokenizer,
                     tmp_path / "cache")
    with pytest.raises(DataError, match="no 'text' column"):
        prepare_data(DataSettings(mode="pretrain", sources=(str(bad),), seq_len=8),
                     tiny_tokenizer, tmp_path / "cache")
    with pytest.raises(DataError, match="lower train.seq_len"):
        prepare_data(DataSettings(mode="pretrain", sources=(str(folder / "a.txt"),),
                                  seq_len=500), tiny_tokenizer, tmp_path / "cache")


def _union(n, g, mb, dp, step, seed=5):
    parts = [GlobalBatchSampler(n, g, mb, dp, r, seed).micro_batches(step) for r in range(dp)]
    assert all(len(p) == g // (mb * dp) and all(len(m) == mb for m in p) for p in parts)
    return np.concatenate([m for p in parts for m in p])


def test_sampler_global_batch_independent_of_dp():
    n, g = 50, 8
    ref = GlobalBatchSampler(n, g, 1, 1, 0, seed=5)
    for step in (0, 3, 6, 7, 40):  # 6 and 7 straddle the end of the first epoch
        want = ref.global_indices(step)
        for mb, dp in ((1, 1), (2, 2), (1, 4), (4, 2), (2, 4), (8, 1)):
            assert np.array_equal(_union(n, g, mb, dp, step), want)


def test_sampler_epochs_cover_each_sample_once():
    n, g = 48, 8
    s = GlobalBatchSampler(n, g, 2, 2, 0, seed=1)
    first = np.concatenate([s.global_indices(k) for k in range(6)])
    second = np.concatenate([s.global_indices(k) for k in range(6, 12)])
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert not np.array_equal(first, second)  # a new permutation each epoch
    odd = GlobalBatchSampler(50, 8, 1, 1, 0, seed=1)  # 50 = 6 batches + 2 into the next one
    stream = np.concatenate([odd.global_indices(k) for k in range(13)])
    assert sorted(stream[:50].tolist()) == list(range(50))
    assert sorted(stream[50:100].tolist()) == list(range(50))
    assert np.array_equal(GlobalBatchSampler(50, 8, 1, 1, 0, seed=2).global_indices(0),
                          GlobalBatchSampler(50, 8, 1, 1, 0, seed=2).global_indices(0))
    assert not np.array_equal(odd.global_indices(0),
                              GlobalBatchSampler(50, 8, 1, 1, 0, seed=2).global_indices(0))
    ordered = GlobalBatchSampler(10, 4, 2, 1, 0, seed=0, shuffle=False)
    assert ordered.global_indices(2).tolist() == [8, 9, 0, 1]
    assert odd.consumed_samples(3) == 24 and odd.epoch(25) == 4.0


def test_sampler_and_eval_errors():
    with pytest.raises(DataError, match="not divisible by micro_batch"):
        GlobalBatchSampler(10, 6, 2, 2, 0, seed=0)
    with pytest.raises(DataError, match="dp_rank=2"):
        GlobalBatchSampler(10, 4, 1, 2, 2, seed=0)
    got = [eval_micro_batches(11, 2, 2, r) for r in range(2)]
    # every sample once; the last round filled with filler rows (-1), the same count per rank
    assert [m.tolist() for m in got[0]] == [[0, 1], [4, 5], [8, 9]]
    assert [m.tolist() for m in got[1]] == [[2, 3], [6, 7], [10, -1]]
    assert len(eval_micro_batches(11, 2, 2, 0, max_batches=1)) == 1
    assert [m.tolist() for m in eval_micro_batches(3, 2, 2, 1)] == [[2, -1]]
    with pytest.raises(DataError, match="validation set is empty"):
        eval_micro_batches(0, 2, 2, 0)


def rank_prepare(settings: DataSettings, tokenizer: str, cache: str) -> dict:
    import torch.distributed as dist

    from toolkit.train.data import prepare_data_distributed

    try:
        data = prepare_data_distributed(settings, tokenizer, cache)
    except DataError as e:
        return {"error": str(e)}
    s = GlobalBatchSampler(len(data.train), 8, 2, dist.get_world_size(), dist.get_rank(), 1)
    mine = np.concatenate(s.micro_batches(0))
    return {"key": data.key, "tokens": int(np.asarray(data.train.tokens, np.int64).sum()),
            "mine": mine.tolist(), "step0": s.global_indices(0).tolist()}


def test_two_rank_prepare_and_shares(rank_pool_2, tiny_tokenizer, tmp_path):
    s = DataSettings(mode="sft", sources=(str(BUNDLED_DATA / "sft.jsonl"),), seq_len=48,
                     validation_split=0.1)
    out = rank_pool_2.run(rank_prepare, s, tiny_tokenizer, str(tmp_path / "cache"), timeout=120)
    assert out[0]["key"] == out[1]["key"] and out[0]["tokens"] == out[1]["tokens"]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one writer, one entry
    assert out[0]["mine"] + out[1]["mine"] == out[0]["step0"]  # the shares make the batch
    bad = DataSettings(mode="pretrain", sources=(str(BUNDLED_DATA / "sft.jsonl"),), seq_len=48)
    out = rank_pool_2.run(rank_prepare, bad, tiny_tokenizer, str(tmp_path / "cache"),
                          timeout=120)
    # the writer's DataError reaches every rank as it is (no rank left waiting; reported once)
    assert out[0]["error"] == out[1]["error"]
    assert "no 'text' column" in out[0]["error"] and "set data.text_field" in out[0]["error"]


def test_step_batches_and_settings_from_config():
    from toolkit.train.config import load_config
    from toolkit.train.data import TokenizedSplit

    cfg = load_config(bundled.SFT_EXAMPLE, ["train.seq_len=3", "train.seed=4"])
    s = DataSettings.from_config(cfg)
    assert (s.mode, s.seq_len, s.seed, s.validation_split) == ("sft", 3, 4, 0.1)
    assert s.sources == (str(BUNDLED_DATA / "sft.jsonl"),)  # bundled: resolved on load
    tokens = np.arange(40, dtype=np.int32).reshape(10, 4)  # sample i = 4i .. 4i+3
    split = TokenizedSplit(tokens, np.ones((10, 3), dtype=np.uint8))
    sampler = GlobalBatchSampler(10, 4, 1, 2, 1, seed=4)
    got = list(step_batches(split, sampler, 2))
    want = sampler.global_indices(2)[2:]  # rank 1 of dp=2: second half of the global batch
    assert len(got) == 2
    for b, i in zip(got, want, strict=True):
        assert b["tokens"].tolist() == [[4 * i, 4 * i + 1, 4 * i + 2]]
        assert b["labels"].tolist() == [[4 * i + 1, 4 * i + 2, 4 * i + 3]]
