"""Rank functions for the trainer checks (toolkit.train.trainer.run, end to end).

Every case runs the real trainer: HF checkpoint -> adapters -> megatron-core chunks -> DeepSpeed
engine -> data pipeline -> steps. The reference is the same config on one rank (tp = pp = dp = 1);
a layout only changes how the model, the global batch and the reductions are split, so every
per-step loss must match it. Many cases run one after another in the same ranks, which also
checks that ``run`` tears its process groups and engine down.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_checks import pool_jobs

PRETRAIN = "bundled:examples/data/pretrain.jsonl"
SFT = "bundled:examples/data/sft.jsonl"
STEPS, MICRO, GLOBAL, SEQ, LR = 5, 2, 8, 32, 1e-2
TOKENIZER_VOCAB = 500  # ids < 500: fits the odd-vocab model (507)
VOCAB = {"dense": 512, "odd": 507, "moe": 512, "phi3": 512, "gemma3": 512, "dsv3": 512,
         "gpt_oss": 512, "qwen3n": 512, "llama4": 512, "glm": 512, "kimi": 512}


@dataclass(frozen=True)
class Case:
    """One trainer run: the model, the layout and the DeepSpeed settings."""

    name: str
    model: str = "dense"  # dense (Llama) | odd (tied Llama, vocab 507) | moe (Mixtral) | phi3
    #                       | gemma3 | dsv3 (DeepSeek-V3: MLA + sigmoid-routed experts)
    #                       | gpt_oss (sinks, sliding window, biased clamped experts)
    #                       | qwen3n (Qwen3-Next: gated DeltaNet + gated attention, MoE)
    #                       | llama4 (Llama 4 text: chunked / NoPE attention, top-1 MoE)
    #                       | glm (GLM-4.5: partial RoPE, q/k norm, sigmoid routing, shared)
    #                       | kimi (Kimi K2: DeepSeek-V3's architecture, config.json kimi_k2)
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 1
    offload: str = "none"
    steps: int = STEPS
    overrides: tuple[str, ...] = ()
    ref: str | None = None  # the reference case to match (default: ref_<model>)
    mode: str = "pretrain"  # pretrain | sft (masked prompts)
    grads: bool = False  # also return every parameter's reduced gradient of the first step


# -- assets (built in the test process, without mdtk's CPU mode) ---------------------------------

def make_assets(root: Path) -> dict[str, str]:
    """A tiny tokenizer and three tiny HF checkpoints with random weights."""
    import transformers as tf

    from dist_checks.adapter_checks import (
        as_kimi_k2,
        tiny_deepseek_v3,
        tiny_llama4,
        tiny_open_moe_configs,
        tiny_qwen3_next,
    )
    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(root / "tokenizer", vocab_size=TOKENIZER_VOCAB)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=256, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    configs = {
        "dense": tf.LlamaConfig(**common, vocab_size=VOCAB["dense"], tie_word_embeddings=False),
        # odd vocab: tp=2 pads the embedding/output to 508; tied as in Llama 3.2
        "odd": tf.LlamaConfig(**common, vocab_size=VOCAB["odd"], tie_word_embeddings=True),
        "moe": tf.MixtralConfig(**{**common, "intermediate_size": 48, "num_hidden_layers": 2},
                                vocab_size=VOCAB["moe"], num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None),
        # fused qkv_proj / gate_up_proj, partial RoPE, tied (Phi-4-mini's layout)
        "phi3": tf.Phi3Config(**common, vocab_size=VOCAB["phi3"], tie_word_embeddings=True,
                              partial_rotary_factor=0.75),
        # (1 + w) norms, post-norms, embedding scale, GeGLU, sliding / global layers, tied
        "gemma3": tf.Gemma3TextConfig(**{**common, "pad_token_id": 1}, vocab_size=VOCAB["gemma3"],
                                      head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"] * 2),
        "dsv3": tiny_deepseek_v3(**{**common, "intermediate_size": 96, "num_hidden_layers": 2,
                                    "num_key_value_heads": 4, "rms_norm_eps": 1e-6},
                                 vocab_size=VOCAB["dsv3"]),
        "gpt_oss": tf.GptOssConfig(**{**common, "intermediate_size": 64, "num_hidden_layers": 2},
                                   head_dim=16, vocab_size=VOCAB["gpt_oss"], num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=8),
        **{name: make(vocab_size=VOCAB[name], max_position_embeddings=256, eos_token_id=0,
                      pad_token_id=1, bos_token_id=None)
           for name, make in (("qwen3n", tiny_qwen3_next), ("llama4", tiny_llama4))},
        **{name: tiny_open_moe_configs(
            vocab_size=VOCAB[name], num_hidden_layers=2, eos_token_id=0, pad_token_id=1,
            bos_token_id=None)[hf_name] for name, hf_name in (("glm", "glm4_moe"),
                                                              ("kimi", "kimi_k2"))},
    }
    out = {"tokenizer": str(tok), "cache": str(root / "data_cache")}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(10 + i)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # larger weights than HF's init: the losses move visibly in 5 steps
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.normal_(0.0, 0.08)
            for bname, b in model.named_buffers():  # DeepSeek's routing bias: a stored buffer
                if bname.endswith("e_score_correction_bias"):  # non-zero, so a loss shows
                    b.normal_(0.0, 0.08)
        model.save_pretrained(root / name)
        if name == "kimi":
            as_kimi_k2(root / name)
        if name == "gpt_oss":  # a copy with MXFP4 experts, from two folders (see _as_mxfp4)
            shutil.copytree(root / name, root / "gpt_oss_dense_mxfp4")
            out["gpt_oss_mxfp4"] = str(_as_mxfp4(root / "gpt_oss_dense_mxfp4"))
            out["gpt_oss_dense_mxfp4"] = str(root / "gpt_oss_dense_mxfp4")
        out[name] = str(root / name)
    return out


def _as_mxfp4(path: Path) -> Path:
    """``path`` + "_mxfp4": the GPT-OSS at ``path`` with random MXFP4 experts (GPT-OSS's
    published layout, 2^-7..2^-5 scales: weights about this file's size); ``path``'s experts
    then become transformers' dequantization of them (``Mxfp4Config(dequantize=True)``; written
    here: transformers 5.23 saves such a model's experts under the ``*_blocks`` names), so both
    folders hold the same model."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from dist_checks.adapter_checks import write_mxfp4

    mxfp4 = write_mxfp4(path, path.with_name(path.name + "_mxfp4"), scales=(120, 123), seed=11)
    dense = tf.AutoModelForCausalLM.from_pretrained(
        mxfp4, dtype=torch.float32, quantization_config=tf.Mxfp4Config(dequantize=True))
    params = dict(dense.named_parameters())
    file = path / "model.safetensors"
    weights = load_file(str(file))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[name] = params[name].detach().contiguous()
    save_file(weights, str(file), metadata={"format": "pt"})
    return mxfp4


def config(case: Case, assets: dict[str, str], out: str | Path, *, mode: str | None = None):
    from toolkit.train.config import apply_overrides, config_from_dict

    mode = mode or case.mode

    raw: dict[str, Any] = {
        "output_dir": str(out),
        "model": {"path": assets[case.model], "tokenizer": assets["tokenizer"]},
        "parallel": {"tp": case.tp, "pp": case.pp, "vpp": case.vpp, "cp": case.cp,
                     "ep": case.ep, "sequence_parallel": case.sp},
        "deepspeed": {"zero_stage": case.zero, "offload": case.offload},
        "data": {"mode": mode, "sources": [PRETRAIN if mode == "pretrain" else SFT],
                 "validation_split": 0.0, "cache_dir": assets["cache"]},
        # constant LR: a run stopped early and resumed with more steps keeps the same schedule
        "optim": {"lr": LR, "decay": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                  "clip_grad": 1.0},
        "train": {"steps": case.steps, "micro_batch": MICRO, "global_batch": GLOBAL,
                  "seq_len": SEQ, "precision": "fp32", "seed": 1234},
        "checkpoint": {"interval": 0, "keep_last": 0, "resume": "none"},
        "logging": {"interval": 1},
    }
    return config_from_dict(apply_overrides(raw, case.overrides))


# -- rank functions ------------------------------------------------------------------------------

def run_case(case: Case, assets: dict[str, str], workdir: str,
             on_engine: Any = None) -> dict[str, Any]:
    """Train ``case`` with the real trainer; its per-step losses and what the ranks saw (with
    how often this rank read a config.json and built a mapping, config checks included).
    ``on_engine(engine, seen)``: called with each engine built (e.g. to measure it)."""
    from toolkit.adapters.spec import EVENTS, read_events

    out = Path(workdir) / case.name
    Path(workdir).mkdir(parents=True, exist_ok=True)
    fd, events = tempfile.mkstemp(prefix=f"{case.name}.model_events.", dir=workdir)
    os.close(fd)
    os.environ[EVENTS] = events
    try:
        cfg = config(case, assets, out)
        result = _run_spied(case, cfg, on_engine)
    finally:
        del os.environ[EVENTS]
    return {**result, "model_events": read_events(events).get(os.getpid(), {})}


def _run_spied(case: Case, cfg: Any, on_engine: Any) -> dict[str, Any]:
    """``trainer.run(cfg)``, the engines it builds watched; what ``run_case`` returns."""
    from megatron.core import parallel_state as ps

    from toolkit.train import trainer

    out = Path(str(cfg.output_dir))
    seen: dict[str, Any] = {}
    built: list[weakref.ref] = []  # the engines this run built: freed when it returns?
    threads = _gloo_threads()
    original = trainer.build_engine

    def spy(chunks, mpu, ds_config, **kw):  # records the layout the run really used
        seen.update(tp=ps.get_tensor_model_parallel_world_size(),
                    pp=ps.get_pipeline_model_parallel_world_size(),
                    dp=ps.get_data_parallel_world_size(),
                    cp=ps.get_context_parallel_world_size(),
                    ep=ps.get_expert_model_parallel_world_size(), chunks=len(chunks),
                    padded_vocab=int(chunks[0].vocab_size))
        engine = original(chunks, mpu, ds_config, **kw)
        built.append(weakref.ref(engine))
        if case.grads:
            _record_first_grads(engine, seen)
        if on_engine is not None:
            on_engine(engine, seen)
        return engine

    trainer.build_engine = spy
    try:
        result = trainer.run(cfg)
    finally:
        trainer.build_engine = original
    # twice: objects with finalizers in a cycle (the MoE layers' groups) are freed by the
    # collection after the one that finalizes them
    pool_jobs.collect(times=2)
    freed = bool(built) and all(ref() is None for ref in built)
    threads = (threads, _gloo_threads(settle_to=threads))
    metrics = []
    if dist.get_rank() == 0:
        metrics = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text()
                   .splitlines()]
    return {"case": case.name, "losses": result.losses, "start": result.start_step,
            "metrics": metrics, "stage": result.ds_config["zero_optimization"]["stage"],
            "left_initialised": _groups_left(), "engine_freed": freed,
            "gloo_threads": threads,
            "export_diff": result.export_max_abs_diff, "adapter_diff": result.adapter_max_abs_diff,
            **seen}


