"""LoRA / DoRA without process groups: the per-rank slices, target checks, PEFT's file format and
the merge (bit-exact against PEFT's ``merge_and_unload``), the memory model."""

from __future__ import annotations

import copy

import pytest

from toolkit.adapters.hfconfig import HFConfig
from toolkit.adapters.registry import family_of
from toolkit.lora import LoraError, LoraSpec
from toolkit.lora.plan import COLUMN, ROW, plan_adapters
from toolkit.lora.targets import (
    adapter_numel,
    model_projections,
    resolve_targets,
    valid_targets,
)
from toolkit.mapping import Coord

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
MIXTRAL = {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "num_local_experts": 4, "num_experts_per_tok": 2}


def _table(raw: dict, tp: int = 1):
    hf = HFConfig(raw)
    fam = family_of(hf)
    d = fam.dims(hf)
    return fam.table(hf, d, d.vocab)


def test_qkv_slices_cover_each_projection_once_at_tp2():
    """Column B rows of q/k/v at tp2 put every HF row exactly once, at the GQA-interleaved rows
    megatron-core's fused linear_qkv holds ([q of group; k; v] per group)."""
    table = _table(LLAMA)
    targets = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"})
    seen: dict[str, list[int]] = {}
    for rank in (0, 1):
        slices = plan_adapters(table, Coord(tp_rank=rank, tp=2), targets)
        layer0 = {s.target: s for s in slices if s.layer == 0}
        assert set(layer0) == targets
        q, k, v = layer0["q_proj"], layer0["k_proj"], layer0["v_proj"]
        assert q.kind == COLUMN and layer0["o_proj"].kind == ROW
        # one query group per rank: rows [q 32; k 16; v 16] of 64 local rows
        assert [r for r, _ in q.out_rows] == [(0, 32)]
        assert [r for r, _ in k.out_rows] == [(32, 48)] and [r for r, _ in v.out_rows] == [(48, 64)]
        assert q.a_cols == (0, 64)  # A whole in column-parallel layers
        assert layer0["o_proj"].a_cols == (rank * 32, rank * 32 + 32)  # A split in row-parallel
        assert layer0["o_proj"].b_rows == (((0, 64), (0, 64)),)
        gate = layer0["gate_proj"]
        assert gate.b_rows == (((rank * 48, rank * 48 + 48), (0, 48)),)
        assert [r for r, _ in gate.out_rows] == [(0, 48)]  # [gate shard; up shard] per rank
        for s in (q, k, v):
            rows = seen.setdefault(s.target, [])
            for (a, b), _ in s.b_rows:
                rows += range(a, b)
    assert sorted(seen["q_proj"]) == list(range(64))
    assert sorted(seen["k_proj"]) == list(range(32))


def test_targets_refused_with_the_valid_names():
    table = _table(LLAMA)
    assert resolve_targets(table, None, "llama") == frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    with pytest.raises(LoraError, match=r"no such projection.*Valid targets: down_proj, "
                                        r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        resolve_targets(table, ["q_proj", "qkv_proj"], "llama")
    with pytest.raises(LoraError, match="routed experts"):
        resolve_targets(_table(MIXTRAL), ["q_proj", "w1"], "mixtral")
    with pytest.raises(LoraError, match="empty"):
        resolve_targets(table, [], "llama")


@pytest.mark.parametrize("bad", [0, -4])
def test_rank_must_be_positive(bad):
    with pytest.raises(LoraError, match="positive"):
        LoraSpec(r=bad)


def test_adapter_count():
    spec, projs = model_projections(HFConfig(LLAMA), LoraSpec(r=4))
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + 2 * (64 + 96) + (96 + 64))
    assert adapter_numel(_table(LLAMA), spec) == 2 * per_layer
    assert len(projs) == 14 and {p.layer for p in projs} == {0, 1}
    dora = adapter_numel(_table(LLAMA), LoraSpec(r=4, method="dora", targets=spec.targets))
    assert dora - 2 * per_layer == 2 * (64 + 32 + 32 + 64 + 96 + 96 + 64)


