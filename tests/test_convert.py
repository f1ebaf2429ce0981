"""The offline checkpoint converter (``toolkit.convert``, ``mdtk convert`` / ``mdtk inspect``).

Conversion needs no ranks: everything runs in this process on real files (safetensors,
megatron-core torch_dist, legacy ``mp_rank_XX`` files). Per family, one chain visits every
format pair and re-shards between layouts; the HF folders at both ends must be bit-identical to
the original. Logits of converted Megatron checkpoints are checked against transformers in the
session's one-rank pool (megatron-core's CPU mode must not be switched on in the pytest process).
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from dist_checks import adapter_checks as ac
from dist_checks import convert_checks
from typer.testing import CliRunner

from toolkit.adapters.spec import EVENTS, read_events
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import HFReader
from toolkit.checkpoint.torchfree.safe_load import load_torch
from toolkit.convert import convert, inspect
from toolkit.parallel.layout import ParallelLayout as L

FAMILIES = list({**ac.tiny_configs(), **ac.tiny_moe_configs(), **ac.tiny_open_moe_configs()})
MOE = {*ac.tiny_moe_configs(), *ac.tiny_open_moe_configs()}
TOL = 1e-4


def _layouts(family: str) -> tuple[L, L, L]:
    """Three different legacy layouts: A (first write), B (re-shard of A), C (from mcore)."""
    if family == "gpt_oss":  # expert biases need etp=1, and the legacy format has etp == tp
        return L(pp=2, ep=2), L(pp=2, ep=4), L(ep=2)
    if family in MOE:
        return L(tp=2, pp=2, ep=2), L(pp=2, ep=4), L(tp=2, ep=2)
    return L(tp=2, pp=2, vpp=2), L(pp=4), L(tp=2)


def _chain(src: Path, out: Path, family: str) -> dict:
    """hf -> mcore(tp2) -> mcore(tp1) -> hf; hf -> legacy A -> legacy B -> mcore -> legacy C
    -> hf. Every format pair (and both same-format re-shards) appears once."""
    a, b, c = _layouts(family)
    kw = {"progress": False}
    convert(src, out / "m_tp2", "mcore", L(tp=2, etp=1 if family == "gpt_oss" else None), **kw)
    convert(out / "m_tp2", out / "m_tp1", "mcore", L(), vocab_multiple=1, **kw)  # least padding
    convert(out / "m_tp1", out / "hf_via_mcore", "hf", **kw)
    convert(src, out / "leg_a", "megatron-legacy", a, **kw)
    convert(out / "leg_a", out / "leg_b", "megatron-legacy", b, **kw)
    convert(out / "leg_b", out / "m_from_leg", "mcore", L(), **kw)
    convert(out / "m_from_leg", out / "leg_c", "megatron-legacy", c, **kw)
    convert(out / "leg_c", out / "hf_via_legacy", "hf", **kw)
    return {"via_mcore": ac.compare_tensors(src, out / "hf_via_mcore"),
            "via_legacy": ac.compare_tensors(src, out / "hf_via_legacy")}


@pytest.fixture(scope="module")
def chains(tiny_root):
    results = {}
    for family in FAMILIES:
        try:
            results[family] = _chain(tiny_root / family, tiny_root / "out" / family, family)
        except Exception:  # noqa: BLE001 - reported by the family's own test
            results[family] = {"error": traceback.format_exc()}
    return results


def _rank_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "release").iterdir() if p.name.startswith("mp_rank"))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_format_pair_round_trips_bit_exactly(chains, family):
    r = chains[family]
    assert "error" not in r, r.get("error")
    for route in ("via_mcore", "via_legacy"):
        cmp = r[route]
        assert cmp["n"] > 0
        assert cmp["only_a"] == [] and cmp["only_b"] == [], (route, cmp)
        assert cmp["unequal"] == [], (route, cmp["unequal"])


def test_megatron_files_have_the_layouts_asked_for(chains, tiny_root):
    """Legacy folders hold one file per rank of the asked layout, shards of the right shapes;
    torch_dist stores the vocab padded for the tp it was written for."""
    assert "error" not in chains["llama"], chains["llama"].get("error")
    out = tiny_root / "out" / "llama"
    assert _rank_dirs(out / "leg_a") == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                         "mp_rank_01_001"]
    assert _rank_dirs(out / "leg_b") == [f"mp_rank_00_{p:03d}" for p in range(4)]
    first = load_torch(out / "leg_a" / "release" / "mp_rank_01_000" / "model_optim_rng.pt")
    assert sorted(k for k in first if k.startswith("model")) == ["model0", "model1"]
    emb = first["model0"]["embedding.word_embeddings.weight"]
    assert tuple(emb.shape) == (512, 64)  # vocab 1001 padded to 1024 (128 x tp=2), half per rank
    qkv = first["model0"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert tuple(qkv.shape) == ((4 + 2 * 2) * 16 // 2, 64)  # (heads + 2 kv groups) * dim / tp
    assert first["args"].tensor_model_parallel_size == 2
    # pp rank 1 with vpp=2 holds global layers 1 and 3 as chunk-local layer 0
    assert "decoder.layers.1.self_attention.linear_qkv.weight" not in first["model0"]
    with HFReader(tiny_root / "llama") as ref:
        full = ref.read("model.embed_tokens.weight", ((0, 1001), (0, 64)))
    assert torch.equal(emb[:489], full[512:1001])
    assert torch.count_nonzero(emb[489:]) == 0  # the padding rows
    assert first["args"].make_vocab_size_divisible_by == 128  # as Megatron-LM stores it
    for name, rows in (("m_tp2", 1024), ("m_tp1", 1001)):
        info = inspect(out / name)
        assert info.format == "mcore" and info.problems == [], info
        assert info.layout["tp"] == (2 if name == "m_tp2" else 1)
        common = load_torch(out / name / "release" / "common.pt")
        assert common["args"].padded_vocab_size == rows
    moe = chains.get("mixtral", {})
    assert "error" not in moe, moe.get("error")
    assert _rank_dirs(tiny_root / "out" / "mixtral" / "leg_b") == [
        f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(4)]


def test_converted_checkpoints_give_the_hf_logits(chains, tiny_root, rank_pool_1):
    """`mdtk verify`'s runners, every family: the torch_dist checkpoint loaded by megatron-core's
    own dist_checkpointing.load, and a re-sharded legacy checkpoint; a tampered copy must fail."""
    ok = [f for f in FAMILIES if "error" not in chains[f]]
    assert ok == FAMILIES
    tampered = tiny_root / "out" / "llama" / "tampered"
    shutil.copytree(tiny_root / "out" / "llama" / "leg_b", tampered)
    file = tampered / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_torch(file, mmap=False)
    state["model"]["decoder.layers.0.mlp.linear_fc2.weight"][0, 0] += 0.5
    torch.save(state, file)
    pairs = []
    for f in FAMILIES:
        ref = str(tiny_root / f)
        pairs += [(ref, f"mcore:{tiny_root / 'out' / f / 'm_tp2'}"),
                  (ref, f"megatron-legacy:{tiny_root / 'out' / f / 'leg_b'}")]
    pairs.append((str(tiny_root / "llama"), f"megatron-legacy:{tampered}"))
    # DeepSeek-V3: moving one expert's score-correction bias (a buffer, not a parameter) must
    # change the routing and fail too, so the bias really travels and is compared.
    biased = tiny_root / "out" / "deepseek_v3" / "tampered"
    shutil.copytree(tiny_root / "out" / "deepseek_v3" / "leg_b", biased)
    key, hits = "decoder.layers.1.mlp.router.expert_bias", 0
    for file in sorted(biased.glob("release/mp_rank_00_000_*/model_optim_rng.pt")):  # pp 0
        state = load_torch(file, mmap=False)
        if key in state["model"]:
            state["model"][key][0] += 1.0
            torch.save(state, file)
            hits += 1
    assert hits == 4  # global layer 1, replicated in each expert rank's file of stage 0
    pairs.append((str(tiny_root / "deepseek_v3"), f"megatron-legacy:{biased}"))
    [rows] = rank_pool_1.run(convert_checks.verify_many, pairs, timeout=600)
    assert len(rows) == len(pairs)
    *good, bad, bad_bias = rows
    worst = {r["spec"]: r["max_abs"] for r in good if not r["max_abs"] <= TOL}
    assert not worst, f"logits differ from HF beyond {TOL}: {worst}"
    assert all(r["layers"] == 4 for r in good)
    assert bad["max_abs"] > 1e-2, bad  # the comparison can fail
    assert bad_bias["max_abs"] > 1e-2, bad_bias


def test_mdtk_verify_cli_after_conversion(chains, tiny_root, rank_pool_1):
    """`mdtk verify` (the typer app) in the one-rank pool's rank: HF against the converted
    torch_dist checkpoint."""
    assert "error" not in chains["qwen3"], chains["qwen3"].get("error")
    converted = tiny_root / "out" / "qwen3" / "m_tp1"
    [(code, output)] = rank_pool_1.run(convert_checks.run_cli, [
        "verify", f"hf:{tiny_root / 'qwen3'}", f"mcore:{converted}", "--tol", str(TOL)],
        timeout=600)
    assert code == 0, output[-3000:]
    assert "OK: logits match" in output


def test_dtype_cast_and_workers(tiny_root, tmp_path, monkeypatch):
    """--dtype bf16 gives exactly the bf16-rounded weights; 2 worker processes write the same
    tensors as one process; --verify reads the result back. One model description per
    command: a tp2 x pp2 conversion with workers and --verify reads config.json once and builds
    the mapping once in this process, and each worker builds the mapping once from the model it
    is sent, reading no config.json (every process counts: ``MDTK_MODEL_EVENTS``)."""
    src = tiny_root / "qwen2"
    report = convert(src, tmp_path / "m", "mcore", L(tp=2), dtype="bf16", progress=False,
                     verify=True)
    assert report.verified == report.tensors > 0
    convert(tmp_path / "m", tmp_path / "h", "hf", progress=False)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["dtype"] == "bfloat16"
    with HFReader(src) as a, HFReader(tmp_path / "h") as b:
        for name in a.names:
            full = tuple((0, n) for n in a.shape(name))
            x, y = a.read(name, full), b.read(name, full)
            assert y.dtype == torch.bfloat16 and torch.equal(x.to(torch.bfloat16), y), name
    one = convert(src, tmp_path / "w1", "megatron-legacy", L(tp=2, pp=2), progress=False)
    events = tmp_path / "model_events"
    monkeypatch.setenv(EVENTS, str(events))
    two = convert(src, tmp_path / "w2", "megatron-legacy", L(tp=2, pp=2), progress=False,
                  workers=2, verify=True)
    monkeypatch.delenv(EVENTS)
    per_process = read_events(events)
    assert per_process.pop(os.getpid()) == {"read": 1, "mapping": 1}
    assert 1 <= len(per_process) <= 2  # the workers (spawned: other processes)
    assert all(counts == {"mapping": 1} for counts in per_process.values()), per_process
    assert two.verified == two.tensors > 0
    assert one.files == two.files
    for f in one.files:
        if f.endswith(".pt"):
            sa, sb = load_torch(tmp_path / "w1" / f), load_torch(tmp_path / "w2" / f)
            assert sa["model"].keys() == sb["model"].keys()
            for k, v in sa["model"].items():
                assert (v is None and sb["model"][k] is None) or torch.equal(v, sb["model"][k])


def test_converter_reads_config_json_as_transformers_does(tiny_root):
    """The converter and ``inspect`` build adapters from config.json read as plain JSON (no
    transformers import): for every family the dims, the mapping tables, megatron-core's
    arguments and the Megatron-LM args stored in the checkpoint equal those built from
    transformers' own config class."""
    from toolkit.adapters import adapter_for, supported
    from toolkit.checkpoint.megatron_meta import megatron_args
    from toolkit.convert.sources import adapter_from_folder

    seen = set()
    for family in FAMILIES:
        plain, ref = adapter_from_folder(tiny_root / family), adapter_for(tiny_root / family)
        assert type(plain.hf_config).__name__ == "HFConfig", family
        assert plain.dims == ref.dims, family
        assert plain.params_dtype == ref.params_dtype, family
        for tp in (1, 2):
            assert plain.table(tp) == ref.table(tp), (family, tp)
        assert (plain.family.transformer_kwargs(plain.hf_config)
                == ref.family.transformer_kwargs(ref.hf_config)), family
        assert plain.family.model_kwargs(plain.hf_config) == ref.family.model_kwargs(
            ref.hf_config), family
        layout = L(tp=2, pp=2)
        args = [vars(megatron_args(a, layout, a.padded_vocab(2), 7, "torch_dist", torch.bfloat16))
                for a in (plain, ref)]
        assert args[0] == args[1], family
        seen.add(plain.architecture)
    assert seen == set(supported())


