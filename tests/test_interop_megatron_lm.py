"""Checkpoints written by Megatron-LM itself (``../shared/fixtures/megatron-lm-core_v0.16.1``).

Megatron-LM (core_v0.16.1) stores ``args.exit_signal`` as a ``signal.Signals`` member; the safe
loader rebuilds it by value and still refuses any pickle that would run code, in every format.
Both checkpoints (legacy tp2, torch_dist tp2) convert to the fixture's HF model bit for bit, with
``--hf-config`` and without it (the model derived from Megatron-LM's args), and through mdtk's
own Megatron formats at another layout and back.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.torchfree.safe_load import Opaque, load_torch
from toolkit.convert import convert
from toolkit.parallel.layout import ParallelLayout as L

FIXTURES = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures"
MLM = FIXTURES / "megatron-lm-core_v0.16.1"
CKPTS = {"legacy-tp2": "iter_0000001/mp_rank_00/model_optim_rng.pt",
         "torch_dist-tp2": "iter_0000007/common.pt"}

pytestmark = pytest.mark.skipif(not MLM.is_dir(), reason=f"fixtures not found at {MLM}")


@pytest.fixture(scope="module")
def mlm(tmp_path_factory) -> Path:
    """A copy of the fixture folder (the checkpoints' relative tokenizer path kept)."""
    root = tmp_path_factory.mktemp("mlm") / "megatron-lm"
    shutil.copytree(MLM, root)
    return root


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_identical(folder: Path, ref: dict[str, torch.Tensor]) -> None:
    got = _weights(folder)
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_signals_in_args_are_rebuilt_by_value(mlm):
    for ckpt, file in CKPTS.items():
        state = load_torch(mlm / ckpt / file)
        assert state["args"].exit_signal is signal.SIGTERM, ckpt


def _model_fields(config: dict) -> dict:
    """What a config.json defines, as the installed transformers reads it (a field a newer
    release adds appears at its default on both sides), without ``transformers_version``: the
    reference was written by whichever release made the fixture, the conversion by this one."""
    from transformers import AutoConfig

    fields = AutoConfig.for_model(**config).to_dict()
    assert fields.pop("transformers_version") and config["model_type"] == fields["model_type"]
    return fields


def test_megatron_lm_checkpoints_convert_bit_identically(mlm, tmp_path):
    ref = _weights(mlm / "hf-llama-tiny")
    ref_cfg = json.loads((mlm / "hf-llama-tiny" / "config.json").read_text())
    for ckpt in CKPTS:
        src = mlm / ckpt
        given = tmp_path / f"{ckpt}-given"
        convert(src, given, "hf", hf_config=mlm / "hf-llama-tiny", progress=False)
        _assert_identical(given, ref)
        derived = tmp_path / f"{ckpt}-derived"  # the model from Megatron-LM's args
        convert(src, derived, "hf", progress=False)
        _assert_identical(derived, ref)
        cfg = json.loads((derived / "config.json").read_text())
        if ckpt == "torch_dist-tp2":  # args + tokenizer_model (an HF folder) say everything
            assert _model_fields(cfg) == _model_fields(ref_cfg)
            assert (derived / "tokenizer.json").read_bytes() == (
                mlm / "hf-llama-tiny" / "tokenizer.json").read_bytes()
        else:  # Megatron-LM's tools/checkpoint saver leaves rotary_base/eps at its defaults
            assert {k: cfg[k] for k in ("architectures", "num_key_value_heads", "head_dim",
                                        "intermediate_size", "vocab_size",
                                        "tie_word_embeddings")} == {
                k: ref_cfg[k] for k in ("architectures", "num_key_value_heads", "head_dim",
                                        "intermediate_size", "vocab_size",
                                        "tie_word_embeddings")}
    # to mdtk's Megatron formats at another layout and back
    legacy_pp2 = tmp_path / "legacy-pp2"
    convert(mlm / "torch_dist-tp2", legacy_pp2, "megatron-legacy", L(tp=1, pp=2),
            progress=False)
    assert sorted(p.name for p in (legacy_pp2 / "iter_0000007").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001"]
    mcore_tp1 = tmp_path / "mcore-tp1"
    convert(mlm / "legacy-tp2", mcore_tp1, "mcore", L(tp=1), progress=False)
    for mid in (legacy_pp2, mcore_tp1):
        back = tmp_path / f"{mid.name}-hf"
        convert(mid, back, "hf", progress=False)
        _assert_identical(back, ref)


class _RunsCode:
    """A pickled object whose unpickling would call ``exec`` (refused before it can)."""

    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['MDTK_PWNED'], 'w').write('x')",))


class _FakeSignal:
    """``signal.Signals`` called with a non-member: rebuilding fails, nothing else runs."""

    def __reduce__(self):
        return (signal.Signals, ("SIGTERM; rm -rf /",))


def test_pickles_that_run_code_are_refused_in_every_format(mlm, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("MDTK_PWNED", str(marker))
    hf = tmp_path / "hf-bin"
    hf.mkdir()
    shutil.copy(mlm / "hf-llama-tiny" / "config.json", hf)
    weights = _weights(mlm / "hf-llama-tiny")
    for payload in (_RunsCode(), _FakeSignal()):
        torch.save({**weights, "evil": payload}, hf / "pytorch_model.bin")
        for ckpt, file in CKPTS.items():
            bad = tmp_path / f"bad-{ckpt}"
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(mlm / ckpt, bad)
            state = load_torch(bad / file, mmap=False)
            args = {k: v for k, v in vars(state["args"]).items() if not isinstance(v, Opaque)}
            state["args"] = argparse.Namespace(**{**args, "exit_signal": payload})
            torch.save(state, bad / file)
            for to in ("hf", "mcore"):
                dst = tmp_path / f"out-{ckpt}-{to}"
                with pytest.raises(CheckpointError) as err:
                    convert(bad, dst, to, hf_config=mlm / "hf-llama-tiny", progress=False)
                assert str(bad / file) in str(err.value) or "builtins" in str(err.value)
                assert not dst.exists() and not marker.exists()
        with pytest.raises((CheckpointError, pickle.UnpicklingError)):
            convert(hf, tmp_path / "out-bin", "hf", progress=False)
        assert not (tmp_path / "out-bin").exists() and not marker.exists()


#: Run settings of the fixture's own runs that are not facts of the model: taken from the
#: run whose value is Megatron-LM's converter default (legacy: ``tools/checkpoint``) instead.
_FROM_CONVERTER = ("seq_length", "encoder_seq_length", "vocab_size", "no_save_rng")
#: Megatron-LM's ``load_args_from_checkpoint`` / ``check_checkpoint_args`` / the issue's list.
_REQUIRED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings",
    "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear", "add_qkv_bias",
    "squared_relu", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
    "num_experts", "moe_layer_freq", "moe_router_topk", "moe_token_dispatcher_type",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "layernorm_epsilon", "qk_layernorm", "tokenizer_type",
    "tokenizer_model", "padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by",
    "ckpt_format", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size", "no_save_rng",
    "no_save_optim")


def test_mdtk_megatron_args_are_megatron_lms(mlm, tmp_path):
    """mdtk's torch_dist and legacy outputs of the fixture's HF model carry, for every args
    field they write, the value Megatron-LM wrote for the same model at tp=2."""
    own = {"legacy-tp2": load_torch(mlm / "legacy-tp2" / CKPTS["legacy-tp2"]),
           "torch_dist-tp2": load_torch(mlm / "torch_dist-tp2" / CKPTS["torch_dist-tp2"])}
    # rope base / eps / dropout as given to the torch_dist run; fields its training arguments
    # no longer write (apply_layernorm_1p) as tools/checkpoint's saver writes them
    model = {**vars(own["legacy-tp2"]["args"]), **vars(own["torch_dist-tp2"]["args"])}
    model.update({k: getattr(own["legacy-tp2"]["args"], k) for k in _FROM_CONVERTER})
    outs = {"mcore": ("torch_dist-tp2", "release/common.pt"),
            "megatron-legacy": ("legacy-tp2", "release/mp_rank_01/model_optim_rng.pt")}
    for to, (ref_name, file) in outs.items():
        dst = tmp_path / to
        convert(mlm / "hf-llama-tiny", dst, to, L(tp=2), progress=False)
        state = load_torch(dst / file)
        args = vars(state["args"])
        ref = {**model, **{k: getattr(own[ref_name]["args"], k)
                           for k in ("ckpt_format", "use_dist_ckpt")}}
        assert [k for k in _REQUIRED if k not in args] == [], to
        mdtk_only = {"hf_architecture", "iteration", "tokenizer_model"}
        wrong = {k: (v, ref.get(k, "<not written>")) for k, v in args.items()
                 if k not in mdtk_only and (k not in ref or ref[k] != v)}
        assert wrong == {}, f"{to}: args differing from Megatron-LM's (mdtk, Megatron-LM): {wrong}"
        tok = Path(args["tokenizer_model"])
        assert tok == dst / "hf_config" and (tok / "tokenizer.json").read_bytes() == (
            mlm / "hf-llama-tiny" / "tokenizer.json").read_bytes()
        for key in ("checkpoint_version", "num_floating_point_operations_so_far",
                    *(("content_metadata",) if to == "mcore" else ())):
            assert state[key] == own[ref_name][key], (to, key)
        if to == "megatron-legacy":  # the same padded shards as Megatron-LM's own legacy files
            emb = state["model"]["embedding.word_embeddings.weight"]
            theirs = own["legacy-tp2"]["model"]["embedding.word_embeddings.weight"]
            assert emb.shape == theirs.shape == (512, 64)
        assert args["padded_vocab_size"] == 1024 and args["make_vocab_size_divisible_by"] == 128
    # the padding is stripped again on the way back, and --vocab-multiple overrides it
    convert(tmp_path / "mcore", tmp_path / "back", "hf", progress=False)
    _assert_identical(tmp_path / "back", _weights(mlm / "hf-llama-tiny"))
    convert(mlm / "hf-llama-tiny", tmp_path / "least", "mcore", L(tp=2), vocab_multiple=1,
            progress=False)
    args = load_torch(tmp_path / "least" / "release" / "common.pt")["args"]
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (1002, 1)


# -- plain DeepSpeed checkpoints of HF models (the layout HF Trainer + DeepSpeed writes) ------

DSP = FIXTURES / "deepspeed-plain"


@pytest.mark.skipif(not DSP.is_dir(), reason=f"fixtures not found at {DSP}")
def test_plain_deepspeed_checkpoint_converts_as_zero_to_fp32(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = tmp_path / "dsp"
    shutil.copytree(DSP, root)
    ckpt, model = root / "zero2-hf-llama", root / "hf-llama-tiny-v512"
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError) as err:  # names every place it looked
        convert(ckpt, tmp_path / "none", "hf", progress=False)
    looked = f"config.json in {ckpt / 'hf_config'}, {ckpt}, {root}, and it"
    assert looked in str(err.value) and "--hf-config" in str(err.value)
    assert not (tmp_path / "none").exists()
    convert(ckpt, tmp_path / "given", "hf", hf_config=model, progress=False)
    _assert_identical(tmp_path / "given", theirs)
    shutil.copy(model / "config.json", ckpt)  # HF Trainer's checkpoint-N/ has it beside
    convert(ckpt / "global_step2", tmp_path / "beside", "hf", progress=False)
    _assert_identical(tmp_path / "beside", theirs)
    # the trained weights differ from the model DeepSpeed started from
    start = _weights(model)
    assert sum(not torch.equal(start[k], theirs[k]) for k in start) > len(start) // 2


def test_old_format_bin_is_read_through_the_safe_loader(mlm, tmp_path, monkeypatch):
    """A ``pytorch_model.bin`` in torch's old (non-zip) format converts; one that would run code
    is still refused, with nothing written."""
    hf = tmp_path / "old-bin"
    hf.mkdir()
    shutil.copy(mlm / "hf-llama-tiny" / "config.json", hf)
    ref = _weights(mlm / "hf-llama-tiny")
    torch.save(ref, hf / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    convert(hf, tmp_path / "out", "hf", progress=False)
    _assert_identical(tmp_path / "out", ref)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("MDTK_PWNED", str(marker))
    torch.save({**ref, "evil": _RunsCode()}, hf / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="not weights"):
        convert(hf, tmp_path / "out2", "hf", progress=False)
    assert not (tmp_path / "out2").exists() and not marker.exists()
