"""Packed sequences keep examples apart through every layout; the token-weighted loss makes
packing invisible to the loss; ``mdtk data preview`` shows what the trainer trains on.

Units (no ranks): bin-packing, position ids, the per-example attention against a block mask in
float64 (forward and backward), the cache's packed rows against the unpacked ones, bad input.
Distributed (dist_checks/packing_checks.py, one rank_pool_2 job and one rank_pool_4 job): the
trainer's validation loss of the same rows packed and unpacked at dp2, tp2 + SP, pp2, pp2 x vpp2,
cp2 and pp4 (two middle stages); each packed example's logits against transformers' logits of
that example alone; the loss curve of a packed and an unpacked run whose global batches hold the
same examples; pretraining documents cut at EOS (``data.reset_at_eod``) at pp4 and dp4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dist_checks import packing_checks as pc
from dist_checks.packing_checks import Layout

from toolkit import bundled
from toolkit.train.data import DataError, DataSettings, encode_chat, prepare_data
from toolkit.train.data.segments import (
    eod_positions,
    first_fit_decreasing,
    layout,
    pack_summary,
    packed_positions,
)

BUNDLED_DATA = bundled.path(bundled.DATA)
REL = 1e-6  # pack vs unpack validation loss, fp32 (the bound)
LOGITS_REL = 1e-5  # packed example vs transformers on it alone, fp32
SEQ = 64


# -- bin-packing and position ids --------------------------------------------------------------

def test_first_fit_decreasing_fills_rows_deterministically():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(12), 0.8, 500).astype(int), 2, 65).tolist()
    bins = first_fit_decreasing(lengths, 65, seed=3)
    assert sorted(i for b in bins for i in b) == list(range(500))  # each item once
    assert all(sum(lengths[i] for i in b) <= 65 for b in bins)
    assert bins == first_fit_decreasing(lengths, 65, seed=3)  # a function of (lengths, seed)
    assert bins != first_fit_decreasing(lengths, 65, seed=4)  # ties ordered by the seed
    lower = -(-sum(lengths) // 65)
    assert len(bins) <= lower + 2, (len(bins), lower)  # FFD: within a row or two of optimal
    for b in bins:  # decreasing: each bin's items were placed longest first
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    with pytest.raises(ValueError, match="exceeds the capacity"):
        first_fit_decreasing([66], 65, seed=0)


def test_position_ids_restart_at_examples_padding_and_eod():
    where = layout([[3, 2], [4]])
    assert where["examples"].tolist() == [[0, 3], [3, 2], [0, 4]]
    pos = packed_positions(where["examples"], where["row_offsets"], np.array([0, 1, -1]), 6)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0],  # example, example, padding
                            [0, 1, 2, 3, 0, 1],  # example, padding
                            [0, 1, 2, 3, 4, 5]]  # a filler row: one segment
    tokens = np.array([[5, 0, 7, 8, 0, 0], [1, 2, 3, 4, 5, 6]])
    assert eod_positions(tokens, 0).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    summary = pack_summary(where["examples"], where["row_offsets"], 6)
    assert summary["examples_per_row"] == 1.5 and summary["tokens"] == 9
    assert summary["padding_fraction"] == pytest.approx(1 - 9 / 12)


def test_segments_from_position_ids_and_pieces():
    from toolkit.models.packed import segments_of

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert segments_of(torch.arange(8).repeat(2, 1)) is None  # unpacked: the old path
    seg = segments_of(pos)
    assert seg.starts == ((0, 3, 5), (0,)) and seg.seq_len == 8 and seg.qkv_format == "sbhd"
    assert seg.examples(0) == [(0, 3), (3, 5), (5, 8)]
    # a CP chunk [2, 6) of row 0: the tail of example 0, all of example 1, the head of example 2
    assert seg.pieces(0, 2, 6) == [(2, 3, 0), (3, 5, 3), (5, 6, 5)]
    cu, longest = seg.cu_seqlens(torch.device("cpu"))
    assert cu.tolist() == [0, 3, 5, 8, 16] and longest == 8
    with pytest.raises(ValueError, match="start every row at 0"):
        segments_of(torch.tensor([[1, 0, 1]]))


class _Attn(torch.nn.Module):
    """What ``packed.attend`` reads of a megatron-core core attention module."""

    def __init__(self, heads: int, d: int, window=None, layer: int = 1):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(window_size=window, window_attn_skip_freq=None,
                                      sequence_parallel=False)
        self.layer_number = layer
        self.softmax_scale = d ** -0.5
        self.attention_dropout = torch.nn.Dropout(0.0)
        self.hidden_size_per_partition = heads * d


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_per_example_attention_equals_a_block_mask_fwd_and_bwd(window):
    """float64, GQA 4/2: the kernel (one SDPA per example, no mask; a band per example for a
    sliding-window layer) against one SDPA call with the full block-diagonal causal mask."""
    from toolkit.models.packed import attend, kernel_name, segments_of

    torch.manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    s, b, h, g, d = 12, 2, 4, 2, 8
    q = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, g, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    seg = segments_of(pos)
    assert kernel_name(q.dtype, q.device) == "sdpa per example"
    out = attend(_Attn(h, d, window), q, k, v, seg)
    same = (torch.cumsum(pos == 0, 1)[:, :, None] == torch.cumsum(pos == 0, 1)[:, None, :])
    allowed = same & torch.ones(s, s, dtype=torch.bool).tril()
    if window:
        allowed &= torch.ones(s, s, dtype=torch.bool).triu(-window[0])
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
        attn_mask=allowed[:, None], scale=d ** -0.5).permute(2, 0, 1, 3).reshape(s, b, h * d)
    assert (out - ref).abs().max().item() < 1e-12
    grads = torch.autograd.grad((out * ref.detach()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref.detach()).sum(), (q, k, v))
    for a, r in zip(grads, ref_grads, strict=True):
        assert (a - r).abs().max().item() < 1e-12


# -- the data: packed rows hold the unpacked rows' examples ----------------------------------

@pytest.fixture(scope="module")
def assets(trainer_assets):
    out, root = trainer_assets
    rows = [json.loads(line) for line in (BUNDLED_DATA / "sft.jsonl").read_text().splitlines()]
    curve_src = root / "curve.jsonl"  # 40 rows: a global batch of the whole set
    curve_src.write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    out = {**out, "curve_src": str(curve_src), "work": str(root / "runs")}
    for pack, key in ((False, "rows"), (True, "packs")):
        s = DataSettings(mode="sft", sources=(str(curve_src),), seq_len=SEQ, seed=1234, pack=pack)
        out[key] = len(prepare_data(s, out["tokenizer"], out["cache"]).train)
    return out


def sft_settings(pack: bool) -> dict:
    return {"mode": "sft", "sources": (str(BUNDLED_DATA / "sft.jsonl"),), "seq_len": SEQ,
            "validation_split": 0.1, "seed": 1234, "pack": pack}


def _examples(split) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every example of a split as (its tokens, its mask over them after the first)."""
    ex, off = split.extra["examples"], split.extra["row_offsets"]
    out = []
    for r in range(len(split)):
        for a, n in ex[off[r]:off[r + 1]]:
            out.append((tuple(split.tokens[r, a:a + n].tolist()),
                        tuple(split.loss_mask[r, a:a + n - 1].tolist())))
    return sorted(out)