def test_torch_dist_key_renames_are_the_layer_specs(tiny_root):
    """torch_dist keys are named without building megatron-core's layer spec
    (``mcore_dist.KEYS_MAP``); the renames must be the spec's own for every registered family
    (megatron-core's dist_checkpointing.load reads the results above)."""
    from toolkit.adapters import adapter_for, supported
    from toolkit.checkpoint.mcore_dist import KEYS_MAP

    seen = set()
    for family in FAMILIES:
        adapter = adapter_for(tiny_root / family)
        spec = adapter.layer_spec()
        assert dict(spec.submodules.sharded_state_dict_keys_map) == KEYS_MAP, family
        seen.add(adapter.architecture)
    assert seen == set(supported())


# -- damaged inputs: a clear error naming the file, and no DST (nor temporary folder) ----------

def _no_output(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was left behind"
    left = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert left == [], f"temporary folders left: {left}"


def _fails(src: Path, dst: Path, to: str, names: str, layout: L | None = None) -> str:
    with pytest.raises(CheckpointError) as err:
        convert(src, dst, to, layout, progress=False)
    assert names in str(err.value), str(err.value)
    _no_output(dst)
    return str(err.value)


@pytest.fixture
def sharded(tiny_root, tmp_path):
    """The llama checkpoint re-written as 6 safetensors shards with an index."""
    convert(tiny_root / "llama", tmp_path / "sharded", "hf", progress=False,
            max_shard_bytes=100_000)
    return tmp_path / "sharded"


def test_truncated_safetensors(sharded, tmp_path):
    shard = sharded / "model-00003-of-00006.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    for to in ("hf", "mcore", "megatron-legacy"):
        _fails(sharded, tmp_path / f"out-{to}", to, str(shard))
    info = inspect(sharded)
    assert any(str(shard) in p for p in info.problems), info.problems


def test_missing_shard_in_index(sharded, tmp_path):
    shard = sharded / "model-00005-of-00006.safetensors"
    shard.unlink()
    msg = _fails(sharded, tmp_path / "out", "megatron-legacy", str(shard), L(tp=2))
    assert "missing" in msg


def test_mismatched_shapes(tiny_root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_root / "llama", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = _fails(bad, tmp_path / "out", "mcore", str(bad / "model.safetensors"))
    assert "gate_proj" in msg and "(96, 64)" in msg
    # a legacy rank file holding a tensor of the wrong shape
    convert(tiny_root / "llama", tmp_path / "leg", "megatron-legacy", L(tp=2), progress=False)
    file = tmp_path / "leg" / "release" / "mp_rank_01" / "model_optim_rng.pt"
    state = load_torch(file, mmap=False)
    key = "decoder.layers.2.mlp.linear_fc2.weight"
    state["model"][key] = state["model"][key][:, :40].clone()
    torch.save(state, file)
    msg = _fails(tmp_path / "leg", tmp_path / "out2", "hf", str(file))
    assert key in msg


def test_damaged_megatron_checkpoints(tiny_root, tmp_path):
    convert(tiny_root / "mixtral", tmp_path / "m", "mcore", progress=False)
    data = tmp_path / "m" / "release" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    _fails(tmp_path / "m", tmp_path / "out", "hf", str(data))
    convert(tiny_root / "mixtral", tmp_path / "leg", "megatron-legacy", L(pp=2, ep=2),
            progress=False)
    shutil.rmtree(tmp_path / "leg" / "release" / "mp_rank_00_001_001")
    msg = _fails(tmp_path / "leg", tmp_path / "out", "hf", "missing")
    assert "(0, 1, 1)" in msg and str(tmp_path / "leg" / "release") in msg
    rank = tmp_path / "leg" / "release" / "mp_rank_00_000_001" / "model_optim_rng.pt"
    with open(rank, "r+b") as f:
        f.truncate(1000)
    shutil.copytree(tmp_path / "leg" / "release" / "mp_rank_00_000_000",
                    tmp_path / "leg" / "release" / "mp_rank_00_001_001")
    _fails(tmp_path / "leg", tmp_path / "out", "mcore", str(rank))


def test_refuses_to_overwrite(tiny_root, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--overwrite"):
        convert(tiny_root / "gpt2", dst, "mcore", progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="inside the source"):
        convert(tiny_root / "gpt2", tiny_root / "gpt2" / "sub", "hf", progress=False)
    convert(tiny_root / "gpt2", dst, "mcore", progress=False, overwrite=True)
    assert not (dst / "keep.txt").exists() and (dst / "latest_checkpointed_iteration.txt").exists()
    mask = os.umask(0)
    os.umask(mask)
    assert dst.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]


# -- the command line --------------------------------------------------------------------------

def test_cli_convert_and_inspect(tiny_root, tmp_path):
    from toolkit.cli import app

    runner = CliRunner()
    help_text = runner.invoke(app, ["convert", "--help"], terminal_width=200).output
    for opt in ("--to", "--tp", "--pp", "--vpp", "--ep", "--etp", "--dtype", "--workers",
                "--verify", "--overwrite", "--hf-config"):
        assert opt in help_text, opt
    dst = tmp_path / "leg"
    res = runner.invoke(app, ["convert", str(tiny_root / "mistral"), str(dst), "--to",
                              "megatron-legacy", "--tp", "2", "--pp", "2", "--verify"])
    assert res.exit_code == 0, res.output
    assert "MB" in res.output or "kB" in res.output  # the progress bar's byte counts
    assert "verified: 39 tensors" in res.output
    res = runner.invoke(app, ["inspect", str(dst)])
    assert res.exit_code == 0, res.output
    for line in ("format:       megatron-legacy", "architecture: MistralForCausalLM",
                 "layout:       tp=2 pp=2", "problems:     none found"):
        assert line in res.output, res.output
    params = sum(t.numel() for t in
                 __import__("transformers").AutoModelForCausalLM.from_pretrained(
                     tiny_root / "mistral").state_dict().values())
    assert f"parameters:   {params:,}" in res.output
    res = runner.invoke(app, ["convert", str(tiny_root / "mistral"), str(dst), "--to", "hf"])
    assert res.exit_code == 2 and "--overwrite" in res.output
    res = runner.invoke(app, ["convert", str(tiny_root / "mistral"), str(tmp_path / "x"), "--to",
                              "mcore", "--tp", "3"])
    assert res.exit_code == 2 and "tp=3" in res.output
    _no_output(tmp_path / "x")
    assert os.listdir(tmp_path) == ["leg"]


# -- DeepSpeed checkpoints of real trainer runs -------------------------------------------------

DS_CASES = [  # (name, model, tp, pp, zero, ep, cp; dp on 2 ranks)
    ("tp2_zero3", "odd", 2, 1, 3, 1, 1),  # tied embeddings, vocab 507 padded to 508 at tp=2
    ("dp2_zero3", "dense", 1, 1, 3, 1, 1),
    ("dp2_zero2", "dense", 1, 1, 2, 1, 1),
    ("pp2_zero1", "odd", 1, 2, 1, 1, 1),  # the tied output layer is a copy on the last stage
    # Experts at ep=2 (edp=1): each rank's zero_pp_rank file is the only copy of its ep rank's
    # experts (mp_rank_00_model_states.pt holds ep rank 0's), global experts 2-3 are rank 1's.
    ("ep2_zero2", "moe", 1, 1, 2, 2, 1),  # Mixtral
    ("qwen2moe_ep2_zero1", "qwen2_moe", 1, 1, 1, 2, 1),  # + shared expert (a dense group)
    ("gemma3_tp2_zero1", "gemma3", 2, 1, 1, 1, 1),  # post-norms inside the linear modules
    # cp=2 (dp=1): DeepSpeed's dp group is dp x cp, so ZeRO partitions over the two CP ranks,
    # and with ep=2 the CP rank is the ep rank (cp folds into ep x edp).
    ("cp2_zero2", "dense", 1, 1, 2, 1, 2),
    ("cp2_ep2_zero1", "moe", 1, 1, 1, 2, 2),
    # DeepSeek-V3: MLA, sigmoid routing with the expert-score correction bias, a persistent
    # buffer (in the model-states file only, no ZeRO partition) that the trainer keeps fixed
    ("dsv3_ep2_zero1", "dsv3", 1, 1, 1, 2, 1),
]
#: Stored weights the trainer does not update (buffers): equal to the initial checkpoint's.
UNTRAINED = ("mlp.gate.e_score_correction_bias",)


@pytest.fixture(scope="module")
def ds_runs(rank_pool_2, trainer_assets):
    from dist_checks import convert_checks as cc
    from dist_checks import trainer_checks as tc

    assets, root = trainer_assets
    assets["qwen2_moe"] = cc.make_qwen2_moe(root)
    cases = [tc.Case(name, model=model, tp=tp, pp=pp, zero=zero, ep=ep, cp=cp, steps=2,
                     overrides=(f"export.hf_dir={root / 'runs' / name / 'export'}",
                                "checkpoint.interval=2"))
             for name, model, tp, pp, zero, ep, cp in DS_CASES]
    first, _ = rank_pool_2.run(cc.train_for_conversion, assets, str(root / "runs"), cases,
                               timeout=900)
    return {r["case"]: r for r in first}, assets, root


@pytest.mark.parametrize("case", [c[0] for c in DS_CASES])
def test_deepspeed_checkpoint_converts_to_the_trained_model(ds_runs, case):
    """The ZeRO partitions of every model-parallel rank, merged and re-assembled, are exactly the
    trained weights: bit-equal to the trainer's HF export of the live model, whose logits the
    trainer checked against the live model. The export differs from the initial weights."""
    runs, assets, root = ds_runs
    run = runs[case]
    assert run["export_max_abs_diff"] is not None and run["export_max_abs_diff"] <= TOL
    model = next(c[1] for c in DS_CASES if c[0] == case)
    out = root / "converted" / case
    info = inspect(run["checkpoints"])
    assert info.format == "deepspeed" and info.problems == [], info
    assert info.iteration == 2
    ep = next(c[5] for c in DS_CASES if c[0] == case)
    assert info.layout["ep"] == ep, info.layout
    cp = next(c[6] for c in DS_CASES if c[0] == case)
    tp, pp = (next(c[i] for c in DS_CASES if c[0] == case) for i in (2, 3))
    assert (info.layout["cp"], info.layout["dp"]) == (cp, 2 // (tp * pp * cp)), info.layout
    report = convert(run["checkpoints"], out, "hf", progress=False)
    assert report.source_format == "deepspeed"
    same = ac.compare_tensors(Path(run["export_dir"]), out)
    assert same["n"] > 0 and same["only_a"] == same["only_b"] == [] and same["unequal"] == [], same
    trained = ac.compare_tensors(Path(assets[model]), out)
    with HFReader(out) as r:
        fixed = {n: r.read(n, tuple((0, k) for k in r.shape(n)))
                 for n in r.names if n.endswith(UNTRAINED)}
    assert len(trained["unequal"]) == trained["n"] - len(fixed), "untrained weights"
    assert not fixed.keys() & set(trained["unequal"]), "a fixed buffer changed"
    assert bool(fixed) == (model == "dsv3"), fixed  # one per MoE layer, randomised: not zeros
    assert all(t.abs().min() > 0 for t in fixed.values()), fixed


def test_deepspeed_to_megatron_layouts_and_missing_partition(ds_runs, tmp_path):
    runs, _, _ = ds_runs
    src = Path(runs["tp2_zero3"]["checkpoints"])
    convert(src, tmp_path / "leg", "megatron-legacy", L(pp=2), progress=False)
    convert(tmp_path / "leg", tmp_path / "hf", "hf", progress=False)
    same = ac.compare_tensors(Path(runs["tp2_zero3"]["export_dir"]), tmp_path / "hf")
    assert same["unequal"] == [] and same["n"] > 0
    broken = tmp_path / "broken"
    shutil.copytree(Path(runs["dp2_zero2"]["checkpoints"]), broken)
    gone = broken / "step_0000002" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    msg = _fails(broken, tmp_path / "out", "mcore", str(gone))
    assert "missing" in msg
    assert any(str(gone) in p for p in inspect(broken).problems)


def test_deepspeed_moe_missing_expert_partition(ds_runs, tmp_path):
    """At ep=2 a dp rank's partition file is also the only copy of its ep rank's experts: without
    it the conversion stops, names the file and what it held, and leaves no output behind."""
    runs, _, _ = ds_runs
    broken = tmp_path / "broken"
    shutil.copytree(Path(runs["ep2_zero2"]["checkpoints"]), broken)
    gone = broken / "step_0000002" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    msg = _fails(broken, tmp_path / "out", "hf", str(gone))
    assert "missing" in msg and "experts of ep rank 1" in msg, msg
    assert any(str(gone) in p for p in inspect(broken).problems)


def test_safetensors_reader_and_streaming_writer(tmp_path, monkeypatch):
    """The positioned-read reader returns exactly what the safetensors library reads, for row,
    column and block-wise regions; the streaming writer's shards load with the library."""
    from safetensors.torch import load_file, save_file

    from toolkit.checkpoint.hf_writer import HFWriter
    from toolkit.checkpoint.safetensors_file import SafetensorsFile

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 19, generator=g).to(torch.bfloat16),
               "b": torch.randint(-5, 5, (4, 3, 5), generator=g, dtype=torch.int32),
               "c": torch.randn(7, generator=g), "d": torch.tensor(3.5, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    monkeypatch.setattr(SafetensorsFile, "block_bytes", 64)  # several blocks per region
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for region in (((0, 37), (0, 19)), ((5, 30), (0, 19)), ((3, 36), (7, 11)), ((0, 0), (0, 19))):
        assert torch.equal(f.read("a", region), tensors["a"][tuple(slice(*r) for r in region)])
    assert torch.equal(f.read("b", ((1, 3), (0, 3), (2, 4))), tensors["b"][1:3, :, 2:4])
    assert torch.equal(f.read("c"), tensors["c"]) and torch.equal(f.read("d"), tensors["d"])
    f.close()
    plan = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    w = HFWriter(tmp_path / "out", max_shard_bytes=200, plan=plan)
    for n, t in tensors.items():
        w.add(n, t)
    import transformers

    out = w.finish(transformers.LlamaConfig(vocab_size=11))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    back = {}
    for file in sorted(set(index["weight_map"].values())):
        back.update(load_file(str(out / file)))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in tensors.items())
    w2 = HFWriter(tmp_path / "out2", plan=plan)
    with pytest.raises(CheckpointError, match="expected a"):
        w2.add("b", tensors["b"])
    w2.abort()
    _no_output(tmp_path / "out2")


def test_deepspeed_tools_read_step_folders_without_a_tag(ds_runs, tmp_path):
    """Each step folder has DeepSpeed's own ``latest`` (the engine tag), so DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` works on it without a tag and gives the
    weights mdtk convert gives (megatron-core names: the legacy target at the run's layout)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    runs, _, _ = ds_runs
    for case in ("dp2_zero2", "dp2_zero3"):
        step = Path(runs[case]["checkpoints"]) / "step_0000002"
        assert (step / "latest").read_text() == "engine"
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(step))
        convert(step, tmp_path / case, "megatron-legacy", vocab_multiple=1, progress=False)
        ours = load_torch(tmp_path / case / "iter_0000002" / "mp_rank_00" /
                          "model_optim_rng.pt")["model"]
        ours = {k: v for k, v in ours.items() if isinstance(v, torch.Tensor)}
        assert sorted(ours) == sorted(theirs), case
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), case


def test_deepspeed_model_path_relative_to_the_run(ds_runs, tmp_path, monkeypatch):
    """trainer_state.json stores the model path absolute; a relative one (older runs, which had
    no ``hf_config/`` in the step folder either) is found against the run folder when
    converting from another directory."""
    runs, _, _ = ds_runs
    run = tmp_path / "run"
    shutil.copytree(Path(runs["dp2_zero2"]["checkpoints"]), run / "checkpoints")
    shutil.rmtree(run / "checkpoints" / "step_0000002" / "hf_config")
    state_file = run / "checkpoints" / "step_0000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert Path(state["config"]["model"]["path"]).is_absolute()
    shutil.copytree(state["config"]["model"]["path"], run / "model")
    state["config"]["model"]["path"] = "model"
    state_file.write_text(json.dumps(state))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    convert(run / "checkpoints", tmp_path / "hf", "hf", progress=False)
    same = ac.compare_tensors(Path(runs["dp2_zero2"]["export_dir"]), tmp_path / "hf")
    assert same["n"] > 0 and same["unequal"] == [] and same["only_a"] == same["only_b"] == []
