"""HF <-> megatron-core adapters on every dense family: logits, round trip, reads, at 5 layouts.

All families x layouts run inside rank-pool calls queued at once (2 ranks: tp=1, tp=2, pp=2,
pp=2 x vpp=2; 4 ranks: tp=2 x pp=2; the two pools at the same time); the tiny checkpoints are
built once per session.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from dist_checks import adapter_checks as ac

FAMILIES = list(ac.tiny_configs())
LAYOUTS_2 = [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}]
LAYOUTS_4 = [{"tp": 2, "pp": 2}]
MOE = list(ac.tiny_moe_configs())
# megatron-core's MoE layer needs sequence parallelism when tp > 1.
MOE_LAYOUTS_2 = [{}, {"ep": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2},
                 {"pp": 2, "vpp": 2}]
MOE_LAYOUTS_4 = [{"tp": 2, "pp": 2, "sequence_parallel": True},
                 {"ep": 2, "tp": 2, "sequence_parallel": True}]
# Today's open MoE families (issue 39): GPT-OSS, GLM-4.5, Kimi K2. GPT-OSS's experts have
# biases, which megatron-core supports only at etp=1 (its tp2 layout says so).
OPEN = list(ac.tiny_open_moe_configs())
OPEN_LAYOUTS_2 = [{}, {"ep": 2}, {"tp": 2, "etp": 1, "sequence_parallel": True}, {"pp": 2}]
OPEN_LAYOUTS_4 = [{"tp": 2, "pp": 2, "etp": 1, "sequence_parallel": True}]
OPEN_AT_4 = ["glm4_moe"]  # the MoE family at tp2 x pp2 (its logits and round trip)
MXFP4 = "gpt_oss_mxfp4"  # GPT-OSS with MXFP4 experts (ac.make_mxfp4)
MXFP4_TF = "gpt_oss_mxfp4_tf"  # transformers' own quantizer (ac.copy_transformers_mxfp4)
#: Issue 39's hybrid families (Qwen3-Next, Llama 4) skip ep2 x tp2, generic to the MoE layer.
SKIP_4 = tuple((f, MOE_LAYOUTS_4[1]) for f in ("qwen3_next", "llama4"))
TOL = 1e-4

# Stored HF tensors that megatron-core splits over tensor parallelism (independent of the rules).
_SPLIT = re.compile(
    r"(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|c_attn|c_fc)\.(weight|bias)$"
    r"|(o_proj|down_proj|c_proj)\.weight$|(embed_tokens|lm_head|wte)\.weight$"
)


def _rows(job) -> list[dict]:
    return [row for rows in job.result() for row in rows]


@pytest.fixture(scope="session")
def jobs(tiny_root, rank_pool_2, rank_pool_4) -> dict:
    """Every layout check of this file queued at once: the 2- and 4-rank pools work at the same
    time (one pool's ranks wait on each other: this 2-core machine is otherwise under half
    busy). Each pool runs its jobs in this order; each export folder is its own."""
    root = str(tiny_root)
    return {
        "2": rank_pool_2.submit(ac.check_layouts, root, FAMILIES, LAYOUTS_2, timeout=900),
        "4": rank_pool_4.submit(ac.check_layouts, root, FAMILIES, LAYOUTS_4, timeout=900),
        "moe_2": rank_pool_2.submit(ac.check_layouts, root, MOE, MOE_LAYOUTS_2, timeout=900),
        "moe_4": rank_pool_4.submit(ac.check_layouts, root, MOE, MOE_LAYOUTS_4, SKIP_4,
                                    timeout=900),
        "open": [rank_pool_2.submit(ac.check_layouts, root, OPEN, OPEN_LAYOUTS_2, timeout=900),
                 rank_pool_2.submit(ac.check_layouts, root, [MXFP4, MXFP4_TF], [{"ep": 2}],
                                    timeout=900),
                 rank_pool_4.submit(ac.check_layouts, root, OPEN_AT_4, OPEN_LAYOUTS_4,
                                    timeout=900)]}


@pytest.fixture(scope="session")
def results_2(jobs):
    return _rows(jobs["2"])


@pytest.fixture(scope="session")
def results_4(jobs):
    return _rows(jobs["4"])


@pytest.fixture(scope="session")
def results_moe_2(jobs):
    return _rows(jobs["moe_2"])


@pytest.fixture(scope="session")
def results_moe_4(jobs):
    return _rows(jobs["moe_4"])


@pytest.fixture(scope="session")
def results_open(jobs):
    return [row for job in jobs["open"] for row in _rows(job)]


def _check_logits(rows, families=FAMILIES):
    assert {r["family"] for r in rows} == set(families)
    worst = {}
    for r in rows:
        key = (r["family"], str(r["layout"]))
        worst[key] = max(worst.get(key, 0.0), r["max_abs"])
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"logits differ from HF beyond {TOL}: {bad}"
    return worst


def _check_roundtrip(rows):
    exported = [r for r in rows if r["rank"] == 0]
    assert len(exported) == len({(r["family"], str(r["layout"])) for r in rows})
    for r in exported:
        rt = r["roundtrip"]
        where = f"{r['family']} {r['layout']}"
        assert rt["n"] > 0
        assert rt["only_a"] == [] and rt["only_b"] == [], f"{where}: names differ {rt}"
        assert rt["unequal"] == [], f"{where}: tensors not bit-exact: {rt['unequal']}"
        assert r["config_equal"], f"{where}: config.json changed"
        assert r["files"] == ["config.json", "generation_config.json", "model.safetensors"]


def test_dense_logits_match_hf_on_2_ranks(results_2):
    worst = _check_logits(results_2)
    assert len(worst) == len(FAMILIES) * len(LAYOUTS_2)


def test_dense_roundtrip_bit_exact_on_2_ranks(results_2):
    _check_roundtrip(results_2)


def test_dense_logits_match_hf_tp2_pp2(results_4):
    worst = _check_logits(results_4)
    assert len(worst) == len(FAMILIES)


def test_dense_roundtrip_bit_exact_tp2_pp2(results_4):
    _check_roundtrip(results_4)


def _reads_by_rank(rows, layout):
    out = {}
    for r in rows:
        if r["layout"] == layout:
            out[(r["family"], r["rank"])] = r
    return out


def test_tp2_reads_only_local_slices(results_2):
    """At tp=2 no rank reads a whole TP-split tensor; the two ranks' reads tile it exactly."""
    rows = _reads_by_rank(results_2, {"tp": 2})
    for family in FAMILIES:
        per_rank = [rows[(family, rank)] for rank in (0, 1)]
        full = per_rank[0]["full_shapes"]
        totals = defaultdict(list)
        for r in per_rank:
            read_elems = defaultdict(int)
            for name, shape, nbytes in r["reads"]:
                numel = 1
                for n in shape:
                    numel *= n
                assert nbytes == numel * 4  # fp32 on disk
                if _SPLIT.search(name):
                    assert list(shape) != list(full[name]), f"{family}: read all of {name}"
                read_elems[name] += numel
            assert set(read_elems) == set(full), f"{family}: unread tensors"
            for name, n in read_elems.items():
                totals[name].append(n)
        for name, (n0, n1) in totals.items():
            numel = 1
            for n in full[name]:
                numel *= n
            if _SPLIT.search(name):
                assert n0 + n1 == numel, f"{family} {name}: ranks read {n0}+{n1} of {numel}"
                assert max(n0, n1) <= -(-numel // 2) + full[name][-1], (family, name, n0, n1)
            else:
                assert n0 == n1 == numel, f"{family} {name}: replicated tensor read {n0}, {n1}"


def test_pp2_reads_only_own_stage(results_2):
    """A pipeline stage reads only its own layers (and embedding/head where it holds them)."""
    rows = _reads_by_rank(results_2, {"pp": 2})
    for family in FAMILIES:
        for rank in (0, 1):
            names = {name for name, _, _ in rows[(family, rank)]["reads"]}
            layers = {int(m.group(1)) for n in names if (m := re.search(r"\.(\d+)\.", n))}
            assert layers == ({0, 1} if rank == 0 else {2, 3}), (family, rank, layers)


def test_moe_logits_and_roundtrip_on_2_ranks(results_moe_2):
    worst = _check_logits(results_moe_2, MOE)
    assert len(worst) == len(MOE) * len(MOE_LAYOUTS_2)
    _check_roundtrip(results_moe_2)


def test_moe_logits_and_roundtrip_on_4_ranks(results_moe_4):
    worst = _check_logits(results_moe_4, MOE)
    assert len(worst) == len(MOE) * len(MOE_LAYOUTS_4) - len(SKIP_4)
    _check_roundtrip(results_moe_4)


def test_ep2_reads_only_local_experts(results_moe_2):
    """With ep=2 each rank reads the experts it holds (0-1 or 2-3) and nothing of the others."""
    rows = _reads_by_rank(results_moe_2, {"ep": 2})
    for family in MOE:
        for rank in (0, 1):
            names = {name for name, _, _ in rows[(family, rank)]["reads"]}
            experts = {int(m.group(1)) for n in names if (m := re.search(r"experts\.(\d+)\.", n))}
            experts |= rows[(family, rank)]["stacked_experts"]  # Llama 4: slices of 3-D tensors
            assert experts == ({0, 1} if rank == 0 else {2, 3}), (family, rank, experts)


def test_wrong_mapping_is_detected(tiny_root, rank_pool_2):
    """Negative control: swapping gate and up (a plausible bug) moves the logits far."""
    diffs = rank_pool_2.run(ac.wrong_mapping_diff, str(tiny_root))
    assert min(diffs) > 1e-2, diffs


def test_wrong_routing_normalisation_is_detected(tiny_root, rank_pool_2):
    """Negative control: Qwen-MoE loaded with the other norm_topk_prob translation (softmax
    before vs after top-k) moves the logits far, so the routing settings are really checked."""
    families = ["qwen2_moe", "qwen3_moe"]
    for diffs in rank_pool_2.run(ac.wrong_routing_diff, str(tiny_root), families):
        assert set(diffs) == set(families)
        assert min(diffs.values()) > 1e-2, diffs


def test_verify_hf_against_megatron_core(tiny_root, rank_pool_2):
    """`mdtk verify`'s library path: HF model vs the same folder loaded into megatron-core."""
    from toolkit.convert.verify import run_hf

    # The HF reference runs here: transformers models loaded in a process after megatron-core's
    # CPU mode was enabled get garbage RoPE buffers (reported to the runtime owner).
    reference = run_hf(tiny_root / "qwen3", ac.reference_tokens())
    results = rank_pool_2.run(ac.verify_hf_mcore, str(tiny_root / "qwen3"), reference)
    for r in results:
        assert r["max_abs"] <= TOL and len(r["layers"]) == 4, r
        assert max(r["layers"]) <= TOL, r


def test_verify_command(tiny_root, tmp_path):
    """`mdtk verify` exits 0 for two equal checkpoints, 1 (printing per-layer diffs) when one
    weight of layer 2 is perturbed: layers 0-1 match, 2-3 differ."""
    import shutil

    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from toolkit.cli import app

    src = tiny_root / "qwen2"
    bad = tmp_path / "qwen2-bad"
    shutil.copytree(src, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"][0, 0] += 1.0
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})

    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(src), f"hf:{src}"])
    assert ok.exit_code == 0, ok.output
    assert "max abs diff 0.000e+00" in ok.output and "OK: logits match" in ok.output
    fail = runner.invoke(app, ["verify", str(src), str(bad)])
    assert fail.exit_code == 1, fail.output
    lines = [ln for ln in fail.output.splitlines() if ln.strip().startswith("layer")]
    per_layer = [float(ln.split(":")[1]) for ln in lines]
    assert len(per_layer) == 4
    assert per_layer[0] == 0.0 and per_layer[1] == 0.0 and per_layer[2] > 1e-3, per_layer
    missing = runner.invoke(app, ["verify", str(src), str(tmp_path)])
    assert missing.exit_code == 2 and "cannot tell its format" in missing.output