def test_packed_rows_hold_exactly_the_unpacked_examples(assets):
    tok, cache = assets["tokenizer"], assets["cache"]
    flat = prepare_data(DataSettings(**sft_settings(False)), tok, cache)
    packed = prepare_data(DataSettings(**sft_settings(True)), tok, cache)
    assert packed.key != flat.key
    for name in ("train", "validation"):
        a, b = getattr(flat, name), getattr(packed, name)
        assert _examples(a) == _examples(b)  # the same examples, tokens and masks
        assert int(a.loss_mask.sum()) == int(b.loss_mask.sum())
        assert len(b) < len(a) * 0.6  # short rows: two or more per pack
        pad_packed, pad_flat = (d.meta[name]["padding_fraction"] for d in (packed, flat))
        assert pad_packed < 0.15 < 0.5 < pad_flat
    many = np.flatnonzero(np.diff(packed.train.extra["row_offsets"]) >= 3)[:2]
    batch = packed.train.batch(many)
    assert (batch["position_ids"] == 0).sum() >= 6  # restarts inside the rows
    assert packed.meta["train"]["formats"]["messages"]["rows"] > 0


# -- mdtk data preview: what the trainer trains on -------------------------------------------

ALPACA = [{"instruction": "two plus three", "input": "", "output": "is five"},
          {"instruction": "sum", "input": "two plus three", "output": "is five"},
          {"instruction": "and one", "output": "is one"}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "two plus three"},
                               {"from": "gpt", "value": "is five"},
                               {"from": "human", "value": "and one"},
                               {"from": "gpt", "value": "is one"}]},
            {"conversations": [{"from": "user", "value": "sum"},
                               {"from": "assistant", "value": "five"}]}]