def test_memory_model_counts_adapters_and_a_frozen_base():
    """Gradients, fp32 masters and Adam states for the adapters only; the base in bf16."""
    from toolkit.memory import TrainShape, estimate
    from toolkit.memory.model import model_shape_from_hf
    from toolkit.memory.states import ZeroOptions
    from toolkit.parallel import ParallelLayout

    full = model_shape_from_hf(LLAMA)
    lora = model_shape_from_hf(LLAMA, lora=LoraSpec(r=4))
    assert lora.trainable_params() == adapter_numel(_table(LLAMA), LoraSpec(
        r=4, targets=resolve_targets(_table(LLAMA), None, "llama")))
    assert lora.num_params() == full.num_params() + lora.trainable_params()
    train = TrainShape(seq_len=16, micro_batch=1, dtype="bf16")
    est = estimate(lora, train, ParallelLayout().resolve(2), ZeroOptions(stage=1))
    items = {i.what: i.bytes for i in est.items}
    assert items["frozen base parameters (bf16)"] == 2 * full.num_params()
    assert items["Adam m, v (fp32, 1/2 shard)"] == 8 * (-(-lora.trainable_params() // 2))
    assert items["gradients (bf16, 1/2 shard)"] == 2 * (-(-lora.trainable_params() // 2))


def test_plan_fits_llama_70b_lora_on_one_node_of_80gb():
    """`mdtk plan --model llama-3.1-70b --peft lora --lora-r 16 --nodes 1 --gpus-per-node 8`."""
    from toolkit.planner.report import PlanRequest, plan_layouts

    report = plan_layouts(PlanRequest("llama-3.1-70b", nodes=1, gpus_per_node=8, top=1,
                                      lora=LoraSpec(r=16)))
    best = report.to_dict()["plans"][0]
    assert best["mem_per_gpu_gib"] <= 80 and best["runnable_by_mdtk"], best
    assert report.setting.shape.trainable_params() < 0.005 * report.setting.shape.num_params()


def _config(model: str, **peft):
    from toolkit.train.config import config_from_dict

    return config_from_dict({
        "output_dir": "unused", "model": {"path": model},
        "data": {"sources": ["bundled:examples/data/sft.jsonl"]}, "train": {"steps": 1},
        "peft": {"method": "lora", **peft}})


def test_config_refusals_name_the_fix(trainer_models, tmp_path):
    from toolkit.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"peft.r=0 must be >= 1"):
        _config(trainer_models["dense"], r=0)
    with pytest.raises(ConfigError, match=r"no such projection. Valid targets: down_proj, "):
        _config(trainer_models["dense"], target_modules=["q_proj", "c_attn"])
    with pytest.raises(ConfigError, match="routed experts"):
        _config(trainer_models["moe"], target_modules=["w1"])
    assert _config(trainer_models["moe"]).peft.method == "lora"  # attention only: fine
    with pytest.raises(ConfigError, match="not an HF PEFT adapter folder"):
        _config(trainer_models["dense"], adapter=str(tmp_path))


def test_adapter_for_another_base_is_refused(trainer_models, tmp_path):
    """An adapter folder made by PEFT for a model of other sizes: one clear error each."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.adapters import adapter_for
    from toolkit.lora.peft_io import check_base, read_config
    from toolkit.lora.targets import check_adapter

    dense = adapter_for(trainer_models["dense"])  # hidden 64, 4 layers, vocab 512
    other = LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    base = tmp_path / "other"
    AutoModelForCausalLM.from_config(other).save_pretrained(base)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(tmp_path / "ad")
    spec, raw = read_config(tmp_path / "ad")
    with pytest.raises(LoraError, match=r"hidden_size 32 \(adapter's base\) vs 64.*"
                                        r"num_hidden_layers 6 .* vs 4.*vocab_size 500"):
        check_base({**raw, "base_model_name_or_path": str(base)}, dense.dims, "ad")
    tensors = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    from toolkit.lora.state import FullTensors

    extra = {n: t for n, t in tensors.items() if ".layers.5." in n}
    with pytest.raises(LoraError, match=r"layers.5.self_attn.q_proj.*does not have"):
        check_adapter(dense, spec, FullTensors(extra).shapes(), "ad")
    with pytest.raises(LoraError, match=r"lora_A has shape \(4, 32\), this model needs "
                                        r"\(4, 64\)"):
        check_adapter(dense, spec, FullTensors(tensors).shapes(), "ad")


def test_merge_equals_peft_merge_and_unload_bitwise(trainer_models, tmp_path):
    """LoRA and DoRA, random B (and magnitudes): the merged file == merge_and_unload()."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.lora.merge import merge_folder

    base = trainer_models["dense"]
    for dora in (False, True):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_dora=dora,
                                                target_modules=["q_proj", "k_proj", "o_proj",
                                                                "up_proj", "down_proj"]))
        torch.manual_seed(3)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name or "magnitude" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        folder = tmp_path / f"ad{dora}"
        peft.save_pretrained(folder)
        out = merge_folder(base, folder, tmp_path / f"merged{dora}")
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32), folder).merge_and_unload().state_dict()
        mine = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert ref.keys() == mine.keys()
        assert [k for k in ref if not torch.equal(ref[k], mine[k])] == []
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
        changed = [k for k in mine if not torch.equal(plain[k], mine[k])]
        assert len(changed) == 5 * 4  # every adapted projection of the 4 layers, nothing else


