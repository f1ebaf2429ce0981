"""One model description: the memory model's shape comes from the family alone, and is exact.

For every registered family, a tiny config built with the real transformers config class (the
adapter tests' tiny configs) is written as ``save_pretrained`` writes config.json; the memory
model reads it through the family (no transformers) and its parameter count must equal
``sum(p.numel())`` of the real HF model built from the same config, per layer and in total. The
mapping table of the same family must name exactly as many HF elements. The presets must have
their published sizes. ``mdtk estimate`` / ``ds-config`` must not import torch or transformers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_checks import adapter_checks as ac

from toolkit.adapters import FAMILIES, adapter_for, family_of, read_hf_config, supported
from toolkit.adapters.presets import MODEL_PRESETS, get_preset
from toolkit.memory import load_model_shape, model_shape_from_hf

ROOT = Path(__file__).resolve().parent.parent


def _arch(config) -> str:
    return type(config).__name__.replace("Config", "ForCausalLM").replace(
        "GPT2ForCausalLM", "GPT2LMHeadModel").replace("Gemma3Text", "Gemma3").replace(
        "Llama4Text", "Llama4")


def tiny_configs() -> dict:
    """The adapter tests' tiny configs, plus variants that switch a declared feature."""
    import transformers as tf

    configs = {**ac.tiny_configs(), **ac.tiny_moe_configs(), **ac.tiny_open_moe_configs()}
    moe = configs["qwen2_moe"].to_dict()
    moe.pop("layer_types", None)
    configs["qwen2_moe_sparse_step_2"] = tf.Qwen2MoeConfig(**{**moe, "decoder_sparse_step": 2})
    configs["gpt2_untied_no_n_inner"] = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                      vocab_size=ac.VOCAB, n_positions=32,
                                                      tie_word_embeddings=False)
    for config in configs.values():
        config.architectures = [_arch(config)]
    return configs


CONFIGS = tiny_configs()


def test_every_registered_family_has_a_tiny_config():
    covered = {c.architectures[0] for c in CONFIGS.values()}
    assert set(supported()) <= covered, f"add a tiny config for {set(supported()) - covered} " \
                                        "to tests/dist_checks/adapter_checks.py"
    assert len(supported()) == 15  # issue 39: + GPT-OSS, GLM-4.5, Qwen3-Next, Llama 4 (Kimi K2
    # is DeepSeek-V3)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_count_from_family_equals_hf_model(name, tmp_path):
    from transformers import AutoModelForCausalLM

    config = CONFIGS[name]
    config.save_pretrained(tmp_path)  # config.json as written to disk (defaults left out)
    hf_json = read_hf_config(tmp_path)
    family = family_of(hf_json)
    assert family is FAMILIES[config.architectures[0]]
    shape = model_shape_from_hf(hf_json, name=name)  # the family alone: no transformers here
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = _stored(model)  # tied weights appear once; stored buffers (DeepSeek's bias) count
    assert shape.num_params() == sum(p.numel() for p in params.values()) > 0
    for i in range(shape.layers):
        prefix = family.layer.format(i=i)
        hf_layer = sum(p.numel() for n, p in params.items() if n.startswith(prefix))
        assert shape.layer_params(i) == hf_layer, f"{name} layer {i}"
    # The mapping table the adapter loads weights with describes the same elements.
    table = adapter_for(config).table(1)
    mapped = sum(math.prod(s) for s in table.hf_shapes().values())
    assert mapped == shape.num_params()


def _stored(model) -> dict:
    """Parameters and persistent buffers (what ``save_pretrained`` stores), by name."""
    out = dict(model.named_parameters())
    for prefix, mod in model.named_modules():
        out.update((f"{prefix}.{n}".lstrip("."), b) for n, b in mod._buffers.items()
                   if b is not None and n not in mod._non_persistent_buffers_set)
    return out