def _number(text: str, pattern: str) -> float:
    import re

    match = re.search(pattern, text)
    assert match, (pattern, text[-1500:])
    return float(match.group(1))


def test_data_preview_shows_masks_and_counts_what_the_trainer_reads(assets, tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli import app
    from toolkit.train.config import load_config
    from toolkit.train.data import prepare_data_distributed

    files = {}
    for name, rows in (("alpaca", ALPACA), ("sharegpt", SHAREGPT)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = f"[{BUNDLED_DATA / 'sft.jsonl'},{files['alpaca']},{files['sharegpt']}]"
    overrides = [f"model.path={assets['dense']}", f"model.tokenizer={assets['tokenizer']}",
                 f"output_dir={tmp_path / 'out'}", f"data.cache_dir={assets['cache']}",
                 f"data.sources={sources}", f"train.seq_len={SEQ}", "data.pack=true"]
    res = CliRunner().invoke(app, ["data", "preview", str(bundled.SFT_EXAMPLE), *overrides,
                                   "--rows", "4"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.count("--- sequence") == 4 and "[[" in out and "||" in out, out[:2000]
    assert "<|assistant|>\n[[" in out  # the answer carries loss, its header does not
    # the trainer's own dataset for the same config
    cfg = load_config(bundled.SFT_EXAMPLE, overrides)
    data = prepare_data_distributed(DataSettings.from_config(cfg), cfg.tokenizer_path,
                                    cfg.data_cache_dir, 1)
    split = data.train
    batch = split.batch(np.arange(len(split)))
    ex, off = split.extra["examples"], split.extra["row_offsets"]
    width = SEQ + 1
    assert _number(out, r"sequences (\d+) of") == len(split)
    assert _number(out, r"examples (\d+)") == len(ex)
    assert _number(out, r"loss tokens (\d+)") == int(batch["loss_mask"].sum())
    assert _number(out, r"tokens (\d+), loss") == int(ex[:, 1].sum())
    padding = 1 - ex[:, 1].sum() / (len(split) * width)
    assert _number(out, r"padding ([\d.]+)%") == pytest.approx(100 * padding, abs=0.051)
    assert _number(out, r"mean ([\d.]+), min") == pytest.approx(len(ex) / len(split), abs=0.006)
    assert _number(out, r"max (\d+)\n") == int(np.diff(off).max()) >= 2
    fmt = data.meta["train"]["formats"]
    read = sum(c["rows"] for c in fmt.values())
    assert _number(out, r"rows read (\d+)") == read
    assert _number(out, r"dropped (\d+) \(") + len(ex) == read
    for name in ("alpaca", "sharegpt", "prompt_response", "messages"):
        assert _number(out, rf"  {name}: read (\d+)") == fmt[name]["rows"] > 0
    # every example of the dataset starts a segment in the model's position ids
    pos = batch["position_ids"].numpy()
    starts = sum(int((pos[r, ex[off[r]:off[r + 1], 0]] == 0).sum()) for r in range(len(split)))
    assert starts == len(ex)


# -- bad input -----------------------------------------------------------------------------------

def test_template_without_generation_prompt_is_refused(tmp_path):
    from toolkit.train.data import load_tokenizer
    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    tok = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "tok")))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, mask = encode_chat(chat, tok)
    assert 0 < sum(mask) < len(mask)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                         "{% endfor %}")  # no generation prompt: headers would be trained
    with pytest.raises(DataError, match="no generation prompt.*data.template=plain"):
        encode_chat(chat, tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% else %}"
                         "{{ m['content'] }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")  # answers dropped
    with pytest.raises(DataError, match="renders assistant turn 1 as nothing"):
        encode_chat(chat, tok)