def test_dtype_on_load_and_export(tiny_root, rank_pool_2, tmp_path):
    r0, r1 = rank_pool_2.run(ac.check_dtypes, str(tiny_root), str(tmp_path))
    assert r0["param_dtypes"] == r1["param_dtypes"] == ["torch.bfloat16"]
    assert r0["n"] > 0 and r0["mismatched"] == []
    assert r0["config_dtypes"] == ["float32", "bfloat16"]
    for r in (r0, r1):
        assert r["exists_error"] and "exists" in r["exists_error"], r["exists_error"]


def test_open_moe_logits_and_roundtrip(results_open):
    """GPT-OSS (sinks, sliding window 5 < 12 tokens, YaRN, biased clamped experts stored fused),
    GLM-4.5 and Kimi K2 (config.json ``kimi_k2``, written back as read): logits within 1e-5 of
    transformers at 1 rank, ep2, tp2, pp2 (GLM-4.5 also tp2 x pp2) and HF -> megatron-core -> HF
    bit-exact at each; at ep2 each rank reads only its own experts' slices."""
    worst = _check_logits([r for r in results_open if r["family"] not in (MXFP4, MXFP4_TF)],
                          OPEN)
    assert len(worst) == len(OPEN) * len(OPEN_LAYOUTS_2) + len(OPEN_AT_4) * len(OPEN_LAYOUTS_4)
    assert max(worst.values()) <= 1e-5, worst  # the bound
    _check_roundtrip([r for r in results_open if r["family"] not in (MXFP4, MXFP4_TF)])
    rows = _reads_by_rank(results_open, {"ep": 2})
    for family in OPEN:
        per_rank = 4 if family == "kimi_k2" else 2  # 8 or 4 experts
        for rank in (0, 1):
            reads = rows[(family, rank)]["reads"]
            experts = {int(m.group(1)) for n, _, _ in reads
                       if (m := re.search(r"experts\.(\d+)\.", n))}
            if family == "gpt_oss":  # stored fused: one [1, ...] slab per expert held, per layer
                fused = [shape for n, shape, _ in reads if n.endswith("experts.gate_up_proj")]
                assert sorted(map(tuple, fused)) == [(1, 64, 128)] * 2 * 4, (rank, fused)
            else:
                assert experts == set(range(rank * per_rank, (rank + 1) * per_rank)), (
                    family, rank, experts)


