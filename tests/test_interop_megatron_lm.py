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
from toolkit.checkpoint.safe_load import Opaque, load_torch
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
            assert cfg == ref_cfg
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