def test_reset_at_eod_without_eos_and_config_errors(assets, tmp_path):
    import dataclasses

    from toolkit.train.config import ConfigError, load_config
    from toolkit.train.data import with_reset_at_eod
    from toolkit.train.data.preprocess import TokenizeSpec, output_prefix, preprocess

    pre = str(BUNDLED_DATA / "pretrain.jsonl")
    s = DataSettings(mode="pretrain", sources=(pre,), seq_len=SEQ)
    data = prepare_data(s, assets["tokenizer"], assets["cache"])
    eos = data.meta["eos_id"]
    cut = with_reset_at_eod(data, True)
    assert cut.train.reset_eod == eos and data.train.reset_eod is None
    batch = cut.train.batch(np.arange(4))
    at = batch["tokens"] == eos  # Megatron-LM's rule: the token after an EOS is position 0
    assert at[:, :-1].any() and (batch["position_ids"][:, 1:][at[:, :-1]] == 0).all()
    assert bool((batch["position_ids"] == data.train.batch(np.arange(4))["position_ids"])
                .logical_not().any())
    # documents written without EOS (mdtk data preprocess without --append-eod): refused
    spec = TokenizeSpec(assets["tokenizer"], ("text",), append_eod=False)
    preprocess([pre], spec, str(tmp_path / "bare"), workers=0, progress=False)
    bare = prepare_data(dataclasses.replace(s, sources=(output_prefix(str(tmp_path / "bare"),
                                                                      "text"),)),
                        assets["tokenizer"], str(tmp_path / "cache"))
    with pytest.raises(DataError, match="hold no EOS token .* append EOS"):
        with_reset_at_eod(bare, True)
    with pytest.raises(DataError, match="needs an EOS token"):
        with_reset_at_eod(dataclasses.replace(data, meta={**data.meta, "eos_id": None}), True)
    with pytest.raises(ConfigError, match="reset_at_eod applies to pretraining"):
        load_config(bundled.SFT_EXAMPLE, ["data.reset_at_eod=true"])
    with pytest.raises(ConfigError, match="data.pack applies to sft only"):
        load_config(bundled.SFT_EXAMPLE, ["data.mode=pretrain", "data.pack=true"])


# -- distributed ---------------------------------------------------------------------------------

LAYOUTS_2 = [Layout("dp2"), Layout("tp2_sp", tp=2, sp=True), Layout("pp2", pp=2),
             Layout("pp2_vpp2", pp=2, vpp=2), Layout("cp2", cp=2)]
LOGIT_CASES = [("dense", Layout("tp2_sp", tp=2, sp=True)), ("dense", Layout("pp2", pp=2)),
               ("dense", Layout("cp2", cp=2)), ("dense:eod", Layout("cp2", cp=2)),
               ("phi3", Layout("tp2", tp=2)), ("gemma3", Layout("pp2", pp=2)),
               ("moe", Layout("dp2")), ("qwen3n", Layout("tp2_sp", tp=2, sp=True)),
               ("llama4", Layout("pp2", pp=2))]
LAYOUTS_4 = [Layout("pp4", pp=4), Layout("dp4")]


@pytest.fixture(scope="module")
def two(rank_pool_2, assets):
    data = {"flat": sft_settings(False), "packed": sft_settings(True)}
    models = {k: assets[k] for k in ("dense", "phi3", "gemma3", "moe", "qwen3n", "llama4")}
    for s in data.values():  # prepared here once: the ranks hit the cache
        prepare_data(DataSettings(**s), assets["tokenizer"], assets["cache"])
    first, second = rank_pool_2.run(pc.two_rank_job, LAYOUTS_2, LOGIT_CASES, models, data, assets,
                                    assets["work"], timeout=900)
    assert first["val"] == second["val"] and first["curves"] == second["curves"]
    return first