def test_mxfp4_experts_dequantized_as_transformers(tiny_root, results_open, tmp_path):
    """A GPT-OSS folder with MXFP4 experts (blocks + scales, quant_method mxfp4) loads at ep2 with
    transformers' dequantized model's logits (within 1e-5); its export and `mdtk convert` (in the
    declared dtype by default: bf16 for the published GPT-OSS, fp32 here) write plain experts
    equal to transformers' dequantization, without the quantization_config."""
    import json

    from safetensors.torch import load_file

    from toolkit.convert import convert

    rows = [r for r in results_open if r["family"] == MXFP4]
    assert len(rows) == 2 and max(r["max_abs"] for r in rows) <= 1e-5, rows
    ref = torch.load(tiny_root / f"{MXFP4}.layer0.pt", weights_only=True)
    exported = tiny_root / "export" / f"{MXFP4}-ep2"
    converted = tmp_path / "plain"
    convert(tiny_root / MXFP4, converted, "hf", progress=False)
    for folder, dtype in ((exported, torch.float32), (converted, torch.float32)):
        weights = load_file(str(folder / "model.safetensors"))
        assert not any(n.endswith(("_blocks", "_scales")) for n in weights)
        for proj, want in ref.items():
            got = weights[f"model.layers.0.mlp.experts.{proj}"]
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), (folder, proj)
        assert "quantization_config" not in json.loads((folder / "config.json").read_text())


