"""Single-process checks of the mapping rules, plans, checkpoint reader/writer and early errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dist_checks import adapter_checks as ac
from safetensors.torch import load_file, save_file

from toolkit.adapters import CheckpointMismatch, UnsupportedModel, adapter_for
from toolkit.adapters.live import load_hf
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import HFReader
from toolkit.checkpoint.hf_writer import HFWriter
from toolkit.mapping import QKV, Coord, GateUp, MappingError, Part, coalesce, plan_rank
from toolkit.parallel import LayoutError, ParallelLayout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-units")
    return ac.build_checkpoints(root, ["llama", "qwen3", "gpt2"])


def _copy(src, dst, *, drop=(), add=None, config=None):
    shutil.copytree(src, dst)
    if drop or add:
        weights = load_file(str(dst / "model.safetensors"))
        for name in drop:
            del weights[name]
        weights.update(add or {})
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


# -- split rules ------------------------------------------------------------------------------

def _assemble(rule, hf: dict[str, torch.Tensor], rank: int, size: int) -> torch.Tensor:
    out = torch.zeros(rule.local_shape(size))
    for p in rule.pieces(rank, size):
        part = hf[p.source][tuple(slice(a, b) for a, b in p.src)]
        out[tuple(slice(a, b) for a, b in p.dst)] = part.t() if p.transpose else part
    return out


def test_qkv_matches_megatron_group_layout():
    """Shard r of the fused QKV = [q heads of group g; k_g; v_g] for the groups of rank r."""
    heads, groups, d, h = 8, 2, 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    rule = QKV(Part("q"), Part("k"), Part("v"), heads, groups, d, inn=h)
    per = heads // groups
    expected = torch.cat([torch.cat([q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d],
                                     v[g * d:(g + 1) * d]]) for g in range(groups)])
    full = _assemble(rule, {"q": q, "k": k, "v": v}, 0, 1)
    assert torch.equal(full, expected)
    shards = [_assemble(rule, {"q": q, "k": k, "v": v}, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(shards), expected)  # TP shards whole groups, in order
    with pytest.raises(MappingError, match="query groups"):
        rule.local_shape(4)


def test_qkv_transposed_single_source_equals_separate():
    """GPT-2's Conv1D c_attn ([in, 3*out], q|k|v side by side) gives the same fused tensor."""
    heads, d, h = 4, 2, 8
    q, k, v = (torch.randn(heads * d, h) for _ in range(3))
    c_attn = torch.cat([q, k, v]).t().contiguous()
    sep = QKV(Part("q"), Part("k"), Part("v"), heads, heads, d, inn=h)
    one = QKV(Part("c", 0), Part("c", heads * d), Part("c", 2 * heads * d), heads, heads, d,
              inn=h, transpose=True)
    assert one.hf_shapes() == {"c": (h, 3 * heads * d)}
    for r in range(2):
        assert torch.equal(_assemble(sep, {"q": q, "k": k, "v": v}, r, 2),
                           _assemble(one, {"c": c_attn}, r, 2))


def test_gate_up_shards_are_gate_then_up():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    rule = GateUp(Part("g"), Part("u"), 8, inn=3)
    for r in range(2):
        shard = _assemble(rule, {"g": gate, "u": up}, r, 2)
        assert torch.equal(shard, torch.cat([gate[r * 4:(r + 1) * 4], up[r * 4:(r + 1) * 4]]))


def test_coalesce_merges_only_adjacent_regions():
    regions = [((4, 8), (0, 3)), ((0, 4), (0, 3)), ((12, 16), (0, 3))]
    groups = coalesce(regions)
    assert groups == [(((0, 8), (0, 3)), [1, 0]), (((12, 16), (0, 3)), [2])]


@pytest.mark.parametrize("layout", [
    dict(tp=1), dict(tp=2), dict(pp=2), dict(pp=2, vpp=2), dict(tp=2, pp=2), dict(tp=2, pp=4),
])
@pytest.mark.parametrize("family", [*ac.tiny_configs(), *ac.tiny_moe_configs(),
                                    *ac.tiny_open_moe_configs()])