# Published sizes: the parameter counts of the hub checkpoints (model pages / safetensors
# metadata of openai-community/gpt2, meta-llama/Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B,
# Qwen/Qwen2.5-7B, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B), each re-derived below
# by building the HF model from the preset config on the meta device.
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
    "mixtral-8x7b": 46_702_792_704,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    # deepseek-ai/DeepSeek-V3: 671B without the MTP layer = HF's 671,026,404,352 parameters +
    # 58 MoE layers x 256 e_score_correction_bias (a stored buffer). The hub's 685B adds the MTP
    # layer (13,463,426,304 with its embedding/head copies) and the FP8 weight_scale_inv tensors.
    "deepseek-v3": 671_026_419_200,
}


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_have_their_published_sizes(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert load_model_shape(name).num_params() == PUBLISHED[name]
    cfg = get_preset(name)
    cfg.pop("architectures")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"),
                                                                      **cfg))
    assert sum(p.numel() for p in _stored(model).values()) == PUBLISHED[name]


def test_moe_presets_active_params():
    assert round(load_model_shape("mixtral-8x7b").active_params() / 1e9, 1) == 12.9
    assert round(load_model_shape("qwen1.5-moe-a2.7b").active_params() / 1e9, 1) == 2.7
    # DeepSeek-V3 "37B activated": 8 of 256 routed experts + everything else, 37.55B
    assert round(load_model_shape("deepseek-v3").active_params() / 1e9, 1) == 37.6


def test_new_family_file_gets_estimates_without_memory_code(tmp_path):
    """A family declared only through switches (here: Llama with q/k norm and q/k/v biases
    under a made-up architecture) is sized from its declarations."""
    from toolkit.adapters import Family, register
    from toolkit.adapters.registry import FAMILIES as registry

    @register
    class Probe(Family):
        architectures = ("ProbeForCausalLM",)
        qk_norm, qkv_bias, linear_bias, mlp_bias = True, True, False, False

    try:
        cfg = {**get_preset("llama-3.2-1b"), "architectures": ["ProbeForCausalLM"]}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        probe, llama = load_model_shape(str(tmp_path)), load_model_shape("llama-3.2-1b")
        q_dim, kv_dim = 32 * 64, 8 * 64
        per_layer = 2 * 64 + q_dim + 2 * kv_dim  # q/k norms + q/k/v biases
        assert probe.num_params() - llama.num_params() == 16 * per_layer
    finally:
        del registry["ProbeForCausalLM"]