def test_transformers_save_of_a_dequantized_mxfp4_model_is_read(tiny_root, tmp_path):
    """The installed transformers saves a GPT-OSS loaded with ``Mxfp4Config(dequantize=True)``
    (the usual bf16 fine-tuning start): `mdtk convert` of that folder writes the experts under
    their names, equal to transformers' dequantization. transformers 5.23 (the lock's) stores
    them under the ``*_blocks`` names (no scales, no quantization_config), which `mdtk inspect`
    names; 5.24 under their own (the recorded 5.23 folder keeps that case tested: below)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from toolkit.convert import convert
    from toolkit.convert.inspection import inspect

    saved, plain = tmp_path / "saved", tmp_path / "plain"
    AutoModelForCausalLM.from_pretrained(tiny_root / MXFP4, dtype=torch.float32,
                                         quantization_config=Mxfp4Config(dequantize=True)
                                         ).save_pretrained(saved)
    stored = load_file(str(saved / "model.safetensors"))
    info = inspect(saved)
    assert info.problems == []
    if "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored:  # transformers <= 5.23
        assert "stored under *_blocks names" in info.quantization
    convert(saved, plain, "hf", progress=False)
    weights = load_file(str(plain / "model.safetensors"))
    assert not any(n.endswith("_blocks") for n in weights)
    for proj, want in torch.load(tiny_root / f"{MXFP4}.layer0.pt", weights_only=True).items():
        assert torch.equal(weights[f"model.layers.0.mlp.experts.{proj}"], want), proj


def test_transformers_5_23_dequantized_save_is_read_as_the_saved_model(tmp_path):
    """A folder transformers 5.23 wrote that way (tests/data/gpt_oss_dequantized_save, recorded:
    bf16 experts under ``*_blocks`` names): `mdtk inspect` names it, and transformers loading
    what `mdtk convert` makes of it gives the logits of the model 5.23 saved, exactly (bf16
    weights, fp32 logits); the experts are the stored tensors, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.convert import convert
    from toolkit.convert.inspection import inspect

    fixture = ac.TRANSFORMERS_DEQUANTIZED_SAVE
    stored = load_file(str(fixture / "saved" / "model.safetensors"))
    blocks = [n for n in stored if n.endswith("_blocks")]
    assert len(blocks) == 4 and all(stored[n].dtype == torch.bfloat16 for n in blocks)
    info = inspect(fixture / "saved")
    assert info.problems == [] and "stored under *_blocks names" in info.quantization
    plain = tmp_path / "plain"
    convert(fixture / "saved", plain, "hf", progress=False)
    weights = load_file(str(plain / "model.safetensors"))
    for name in blocks:
        assert torch.equal(weights[name.removesuffix("_blocks")], stored[name]), name
    assert sorted(weights) == sorted(n.removesuffix("_blocks") for n in stored)
    ref = load_file(str(fixture / "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert torch.equal(logits, ref["logits"]), (logits - ref["logits"]).abs().max()


def test_mxfp4_from_transformers_quantizer(tiny_root, results_open, tmp_path):
    """A GPT-OSS quantized and saved by transformers' own MXFP4 quantizer (tests/data; blocks
    along the output dimension, a file transformers itself cannot load back) loads at ep2 with
    the logits of the model that quantizer made (within 1e-5, fp32), its square down_proj in the
    orientation gate_up_proj's shape shows; its export and `mdtk convert` (bf16, as declared)
    write the experts bit for bit as OpenAI's dequantizer unpacks them from the quantized model;
    `mdtk inspect` names the layout."""
    from safetensors.torch import load_file

    from toolkit.convert import convert
    from toolkit.convert.inspection import inspect

    rows = [r for r in results_open if r["family"] == MXFP4_TF]
    assert len(rows) == 2 and max(r["max_abs"] for r in rows) <= 1e-5, rows
    ref = torch.load(tiny_root / f"{MXFP4_TF}.layer0.pt", weights_only=True)
    assert ref["gate_up_proj"].shape[-2] == ref["down_proj"].shape[-1] == ref["down_proj"].shape[-2]
    converted = tmp_path / "plain"
    convert(ac.TRANSFORMERS_MXFP4 / "quantized", converted, "hf", progress=False)
    for folder, dtype in ((tiny_root / "export" / f"{MXFP4_TF}-ep2", torch.float32),
                          (converted, torch.bfloat16)):
        weights = load_file(str(folder / "model.safetensors"))
        for proj, want in ref.items():
            got = weights[f"model.layers.0.mlp.experts.{proj}"]
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), (folder, proj)
    info = inspect(tiny_root / MXFP4_TF)
    assert info.problems == [] and "along the output dimension" in info.quantization


# -- the weight stream (issue 38): buckets of HF-named tensors out of the live model ------------

STREAM_BUCKET = 2**16  # 64 KiB: a dozen or more buckets of the tiny models; the embedding alone
STREAM_CASES = (("llama", {"tp": 2, "pp": 2}, 4), ("mixtral", {"ep": 2}, 2),
                ("gpt_oss", {"ep": 2}, 2), ("deepseek_v3", {"ep": 2}, 2))
#: DeepSeek-V3's multi-token-prediction layer (``ac.add_mtp_layer``): no model holds it, the
#: stream ends with it, read from the source folder as the export copies it.
MTP = "model.layers.4."
#: transformers 5 holds Mixtral's experts fused in its modules (the per-expert checkpoint
#: names are converted by from_pretrained): load_state_dict takes the other two as streamed.
STREAM_LOADABLE = ("llama", "gpt_oss")


@pytest.fixture(scope="session")
def stream_rows(tiny_root, rank_pool_2, rank_pool_4, tmp_path_factory):
    from dist_checks import stream_checks

    out = tmp_path_factory.mktemp("stream")
    pools = {2: rank_pool_2, 4: rank_pool_4}
    by_layout: dict = defaultdict(list)
    for family, layout, world in STREAM_CASES:
        by_layout[(world, tuple(layout.items()))].append(family)
    rows = {}
    for (world, layout), families in by_layout.items():
        per_rank = pools[world].run(stream_checks.stream_cases, str(tiny_root), families,
                                    dict(layout), STREAM_BUCKET, str(out / str(world)))
        for family in families:
            rows[family] = [r[family] for r in per_rank]
    return rows


def _check_buckets(s: dict, family: str, where: str) -> None:
    assert s["count"] >= 4, f"{family} {where}: {s['count']} buckets"
    assert s["export_names"] == s["source_names"], family  # export_hf's folder = the source's
    assert sorted(s["names"]) == s["export_names"], f"{family} {where}: names differ"
    assert s["export_unequal"] == [] and s["source_unequal"] == [], (family, where, s)
    for total, largest in zip(s["bytes"], s["largest"], strict=True):
        assert total <= STREAM_BUCKET or total == largest, (family, where, total, largest)


@pytest.mark.parametrize("family", [c[0] for c in STREAM_CASES])
def test_weight_stream_equals_the_export_bit_for_bit(stream_rows, family):
    """Llama (tied, vocab padded) at tp2 x pp2, Mixtral, GPT-OSS (fused stacked experts) and
    DeepSeek-V3 (its MTP layer kept from the source, last) at ep2: buckets of at most 64 KiB
    (a larger tensor alone) to rank 0 and to every rank, each tensor bit-equal (name, dtype,
    values) to export_hf's folder and to the source checkpoint, every name once; the other
    ranks get as many empty buckets; a rank outside the world as ``dst`` is refused, naming
    the fix."""
    rows = stream_rows[family]
    r0 = rows[0]
    _check_buckets(r0["to_rank0"], family, "dst=0")
    for rank, r in enumerate(rows):
        assert r["to_rank0"]["count"] == r0["to_rank0"]["count"], (family, rank)
        if rank:
            assert r["to_rank0"]["names"] == [], (family, rank)  # empty lists, in step
        _check_buckets(r["everywhere"], family, f"dst=None rank {rank}")
        assert r["everywhere"]["names"] == r0["to_rank0"]["names"], (family, rank)  # one order
        assert r["refused"] and "not a rank of this world" in r["refused"], r["refused"]
    if family == "gpt_oss":  # its experts stream as the folder stores them: stacked
        assert "model.layers.0.mlp.experts.gate_up_proj" in r0["to_rank0"]["names"]
    if family == "deepseek_v3":
        names = r0["to_rank0"]["names"]
        kept = [i for i, n in enumerate(names) if n.startswith(MTP)]
        assert len(kept) > 10 and kept == list(range(len(names) - len(kept), len(names))), kept


def test_weight_stream_refuses_a_bad_bucket_size():
    """Checked at the call, before any communication: the error names the setting and a fix."""
    from toolkit.adapters.stream import StreamError, hf_buckets

    for bad in (0, -1, 1.5, True):
        with pytest.raises(StreamError, match="bucket_bytes=.*positive number of bytes"):
            hf_buckets([], None, bucket_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", STREAM_LOADABLE)
def test_weight_stream_loads_into_transformers(stream_rows, tiny_root, family):
    """The buckets streamed to rank 0, loaded one by one into a fresh transformers model
    (``load_state_dict(bucket, strict=False)``: no unexpected key; every key loaded once, the
    tied LM head through its embedding), give the live model's logits within 1e-5 (fp32)."""
    from collections import Counter

    from transformers import AutoConfig, AutoModelForCausalLM

    r0 = stream_rows[family][0]
    config = AutoConfig.from_pretrained(tiny_root / family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    loaded: Counter = Counter()
    for bucket in r0["buckets"]:
        result = model.load_state_dict(dict(bucket), strict=False)
        assert result.unexpected_keys == [], result.unexpected_keys
        loaded.update(name for name, _ in bucket)
    assert set(loaded.values()) == {1}
    missing = set(model.state_dict()) - set(loaded)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert missing == tied, missing
    with torch.no_grad():
        logits = model(ac.tokens()).logits
    diff = (logits - r0["logits"]).abs().max().item()
    assert diff <= 1e-5, diff