def test_plans_tile_every_hf_tensor_exactly_once(family, layout):
    """Over all ranks of a layout, the pieces of distinct shards cover each HF element once."""
    config = {**ac.tiny_configs(), **ac.tiny_moe_configs(), **ac.tiny_open_moe_configs()}[family]
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")
                            .replace("GPT2ForCausalLM", "GPT2LMHeadModel")
                            .replace("Gemma3Text", "Gemma3").replace("Llama4Text", "Llama4")]
    adapter = adapter_for(config)
    tp, pp, vpp = layout.get("tp", 1), layout.get("pp", 1), layout.get("vpp", 1)
    shapes = adapter.expected_tensors()
    count = {n: torch.zeros(s, dtype=torch.int32) for n, s in shapes.items()}
    seen = set()
    tied = adapter.dims.tied
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for t in plan_rank(adapter.table(tp), Coord(tp_rank=tp_rank, tp=tp, pp_rank=pp_rank,
                                                        pp=pp, vpp=vpp)):
                if (t.key, t.shard) in seen or (t.key == "output_layer.weight" and tied):
                    continue  # tied: the output layer is the embedding tensor again
                seen.add((t.key, t.shard))
                for p in t.pieces:
                    count[p.source][tuple(slice(a, b) for a, b in p.src)] += 1
    for name, c in count.items():
        assert torch.all(c == 1), f"{family} {layout}: {name} covered {c.min()}..{c.max()} times"


# -- early, clear errors ------------------------------------------------------------------------

def test_unsupported_architecture_lists_supported(tiny, tmp_path):
    path = _copy(tiny["llama"], tmp_path / "foo", config={"architectures": ["FooForCausalLM"]})
    with pytest.raises(UnsupportedModel) as err:
        load_hf(path)
    text = str(err.value)
    assert "FooForCausalLM" in text
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "GPT2LMHeadModel", "MixtralForCausalLM",
                 "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in text


def test_heads_and_groups_not_divisible_by_tp(tiny):
    with pytest.raises(LayoutError, match="num_attention_heads=4 is not divisible by tp=3"):
        load_hf(tiny["llama"], ParallelLayout(tp=3))
    with pytest.raises(LayoutError, match=r"num_key_value_heads \(query groups\)=2 .* tp=4"):
        load_hf(tiny["llama"], ParallelLayout(tp=4))
    with pytest.raises(LayoutError, match="num_hidden_layers=4 is not divisible by pp=3"):
        load_hf(tiny["qwen3"], ParallelLayout(pp=3))