@pytest.mark.parametrize("args", [
    ["estimate", "--model", "llama-3.1-8b", "--tp", "2", "--stage", "3"],
    ["estimate", "--model", "CONFIG_DIR"],
    ["ds-config", "--model", "qwen1.5-moe-a2.7b", "-q"],
])
def test_estimate_and_ds_config_import_neither_torch_nor_transformers(args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(get_preset("mixtral-8x7b")))
    args = [str(tmp_path) if a == "CONFIG_DIR" else a for a in args]
    code = ("import json, sys\nfrom toolkit.cli import app\n"
            "try:\n    app(sys.argv[1:], standalone_mode=False)\nexcept SystemExit as e:\n"
            "    assert not e.code, e\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers', 'deepspeed', 'megatron'})\n"
            "print('HEAVY=' + json.dumps(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         cwd=tmp_path, env={**_env(), "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    heavy = json.loads(out.stdout.rsplit("HEAVY=", 1)[1])
    assert heavy == [], f"mdtk {' '.join(args)} imported {heavy}"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_hf_config_view_and_reader(tmp_path):
    from toolkit.adapters import HFConfig, HFConfigError

    cfg = HFConfig({"hidden_size": 8, "head_dim": None, "rope_scaling": {"factor": 2.0},
                    "text_config": {"hidden_size": 4}})
    assert cfg.hidden_size == 8 and getattr(cfg, "missing", 3) == 3 and not hasattr(cfg, "x")
    assert cfg.head_dim is None and cfg.get("head_dim", 5) == 5
    assert cfg.text_config.hidden_size == 4 and cfg.rope_scaling == {"factor": 2.0}
    copy = cfg.to_dict()
    copy["rope_scaling"]["factor"] = 9.0
    assert cfg.rope_scaling["factor"] == 2.0  # to_dict is a deep copy
    with pytest.raises(AttributeError, match="read-only"):
        cfg.hidden_size = 3
    with pytest.raises(HFConfigError, match="holds no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(HFConfigError, match="not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(HFConfigError, match="JSON list, not an object"):
        read_hf_config(tmp_path / "config.json")


def test_multimodal_text_config_and_model_type_lookup():
    """A config whose decoder sits in ``text_config`` (no architectures of its own) is sized by
    the family of its ``model_type``; an unknown one is refused naming the known types."""
    from toolkit.memory import ModelConfigError

    text = {k: v for k, v in get_preset("llama-3.1-8b").items() if k != "architectures"}
    outer = {"architectures": ["LlavaForConditionalGeneration"], "text_config": text}
    assert model_shape_from_hf(outer).num_params() == PUBLISHED["llama-3.1-8b"]
    with pytest.raises(ModelConfigError, match="model_type='nope'.*llama"):
        model_shape_from_hf({**text, "model_type": "nope"})


# -- the model description of a command (ModelSpec) -----------------------------------------------

def test_model_spec_reads_once_and_builds_one_mapping_per_dtype(tmp_path, monkeypatch):
    """A spec made from a folder reads its config.json once; its mapping is built on first use
    and is then the same object for the same dtype and padding (another dtype or padding: one
    more); pickled (a converter's worker) it carries the config, not its caches; the live spec's
    transformers config is what ``AutoConfig.from_pretrained`` makes of the folder."""
    import pickle

    from transformers import AutoConfig

    from toolkit.adapters import HFConfigError, ModelSpec
    from toolkit.adapters.spec import EVENTS, read_events

    CONFIGS["llama"].save_pretrained(tmp_path / "llama")
    events = tmp_path / "events"
    monkeypatch.setenv(EVENTS, str(events))
    spec = ModelSpec.of(tmp_path / "llama")
    assert ModelSpec.of(spec) is spec and spec.source == tmp_path / "llama"
    first = spec.adapter()
    assert spec.adapter() is first and spec.adapter(spec.dtype) is first
    other = torch.float16 if spec.dtype.name == "bfloat16" else torch.bfloat16
    assert spec.adapter(other) is not first and spec.adapter(other).params_dtype.name == str(
        other).removeprefix("torch.")
    assert spec.adapter(vocab_multiple=128).padded_vocab(2) % 256 == 0
    assert type(first.hf_config).__name__ == "HFConfig"  # plain JSON: no transformers
    assert spec.shape == model_shape_from_hf(read_hf_config(tmp_path / "llama"))
    assert spec.shape.num_params() == sum(math.prod(s) for s in first.expected_tensors().values())
    copy = pickle.loads(pickle.dumps(spec))
    assert copy.config == spec.config and copy.source == spec.source
    assert copy.adapter() is not first and copy.adapter().table(2) == first.table(2)
    assert read_events(events)[os.getpid()] == {"read": 2, "mapping": 4}  # the 2nd: this test's

    live = ModelSpec.of(tmp_path / "llama", live=True)
    made = live.transformers_config()
    assert live.transformers_config() is made
    assert made.to_dict() == AutoConfig.from_pretrained(str(tmp_path / "llama")).to_dict()
    assert live.adapter().hf_config is made and live.adapter().table(2) == first.table(2)
    with pytest.raises(HFConfigError, match="not a preset"):
        ModelSpec.named("no-such-model")


def test_model_spec_writes_its_config_as_read_or_for_new_weights(tmp_path):
    """``write`` gives back the config as read; with a dtype (a conversion's output) the dtype
    keys say it and an fp8 quantization declaration is dropped."""
    from toolkit.adapters import ModelSpec

    raw = {**get_preset("llama-3.2-1b"), "torch_dtype": "float32",
           "quantization_config": {"quant_method": "fp8"}}
    spec = ModelSpec.of(raw)
    assert read_hf_config(spec.write(tmp_path / "a")).to_dict() == raw
    out = read_hf_config(spec.write(tmp_path / "b", torch.bfloat16)).to_dict()
    assert (out["dtype"], out["torch_dtype"]) == ("bfloat16", "bfloat16")
    assert "quantization_config" not in out and spec.raw == raw