def test_family_without_adaptable_projections_is_refused():
    """A mapping with no linear projection (Llama's table cut to its embedding and norms, as a
    family without LoRA support would be): one clear error, whatever the targets."""
    table = {k: v for k, v in _table(LLAMA).items() if "embedding" in k or "norm" in k}
    assert table
    for wanted in (None, ["q_proj"]):
        with pytest.raises(LoraError, match="its mapping has no linear projection LoRA can adapt"):
            resolve_targets(table, wanted, "llama-cut")


def _peft_adapts(config, targets: list[str]) -> set[str]:
    """The modules PEFT puts adapters on for ``targets`` (its own matching and MoE rewrite)."""
    import peft
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    try:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    except ValueError:  # none of the names is a module PEFT can target
        return set()
    return {n.split(".lora_")[0] for n, _ in wrapped.named_parameters() if ".lora_" in n}


def test_names_peft_reads_as_routed_experts_are_declared_per_model_type():
    """PEFT itself decides: for every MoE family (and Kimi K2's model type), LoraConfig with the
    expert projection names either adapts the routed experts (then the family declares those
    names as PEFT's expert aliases, which mdtk's LoRA leaves alone) or the dense and shared MLPs
    mdtk adapts too (then it declares none)."""
    from dist_checks.adapter_checks import tiny_moe_configs, tiny_open_moe_configs

    configs = {**tiny_moe_configs(), **tiny_open_moe_configs()}
    aliased = set()
    for name, config in configs.items():
        family = family_of(config)
        # Kimi K2's config.json type; PEFT meets it as transformers' DeepSeek-V3 (hf_reference)
        declared = copy.copy(config)
        if name == "kimi_k2":
            declared.model_type = "kimi_k2"
        # the expert names that also name dense or shared-expert MLPs mdtk adapts
        names = sorted(set(family.moe.expert_names) & set(valid_targets(_table(
            config.to_dict()))))
        if not names:  # Mixtral's w1/w2/w3, GPT-OSS's: experts only, refused as such
            continue
        adapted = _peft_adapts(config, names)
        into_experts = any(".experts" in m for m in adapted)
        assert family.peft_expert_aliases(declared) == (set(names) if into_experts else set()), (
            name, sorted(adapted)[:4])
        if into_experts:
            aliased.add(name)
    assert aliased == {"qwen3_moe", "deepseek_v3", "qwen3_next", "glm4_moe", "kimi_k2"}
    table = _table(configs["glm4_moe"].to_dict())
    glm = family_of(configs["glm4_moe"]).peft_expert_aliases(configs["glm4_moe"])
    assert resolve_targets(table, None, "glm4_moe", glm) == frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj"})
    with pytest.raises(LoraError, match=r"\['gate_proj'\]: PEFT .* reads these names .* into "
                                        r"the experts.*Valid targets: k_proj, o_proj"):
        resolve_targets(table, ["q_proj", "gate_proj"], "glm4_moe", glm)
