"""Helpers for the converter tests that must run outside the pytest process.

``verify_many`` runs ``toolkit.convert.verify``'s runners (the ones behind ``mdtk verify``) on
converted checkpoints: the HF references first, then every megatron checkpoint (megatron-core's
own ``dist_checkpointing.load`` for torch_dist, mdtk's reader for legacy files). test_convert
and test_fp8 run it (and ``run_cli``) in the session's one-rank pool, whose rank has mdtk's CPU
mode on (transformers' models are unchanged by it: test_cpu_compat).
"""

from __future__ import annotations

from pathlib import Path


def verify_many(pairs: list[tuple[str, str]], batch: int = 2, seq_len: int = 16) -> list[dict]:
    from toolkit.convert.verify import RUNNERS, checked_vocab, compare, fixed_tokens, parse_spec

    refs = {}
    for ref, _ in pairs:  # all transformers runs first
        if ref not in refs:
            tokens = fixed_tokens(checked_vocab("hf", Path(ref)), batch, seq_len)
            refs[ref] = (tokens, RUNNERS["hf"](Path(ref), tokens))
    out = []
    for ref, spec in pairs:
        kind, path = parse_spec(spec)
        tokens, run_a = refs[ref]
        c = compare(run_a, RUNNERS[kind](path, tokens))
        out.append({"ref": ref, "spec": spec, "kind": kind, "max_abs": c.max_abs,
                    "max_rel": c.max_rel, "layers": len(c.layers)})
    return out


def run_cli(args: list[str]) -> tuple[int, str]:
    """``mdtk ARGS`` (the typer app, as the console script runs it) in this process: its exit
    code and output, with the traceback of an unexpected exception."""
    import traceback

    from typer.testing import CliRunner

    from toolkit.cli import app

    result = CliRunner().invoke(app, args)
    error = result.exc_info and not isinstance(result.exception, SystemExit)
    return result.exit_code, result.output + ("".join(traceback.format_exception(
        *result.exc_info)) if error else "")


# -- DeepSpeed: a real trainer run whose ZeRO checkpoint the converter must read ---------------

def make_qwen2_moe(root: Path) -> str:
    """A tiny Qwen2-MoE for the trainer (routed experts + a gated shared expert), built like
    ``trainer_checks.make_assets``' models (in the test process, before mdtk's CPU mode)."""
    import torch
    import transformers as tf

    config = tf.Qwen2MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, num_experts=4,
                               num_experts_per_tok=2, intermediate_size=96,
                               moe_intermediate_size=48, shared_expert_intermediate_size=80,
                               norm_topk_prob=False, rms_norm_eps=1e-5,
                               max_position_embeddings=256, eos_token_id=0, pad_token_id=1,
                               bos_token_id=None)
    torch.manual_seed(40)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # as make_assets: weights that move visibly in a few steps
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(root / "qwen2_moe")
    return str(root / "qwen2_moe")


def train_for_conversion(assets: dict[str, str], workdir: str, cases: list) -> list[dict]:
    """Run the trainer for each case (saving a checkpoint at the last step and exporting HF
    from the live model), then return where the checkpoint and the export are."""
    from dist_checks import trainer_checks as tc
    from toolkit.train import trainer

    out = []
    for case in cases:
        run_dir = Path(workdir) / case.name
        cfg = tc.config(case, assets, run_dir)
        result = trainer.run(cfg)
        out.append({"case": case.name, "losses": result.losses,
                    "checkpoints": str(run_dir / "checkpoints"),
                    "export_dir": result.export_dir,
                    "export_max_abs_diff": result.export_max_abs_diff})
    return out