def _record_first_grads(engine, seen: dict[str, Any]) -> None:
    """Keep every parameter's gradient as the first ``engine.step`` gets it (ZeRO-0: reduced
    over the data-parallel group in ``param.grad``, before clipping and the update)."""
    step = engine.step

    def recording_step(*args, **kwargs):
        if "grads" not in seen and dist.get_rank() == 0:
            seen["grads"] = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
                             if p.grad is not None}
        return step(*args, **kwargs)

    engine.step = recording_step


def _gloo_threads(settle_to: int | None = None) -> int:
    """This process's gloo transport threads: one per live process group's device, each waking
    ~100 times a second (what a group that outlives its run costs an idle rank). A group freed
    by the garbage collector stops its threads asynchronously: with ``settle_to``, wait up to
    2 s for the count to come down to it."""
    for _ in range(20):
        count = 0
        for task in os.listdir("/proc/self/task"):
            try:
                count += "gloo" in Path(f"/proc/self/task/{task}/comm").read_text()
            except OSError:  # the thread ended meanwhile
                pass
        if settle_to is None or count <= settle_to:
            break
        time.sleep(0.1)
    return count


def _groups_left() -> bool:
    from megatron.core import parallel_state as ps

    return bool(ps.model_parallel_is_initialized())


def run_cases(cases: list[Case], assets: dict[str, str], workdir: str) -> list[dict[str, Any]]:
    return [run_case(c, assets, workdir) for c in cases]


