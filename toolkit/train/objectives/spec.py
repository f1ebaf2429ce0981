"""What the ``reward``, ``kto`` and ``distill`` sections may say (torch-free: read by the config
checks): each section against ``data.mode`` and itself, and the models they name (a reward
model's starting folder, a distillation teacher's vocabulary), checked before anything runs.
DPO's (and ORPO's, SimPO's) are ``dpo.spec``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.adapters.spec import ModelSpec, has_config
from toolkit.errors import ConfigError

#: the model head of a data mode other than the LM head (``Adapter.head``)
HEADS = {"reward": "score"}
#: the section each of these data modes reads
SECTIONS = {"reward": "reward", "kto": "kto", "distill": "distill"}
#: TRL's metric names of each objective (training; validation logs them with ``val_``)
REWARD_METRICS = ("accuracy", "margin", "mean_reward")
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected")


def check_sections(cfg: Any, defaults: dict[str, Any]) -> None:
    """A section set for another data mode is refused (it would be ignored)."""
    for mode, key in SECTIONS.items():
        section, default = getattr(cfg, key), defaults[key]
        changed = [k for k in vars(default) if getattr(section, k) != getattr(default, k)]
        if changed and cfg.data.mode != mode:
            raise ConfigError(f"{key}.{changed[0]} applies to data.mode={mode}; got data.mode="
                              f"{cfg.data.mode}: remove it or set data.mode={mode}.")


def check_reward(cfg: Any) -> None:
    if cfg.peft.method != "none":
        raise ConfigError(f"data.mode=reward with peft.method={cfg.peft.method}: a reward model "
                          "trains every weight here (its new score head with them); set "
                          "peft.method=none.")
    if cfg.model.config:
        raise ConfigError("data.mode=reward trains a reward model from a trained model: set "
                          "model.path (a causal LM, or an HF sequence-classification folder) "
                          "instead of model.config.")
    if has_config(cfg.model.path):
        config = ModelSpec.of(Path(cfg.model.path)).config
        labels, archs = config.get("num_labels"), config.get("architectures") or [""]
        if archs[0].endswith("ForSequenceClassification") and labels not in (None, 1):
            raise ConfigError(f"model.path={cfg.model.path!r} is a sequence classifier with "
                              f"num_labels={labels}: a reward model has one score "
                              "(num_labels=1); start from its causal LM instead.")


def check_kto(cfg: Any) -> None:
    k = cfg.kto
    if k.beta <= 0:
        raise ConfigError(f"kto.beta={k.beta} must be > 0 (TRL's default is 0.1).")
    if cfg.model.config:
        raise ConfigError("data.mode=kto tunes a trained model: set model.path (the policy and, "
                          "frozen, the reference) instead of model.config.")
    batch = cfg.train.global_batch or cfg.train.micro_batch
    if batch < 2 and cfg.train.global_batch is not None:
        raise ConfigError(f"data.mode=kto with train.global_batch={batch}: its KL term pairs a "
                          "prompt with another sample's completion of the same batch (TRL "
                          "requires a batch > 1); set train.global_batch >= 2.")
    if cfg.data.shuffle:
        raise ConfigError("data.mode=kto pairs each prompt with its neighbour's completion to "
                          "estimate its KL term, in a fixed-order batch (TRL requires "
                          "sequential sampling): set data.shuffle=false (shuffle the file "
                          "beforehand if it is ordered).")


def check_distill(cfg: Any) -> None:
    d = cfg.distill
    if not d.teacher:
        raise ConfigError("data.mode=distill needs distill.teacher: the teacher's HF folder or "
                          "hub id (it must share the student's tokenizer).")
    if not 0.0 <= d.beta <= 1.0:
        raise ConfigError(f"distill.beta={d.beta} must be in [0, 1] (0: forward KL, 1: reverse "
                          "KL, between: the generalized Jensen-Shannon divergence).")
    if not 0.0 <= d.lmbda <= 1.0:
        raise ConfigError(f"distill.lmbda={d.lmbda} must be in [0, 1] (the share of steps on "
                          "the student's own completions).")
    if d.lmbda > 0:
        check_on_policy(cfg)
    check_teacher(d.teacher, cfg.model.path or cfg.model.config, cfg.tokenizer_path,
                  cfg.parallel.layout())


def check_on_policy(cfg: Any) -> None:
    """What on-policy distillation (completions sampled on the training ranks) cannot run."""
    if cfg.data.pack:
        raise ConfigError("distill.lmbda > 0 with data.pack: a sampled completion replaces its "
                          "row's; set data.pack=false.")
    if cfg.parallel.ep > 1 or cfg.parallel.cp > 1:
        key = "ep" if cfg.parallel.ep > 1 else "cp"
        raise ConfigError(f"distill.lmbda > 0 with parallel.{key}="
                          f"{getattr(cfg.parallel, key)}: on-policy sampling runs at tp / pp / "
                          "dp layouts here; set distill.lmbda=0 or parallel." + key + "=1.")


def teacher_folder(teacher: str) -> str | None:
    """Where the teacher's config.json is: its HF folder, or the ``hf_config/`` of an mdtk or
    Megatron checkpoint (a converted one, a training run's step folder or checkpoint root);
    None for a hub id."""
    if has_config(teacher):
        return teacher
    root = Path(teacher)
    if not root.exists():
        if teacher.startswith((".", "/", "~")) or teacher.count("/") != 1:
            raise ConfigError(f"distill.teacher={teacher!r}: no HF folder or checkpoint there "
                              "(give the teacher's HF folder, hub id or mdtk checkpoint).")
        return None  # a hub id: its vocabulary is checked when it is loaded
    latest = root / "latest"
    step = root / latest.read_text().strip() if latest.is_file() else root
    for folder in (step / "hf_config", root / "hf_config"):
        if has_config(str(folder)):
            return str(folder)
    raise ConfigError(f"distill.teacher={teacher!r}: neither an HF folder (config.json) nor a "
                      "checkpoint with its hf_config/ (an mdtk convert or mdtk train output).")


def check_teacher(teacher: str, student: str | None, tokenizer: str, layout: Any = None) -> None:
    """The teacher exists and shares the student's vocabulary: its config's vocab_size and, when
    its folder holds a tokenizer, that tokenizer's tokens (compared when both are local); it
    runs at the student's ``layout`` (tp, pp x vpp, ep, cp), so that layout must fit it too."""
    folder = teacher_folder(teacher)
    if folder is None:
        return
    mine = ModelSpec.of(Path(student)) if student and has_config(student) else None
    theirs = ModelSpec.of(Path(folder))
    if mine is not None and mine.shape.vocab != theirs.shape.vocab:
        raise ConfigError(f"distill.teacher={teacher!r} has a vocabulary of "
                          f"{theirs.shape.vocab} tokens, the student {mine.shape.vocab}: teacher "
                          "and student must share the tokenizer (their distributions are "
                          "compared token by token).")
    if layout is not None:
        from toolkit.parallel.layout import LayoutError

        try:
            theirs.adapter().validate(layout)
        except LayoutError as e:
            raise ConfigError(f"distill.teacher={teacher!r} runs at the student's layout, which "
                              f"does not fit it: {e}") from None
    different = tokenizer_difference(folder, tokenizer)
    if different:
        raise ConfigError(f"distill.teacher={teacher!r}: its tokenizer is not the student's "
                          f"({different}): teacher and student must share the tokenizer.")


def tokenizer_difference(teacher: str, tokenizer: str) -> str | None:
    """How the tokenizer in the teacher's folder (if any) differs from the run's, or None."""
    folder = Path(teacher)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if not Path(tokenizer).is_dir():
        return None
    from toolkit.train.data import load_tokenizer

    a, b = load_tokenizer(str(folder)).get_vocab(), load_tokenizer(tokenizer).get_vocab()
    if a == b:
        return None
    moved = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    return (f"{len(a)} vs {len(b)} tokens" if len(a) != len(b) else
            f"token {moved[0]!r} is id {a[moved[0]]} there, {b[moved[0]]} here" if moved else
            "other tokens")


def train_shape_fields(cfg: Any) -> dict[str, Any]:
    """The memory model's fields of the run's objective (``memory.TrainShape``): DPO's pairs and
    reference (``dpo_fields``; none for the reference-free ORPO, SimPO), a reward model's pairs,
    KTO's reference, distillation's teacher, GRPO's reference (``grpo.beta != 0``; with LoRA
    the memory model counts none: the policy with its adapters off) and, when it generates
    (no ``grpo.rollouts``), the generation engine's KV cache."""
    from toolkit.memory import dpo_fields
    from toolkit.train.objectives.dpo.spec import REF_FREE

    mode = cfg.data.mode
    if mode == "dpo":
        return dpo_fields(True, cfg.dpo.precompute_reference or cfg.dpo.loss in REF_FREE)
    if mode == "reward":
        return {"pairs": True}
    if mode == "kto":
        return {"unpaired": True, "reference_model": True}
    if mode == "distill":
        return {"teacher": ModelSpec.named(teacher_folder(cfg.distill.teacher)
                                           or cfg.distill.teacher).shape}
    if mode == "grpo":
        return {"grpo": True, "reference_model": cfg.grpo.beta != 0,
                "rollout_cache": not cfg.grpo.rollouts and cfg.grpo.engine == "megatron"}
    return {}


def engine_reserve(cfg: Any, gpu_mem: int) -> int:
    """Device memory a colocated rollout engine keeps beside the trainer's (``grpo.engine:
    vllm``: ``memory.vllm_reserve``); the DeepSpeed sizing leaves it free."""
    from toolkit.memory import vllm_reserve

    if cfg.data.mode == "grpo" and cfg.grpo.engine == "vllm" and not cfg.grpo.rollouts:
        return vllm_reserve(cfg.grpo.vllm_gpu_memory_utilization, gpu_mem)
    return 0