@pytest.fixture(scope="module")
def four(rank_pool_4, assets):
    pre = {"mode": "pretrain", "sources": (str(BUNDLED_DATA / "pretrain.jsonl"),),
           "seq_len": SEQ, "validation_split": 0.1, "seed": 1234}
    data = {"flat": sft_settings(False), "packed": sft_settings(True), "pre": pre,
            "pre_eod": pre}
    for s in data.values():
        prepare_data(DataSettings(**s), assets["tokenizer"], assets["cache"])
    out = rank_pool_4.run(pc.four_rank_job, LAYOUTS_4, assets["dense"], data, assets,
                          timeout=900)
    assert all(o == out[0] for o in out)
    return out[0]


@pytest.mark.parametrize("lay", [x.name for x in LAYOUTS_2])
def test_validation_loss_packed_equals_unpacked_2_ranks(two, lay):
    v = two["val"][lay]
    assert v["packed"] == pytest.approx(v["flat"], rel=REL, abs=0), v
    assert v["flat"] == pytest.approx(two["val"]["dp2"]["flat"], rel=1e-5)  # and across layouts


def test_qwen3_next_validation_loss_packed_equals_unpacked(two):
    """Qwen3-Next's gated DeltaNet restarts its convolution and state at every packed example
    (dp2): the validation loss equals the unpacked rows' within 1e-6."""
    v = two["val_qwen3n"]["dp2"]
    assert v["packed"] == pytest.approx(v["flat"], rel=REL, abs=0), v
    assert v["flat"] != pytest.approx(two["val"]["dp2"]["flat"], rel=1e-3)  # another model


def test_validation_loss_is_the_token_weighted_mean_over_the_set(two, assets):
    """The trainer's validation loss (dp2, 2 rows per micro-batch, last round filled) is the
    sum of transformers' token losses over the loss tokens of the whole validation set."""
    from transformers import AutoModelForCausalLM

    split = prepare_data(DataSettings(**sft_settings(False)), assets["tokenizer"],
                         assets["cache"]).validation
    batch = split.batch(np.arange(len(split)))
    hf = AutoModelForCausalLM.from_pretrained(assets["dense"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                                  reduction="none").double()
    mask = batch["loss_mask"].double()
    assert len(split) % 4 == 2  # dp2 x micro 2: the last round holds filler rows
    assert two["val"]["dp2"]["flat"] == pytest.approx(float((per_token * mask).sum()
                                                            / mask.sum()), rel=1e-5)


@pytest.mark.parametrize("lay", [x.name for x in LAYOUTS_4])
def test_validation_loss_packed_equals_unpacked_4_ranks(four, two, lay):
    v = four[lay]
    assert v["packed"] == pytest.approx(v["flat"], rel=REL, abs=0), v
    assert v["flat"] == pytest.approx(two["val"]["dp2"]["flat"], rel=1e-5)


def test_reset_at_eod_the_same_at_pp4_and_changes_the_loss(four):
    assert four["pp4"]["pre_eod"] == pytest.approx(four["dp4"]["pre_eod"], rel=1e-5)
    assert abs(four["dp4"]["pre_eod"] - four["dp4"]["pre"]) > 1e-3  # documents really cut


@pytest.mark.parametrize("case", [f"{m}@{lay.name}" for m, lay in LOGIT_CASES])
def test_packed_example_logits_equal_transformers_alone(two, case):
    assert two["logits"][case] < LOGITS_REL, two["logits"]


def test_packed_and_unpacked_runs_follow_one_loss_curve(two, assets):
    packed, flat = two["curves"]["curve_packed"], two["curves"]["curve_unpacked"]
    assert assets["packs"] <= assets["rows"] / 2 and len(flat) == 4
    assert flat[-1] < flat[0] - 0.3  # it trains
    assert packed == pytest.approx(flat, rel=2e-5, abs=0)


def test_packing_refused_where_examples_cannot_be_kept_apart(two):
    assert "multi-latent attention" in two["refuse_mla"]
    assert "data.pack=false" in two["refuse_mla"]