def resume_runs(assets: dict[str, str], workdir: str, zero: int = 2) -> dict[str, Any]:
    """6 steps straight; 3 steps + checkpoint; the same folder resumed up to 6 steps."""
    full = run_case(Case("resume_full6", zero=zero, steps=6), assets, workdir)
    stop = Case("resume_stop3", zero=zero, steps=3,
                overrides=("checkpoint.interval=3", "checkpoint.resume=auto"))
    first = run_case(stop, assets, workdir)
    more = run_case(Case("resume_stop3", zero=zero, steps=6, overrides=stop.overrides),
                    assets, workdir)
    return {"full": full, "first": first, "resumed": more,
            "checkpoint": str(Path(workdir) / "resume_stop3" / "checkpoints" / "step_0000003")}


def refusal(case: Case, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """The ConfigError ``run`` raises for ``case``, whether it got as far as the engine and
    whether it had made megatron-core's process groups (a spy on ``parallel.initialize``)."""
    from toolkit.train import trainer
    from toolkit.train.config import ConfigError

    out = Path(workdir) / case.name
    made, initialize = [], trainer.parallel.initialize

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(True)
        return initialize(*args, **kwargs)

    trainer.parallel.initialize = spy
    try:
        trainer.run(config(case, assets, out))
    except ConfigError as e:
        return {"case": case.name, "error": str(e), "groups_made": bool(made),
                "ds_config_written": (out / "ds_config.json").exists(),
                "left_initialised": _groups_left()}
    finally:
        trainer.parallel.initialize = initialize
    return {"case": case.name, "error": "", "ds_config_written": True, "groups_made": True,
            "left_initialised": _groups_left()}


def refusals(cases: list[Case], assets: dict[str, str], workdir: str) -> list[dict[str, Any]]:
    return [refusal(c, assets, workdir) for c in cases]


def two_rank_checks(cases: list[Case], refuse: list[Case], assets: dict[str, str],
                    workdir: str) -> dict[str, Any]:
    """Everything that runs on 2 ranks, in one pool call: layouts, resume, refusals."""
    return {"cases": run_cases(cases, assets, workdir), "resume": resume_runs(assets, workdir),
            "refusals": refusals(refuse, assets, workdir)}


def single_rank_checks(assets: dict[str, str], workdir: str, sft_first_loss: float,
                       checkpoint: str) -> dict[str, Any]:
    """On one rank, after the reference runs (``run_cases``: the trainer's first SFT loss is
    ``ref_sft``'s): a resume of a dp2 ZeRO-2 checkpoint, the SFT loss by hand."""
    out: dict[str, Any] = {}
    resume = Case("resume_dp1", steps=6, zero=2, overrides=(f"checkpoint.resume={checkpoint}",))
    out["resume_dp_change"] = run_case(resume, assets, workdir)  # resharded (train.reshard)
    out["sft"] = sft_loss_by_hand(assets, workdir, sft_first_loss)
    out["sft_validation"] = {m: sft_validation(m, assets, workdir) for m in SFT_MODELS}
    return out


SFT_MODELS = ("phi3", "gemma3", "dsv3")  # families whose fine-tune must lower the validation loss


def sft_validation(model: str, assets: dict[str, str], workdir: str,
                   steps: int = 20) -> dict[int, float]:
    """An SFT fine-tune of ``model`` with a held-out split: validation loss by step."""
    from toolkit.train import trainer

    case = Case(f"sft_val_{model}", model=model, steps=steps,
                overrides=("data.validation_split=0.1", f"train.eval_interval={steps // 2}"))
    return trainer.run(config(case, assets, Path(workdir) / case.name, mode="sft")).val_losses


def sft_loss_by_hand(assets: dict[str, str], workdir: str, first_loss: float,
                     ) -> dict[str, float]:
    """The trainer's first SFT loss (``first_loss``: step 1 of the ``ref_sft`` run, the dense
    model's SFT config; its first loss is taken before any update) vs cross-entropy computed
    with transformers on the same samples, counting only the response tokens (loss mask),
    token-weighted over the global batch (the sum of token losses over its loss tokens:
    docs/training.md, issue 26)."""
    from transformers import AutoModelForCausalLM

    from toolkit.train.data import DataSettings, GlobalBatchSampler, prepare_data

    cfg = config(Case("sft", steps=1), assets, Path(workdir) / "sft", mode="sft")
    data = prepare_data(DataSettings.from_config(cfg), cfg.tokenizer_path, cfg.data_cache_dir)
    sampler = GlobalBatchSampler(len(data.train), GLOBAL, MICRO, 1, 0, cfg.train.seed)
    hf = AutoModelForCausalLM.from_pretrained(assets["dense"], dtype=torch.float32,
                                              attn_implementation="eager")
    loss_sum, kept, total = 0.0, 0, 0
    with torch.no_grad():
        for idx in sampler.micro_batches(0):
            b = data.train.batch(idx)
            logits = hf(b["tokens"]).logits
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b["labels"],
                                                   reduction="none")
            mask = b["loss_mask"]
            loss_sum += float((ce.double() * mask).sum())
            kept, total = kept + int(mask.sum()), total + mask.numel()
    return {"trainer": first_loss, "by_hand": loss_sum / kept,
            "kept_tokens": kept, "all_tokens": total}