def test_missing_tensor_is_named(tiny, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy(tiny["llama"], tmp_path / "missing", drop=[name])
    with pytest.raises(CheckpointMismatch, match=f"lacks 1 tensor.*{name}"):
        load_hf(path)


def test_extra_tensor_is_named(tiny, tmp_path):
    name = "model.layers.0.mlp.extra_proj.weight"
    path = _copy(tiny["qwen3"], tmp_path / "extra", add={name: torch.zeros(3)})
    with pytest.raises(CheckpointMismatch, match=f"1 tensor.*does not use: {name}"):
        load_hf(path)


def test_shape_mismatch_is_named(tiny, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _copy(tiny["llama"], tmp_path / "shape", add={name: torch.zeros(3, 64)})
    with pytest.raises(CheckpointMismatch, match=f"{name}: stored \\(3, 64\\), expected"):
        load_hf(path)


def test_refuses_rope_megatron_cannot_compute(tiny, tmp_path):
    rope = {**ac.LLAMA3_ROPE, "high_freq_factor": 2.0}
    path = _copy(tiny["llama"], tmp_path / "rope", config={"rope_parameters": rope})
    with pytest.raises(UnsupportedModel, match="high_freq_factor"):
        adapter_for(path)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    path = _copy(tiny["llama"], tmp_path / "yarn", config={"rope_parameters": yarn})
    with pytest.raises(UnsupportedModel, match="rope_type='yarn'"):
        adapter_for(path)


def test_phi3_refuses_longrope():
    """LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini), as transformers 5 and 4.x configs write it."""
    from toolkit.adapters import HFConfig

    config = ac.tiny_configs()["phi3"]
    config.architectures = ["Phi3ForCausalLM"]
    half = int(16 * 0.75) // 2  # rotary channels / 2
    config.rope_parameters = {**config.rope_parameters, "rope_type": "longrope",
                              "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    with pytest.raises(UnsupportedModel, match="rope_type='longrope' .*LongRoPE"):
        adapter_for(config)
    legacy = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {"type": "su", "short_factor": [1.0] * half,
                              "long_factor": [2.0] * half}
    with pytest.raises(UnsupportedModel, match="rope_type='su' .*LongRoPE"):
        adapter_for(HFConfig(legacy))


def _gemma3_json(**changes) -> dict:
    data = {**ac.tiny_configs()["gemma3"].to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    return {**data, **changes}


@pytest.mark.parametrize(("changes", "match"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: megatron-core has no tanh"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: megatron-core"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"hidden_activation": "silu"}, "hidden_act='silu'.*gelu_pytorch_tanh"),
    ({"attention_bias": True}, "attention_bias=True: Gemma's MLP has no bias"),
])
def test_gemma3_refusals(changes, match):
    from toolkit.adapters import HFConfig

    with pytest.raises(UnsupportedModel, match=match):
        adapter_for(HFConfig(_gemma3_json(**changes)))


def test_gemma3_older_config_json():
    """A config.json in the older form (rope_theta + rope_scaling for global layers,
    rope_local_base_freq, sliding_window_pattern, no layer_types / rope_parameters) translates
    as transformers 5 reads it: same megatron-core arguments from the plain JSON view."""
    import transformers as tf

    from toolkit.adapters import HFConfig

    legacy = {k: v for k, v in _gemma3_json().items()
              if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=100.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    plain, ref = adapter_for(HFConfig(legacy)), adapter_for(tf.Gemma3TextConfig(**legacy))
    assert ref.hf_config.layer_types == ac.GEMMA3_LAYERS  # what transformers makes of it
    f = plain.family
    for fn in (f.transformer_kwargs, f.spec_kwargs, f.model_kwargs):
        assert fn(plain.hf_config) == fn(ref.hf_config), fn.__name__
    kw = f.transformer_kwargs(plain.hf_config)
    assert kw["window_size"] == (4, 0) and kw["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert kw["softmax_scale"] == 24 ** -0.5
    assert f.spec_kwargs(plain.hf_config)["local_rotary_base"] == 100.0
    model = f.model_kwargs(plain.hf_config)
    assert model["rotary_base"] == 1e6 and model["seq_len_interpolation_factor"] == 2.0
    assert model["embedding_scale"] == 64 ** 0.5


def test_gemma3_embedding_scale_rounds_in_the_embedding_dtype():
    """bf16: the output is embedding * bf16(sqrt(hidden)), as transformers computes it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from toolkit.models.gemma import scale_embeddings

    class Chunk(torch.nn.Module):  # the attribute path megatron-core's GPTModel has
        def __init__(self, emb: torch.nn.Embedding):
            super().__init__()
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = emb
            self.embedding.forward = emb.forward

    hidden = 3072  # sqrt = 55.42...: not exact in bf16
    hf = Gemma3TextScaledWordEmbedding(11, hidden, 0, embed_scale=hidden ** 0.5).to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight)
    chunk = Chunk(torch.nn.Embedding(11, hidden, dtype=torch.bfloat16))
    chunk.embedding.word_embeddings.weight.data.copy_(hf.weight)
    scale_embeddings(chunk, hidden ** 0.5)
    ids = torch.arange(11)
    assert torch.equal(chunk.embedding(ids), hf(ids))
    unrounded = (hf.weight.float() * hidden ** 0.5).to(torch.bfloat16)
    assert not torch.equal(unrounded, hf(ids))  # the rounding of the scale matters


def test_refuses_bias_combination(tiny, tmp_path):
    path = _copy(tiny["llama"], tmp_path / "bias",
                 config={"attention_bias": True, "mlp_bias": False})
    with pytest.raises(UnsupportedModel, match="attention_bias=True with mlp_bias=False"):
        adapter_for(path)


def _qwen_moe(name: str, **changes):
    config = ac.tiny_moe_configs()[name]
    config.architectures = [{"qwen2_moe": "Qwen2MoeForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM"}[name]]
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_only_layers=[0, 1, 2, 3]), r"mlp_only_layers=\[0, 1, 2, 3\].*no layer is sparse"),
    (dict(decoder_sparse_step=5), r"decoder_sparse_step=5: no layer is sparse"),
    (dict(num_experts=0), r"num_experts=0.*no layer is sparse"),
    (dict(num_experts_per_tok=1, norm_topk_prob=True),
     r"num_experts_per_tok=1 with norm_topk_prob=True"),
    (dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size=0"),
])
def test_qwen2_moe_refuses_what_megatron_cannot_represent(changes, message):
    with pytest.raises(UnsupportedModel, match=message):
        adapter_for(_qwen_moe("qwen2_moe", **changes))


def test_qwen3_moe_refuses_attention_bias():
    """Qwen3-MoE's attention_bias adds an o_proj bias but no expert bias: one megatron switch."""
    with pytest.raises(UnsupportedModel, match="attention_bias=True with mlp_bias=False"):
        adapter_for(_qwen_moe("qwen3_moe", attention_bias=True))


def test_qwen_moe_routing_and_dense_layers():
    """norm_topk_prob picks softmax-before-top-k; dense layers (decoder_sparse_step=2: layers 0
    and 2) become moe_layer_freq zeros with a dense MLP of intermediate_size and no experts."""
    a2 = adapter_for(_qwen_moe("qwen2_moe", decoder_sparse_step=2))
    kw = a2.family.transformer_kwargs(a2.hf_config)
    assert kw["moe_router_pre_softmax"] is True  # norm_topk_prob=False
    assert kw["moe_layer_freq"] == [0, 1, 0, 1]
    assert kw["moe_shared_expert_intermediate_size"] == 80 and kw["moe_shared_expert_gate"]
    assert (kw["ffn_hidden_size"], kw["moe_ffn_hidden_size"]) == (96, 48)
    table = a2.table(1)
    for i in (0, 2):
        rules = table.layers[i]
        assert table.experts[i] == []
        assert not any("router" in k or "shared" in k for k in rules)
        fc1 = rules["mlp.linear_fc1.weight"]
        assert (fc1.gate.source, fc1.ffn) == (f"model.layers.{i}.mlp.gate_proj.weight", 96)
    for i in (1, 3):
        rules = table.layers[i]
        assert len(table.experts[i]) == 4 and "mlp.linear_fc1.weight" not in rules
        assert rules["mlp.shared_experts.gate_weight"].source == \
            f"model.layers.{i}.mlp.shared_expert_gate.weight"
    shapes = a2.expected_tensors()
    assert shapes["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 64)
    assert shapes["model.layers.1.mlp.shared_expert.up_proj.weight"] == (80, 64)
    assert "model.layers.0.mlp.gate.weight" not in shapes
    a3 = adapter_for(_qwen_moe("qwen3_moe"))
    kw3 = a3.family.transformer_kwargs(a3.hf_config)
    assert kw3["moe_router_pre_softmax"] is False  # norm_topk_prob=True
    assert "moe_shared_expert_intermediate_size" not in kw3
    assert kw3["kv_channels"] == 24 and kw3["qk_layernorm"] and not kw3["add_qkv_bias"]
    assert kw3["moe_layer_freq"] == [1, 1, 0, 1]  # tiny config: mlp_only_layers=[2]


def test_gpt2_hub_style_names_and_mask_buffers(tiny):
    """Checkpoints saved from GPT2Model lack 'transformer.' and may hold attn.bias buffers."""
    adapter = adapter_for(tiny["gpt2"])
    expected = adapter.expected_tensors()
    stored = {n.removeprefix("transformer."): s for n, s in expected.items()}
    stored["h.0.attn.bias"] = (1, 1, 64, 64)
    names = adapter.match_checkpoint(stored)
    assert names["transformer.h.0.ln_1.weight"] == "h.0.ln_1.weight"
    stored["h.0.attn.c_attn.extra"] = (3,)
    with pytest.raises(CheckpointMismatch, match="h.0.attn.c_attn.extra"):
        adapter.match_checkpoint(stored)


# -- reader and writer ----------------------------------------------------------------------------

def test_writer_shards_index_and_reader_slices(tmp_path):
    tensors = {f"t{i}": torch.randn(8, 16) for i in range(5)}
    writer = HFWriter(tmp_path / "out", max_shard_bytes=2 * 8 * 16 * 4)
    for name, t in tensors.items():
        writer.add(name, t)
    import transformers

    out = writer.finish(transformers.LlamaConfig(vocab_size=11))
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    with HFReader(out) as reader:
        assert sorted(reader.names) == sorted(tensors)
        part = reader.read("t3", ((2, 5), (4, 12)))
        assert torch.equal(part, tensors["t3"][2:5, 4:12])
        assert reader.reads[-1].nbytes == 3 * 8 * 4
    with pytest.raises(CheckpointError, match="exists"):
        HFWriter(out)


def test_reader_bin_checkpoint(tmp_path):
    sd = {"a": torch.randn(6, 4), "b": torch.randn(3)}
    (tmp_path / "ck").mkdir()
    torch.save(sd, tmp_path / "ck" / "pytorch_model.bin")
    with HFReader(tmp_path / "ck") as reader:
        assert reader.kind == "bin" and reader.shape("a") == (6, 4)
        assert torch.equal(reader.read("a", ((1, 3), (0, 4))), sd["a"][1:3])
    with pytest.raises(CheckpointError, match="no weights"):
        HFReader(tmp_path)


_OPEN_ARCH = {"gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
              "kimi_k2": "DeepseekV3ForCausalLM"}


@pytest.mark.parametrize(("family", "changes", "match"), [
    ("gpt_oss", {"swiglu_alpha": 1.0}, r"swiglu_alpha=1.0: .*quick GELU"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
     r"layer_types=\[.*'chunked_attention'.*fix it in config.json"),
    ("gpt_oss", {"rope_parameters": {**ac.GPT_OSS_YARN, "attention_factor": 0.5}},
     r"'attention_factor': 0.5"),
    ("glm4_moe", {"topk_method": "greedy"}, r"routing \{'topk_method': 'greedy'\}"),
    ("glm4_moe", {"topk_group": 2}, r"routing \{'topk_group': 2\}"),
    ("kimi_k2", {"scoring_func": "softmax"}, r"routing \{'scoring_func': 'softmax'\}"),
])
def test_open_moe_refusals(family, changes, match):
    """Issue 39's families: a setting megatron-core cannot compute as transformers does is one
    UnsupportedModel naming the key (config.json as read: no transformers config class)."""
    from toolkit.adapters import HFConfig

    data = {**ac.tiny_open_moe_configs()[family].to_dict(), "architectures": [_OPEN_ARCH[family]]}
    with pytest.raises(UnsupportedModel, match=match):
        adapter_for(HFConfig({**data, **changes}))


def test_gpt_oss_needs_etp_1_and_cp_1():
    """GPT-OSS's experts have biases: megatron-core has them only at etp=1; tp=2 alone (etp
    defaults to tp) is refused naming parallel.etp, and etp=1 is accepted. Its sinks and
    sliding windows have no context-parallel form: cp=2 is refused before any model is built."""
    from toolkit.adapters import HFConfig
    from toolkit.parallel.layout import LayoutError, ParallelLayout

    adapter = adapter_for(HFConfig({**ac.tiny_open_moe_configs()["gpt_oss"].to_dict(),
                                    "architectures": ["GptOssForCausalLM"]}))
    with pytest.raises(LayoutError, match=r"etp=2: .*set parallel.etp=1"):
        adapter.validate(ParallelLayout(tp=2))
    adapter.validate(ParallelLayout(tp=2, etp=1))
    with pytest.raises(LayoutError, match=r"context parallelism \(cp=2\): .*sinks.*set cp=1"):
        adapter.validate(ParallelLayout(cp=2))


def _mxfp4_reader(path):
    """The MXFP4 layer of the reader mdtk opens ``path`` with (after the stacks' ``expect``)."""
    from toolkit.checkpoint.hf import open_reader

    adapter = adapter_for(path)
    config = json.loads((path / "config.json").read_text())
    return open_reader(path, config, torch.float32, stacks=adapter.stacks)


def test_mxfp4_reader_regions_in_both_orientations(tmp_path):
    """Any region of an MXFP4 expert weight (partial 32-value groups, a few experts) equals the
    same slice of the whole weight, with the blocks along the input dimension (GPT-OSS's
    published layout) and along the output dimension (transformers' quantizer: the fixture).
    A file holding both orientations is refused naming both."""
    fixture = ac.TRANSFORMERS_MXFP4 / "quantized"
    published = tmp_path / "published"
    shutil.copytree(fixture, published)
    weights = load_file(str(fixture / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name in [n for n in weights if n.endswith("_blocks")]:
        e, rows, groups, _ = weights[name].shape  # along out: [E, in, out / 32, 16]
        flip = (e, groups * 32, rows // 32)
        weights[name] = torch.randint(0, 256, (*flip, 16), generator=g, dtype=torch.uint8)
        weights[name.replace("_blocks", "_scales")] = torch.randint(
            118, 126, flip, generator=g, dtype=torch.uint8)
    save_file(weights, str(published / "model.safetensors"), metadata={"format": "pt"})
    for path, along_out in ((fixture, True), (published, False)):
        with _mxfp4_reader(path) as reader:
            mx = reader.inner
            assert bool(mx.along_out) is along_out
            for name in sorted(mx.quantized):
                shape = mx.shape(name)
                whole = mx.read(name, tuple((0, n) for n in shape))
                assert whole.shape == shape
                for region in (((1, 3), (5, 40), (7, 61)), ((0, 4), (33, 64), (0, 3)),
                               ((2, 3), (0, 64), (31, 33))):
                    got = mx.read(name, region)
                    want = whole[tuple(slice(a, b) for a, b in region)]
                    assert torch.equal(got, want), (path.name, name, region)
    mixed = tmp_path / "mixed"
    shutil.copytree(fixture, mixed)
    weights = load_file(str(fixture / "model.safetensors"))
    for suffix in ("_blocks", "_scales"):
        name = "model.layers.1.mlp.experts.gate_up_proj" + suffix
        weights[name] = load_file(str(published / "model.safetensors"))[name]
    save_file(weights, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"two orientations: .*layers\.1.*input.*"
                                              r"layers\.0.*output"):
        _mxfp4_reader(mixed)


def _hybrid_json(name: str, **changes):
    from toolkit.adapters import HFConfig

    arch = {"qwen3_next": "Qwen3NextForCausalLM", "llama4": "Llama4ForCausalLM"}[name]
    return HFConfig({**ac.tiny_moe_configs()[name].to_dict(), "architectures": [arch], **changes})


@pytest.mark.parametrize(("name", "changes", "match"), [
    ("qwen3_next", {"layer_types": ["linear_attention"] * 3},
     r"layer_types has 3 entries for num_hidden_layers=4"),
    ("qwen3_next", {"layer_types": ["linear_attention", "sliding_attention"] * 2},
     r"layer_types holds \['sliding_attention'\]"),
    ("qwen3_next", {"linear_num_value_heads": 3},
     r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ("qwen3_next", {"attention_bias": True}, r"attention_bias=True"),
    ("llama4", {"num_experts_per_tok": 2}, r"num_experts_per_tok=2: .*for top-1 only"),
    ("llama4", {"moe_layers": []}, r"moe_layers=\[\]: .*at least one MoE layer"),
    ("llama4", {"moe_layers": [1, 7]}, r"moe_layers=\[1, 7\]: .*below num_hidden_layers=4"),
    ("llama4", {"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers=\[1, 2, 1, 0\]"),
    ("llama4", {"layer_types": ["chunked_attention", "sliding_attention"] * 2},
     r"layer_types holds \['sliding_attention'\]"),
])
def test_hybrid_refusals_name_the_key(name, changes, match):
    """Qwen3-Next / Llama 4 options mdtk cannot build: one UnsupportedModel naming the key."""
    with pytest.raises(UnsupportedModel, match=match):
        adapter_for(_hybrid_json(name, **changes))


@pytest.mark.parametrize(("name", "why"), [("qwen3_next", "gated DeltaNet"),
                                           ("llama4", "chunked attention")])
def test_hybrid_refuse_context_parallel(name, why):
    """cp > 1 is a LayoutError naming the layer kind (before any model is built); cp = 1 passes."""
    adapter = adapter_for(_hybrid_json(name))
    with pytest.raises(LayoutError, match=rf"context parallelism \(cp=2\): .*{why}.*set cp=1"):
        adapter.validate(ParallelLayout(cp=2))
    adapter.validate(ParallelLayout(tp=2))


def test_sliding_window_config_refuses_context_parallel_early():
    """A Mistral config with a sliding window: cp=2 is a LayoutError before any model is built
    (mdtk's CP attention has no window); without the window cp=2 passes."""
    from toolkit.adapters import HFConfig
    from toolkit.parallel.layout import LayoutError, ParallelLayout

    data = {**ac.tiny_configs()["mistral"].to_dict(), "architectures": ["MistralForCausalLM"]}
    with pytest.raises(LayoutError, match=r"cp=2\): .*sliding-window attention; set cp=1"):
        adapter_for(HFConfig(data)).validate(ParallelLayout(cp=2))
    adapter_for(HFConfig({**data, "sliding_window": None})).validate(ParallelLayout(cp=2))
