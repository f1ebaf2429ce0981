"""The trainer's YAML schema: one dataclass per section, every allowed value stated once
(choices and minimums through ``typed.opt``). A new section is a dataclass here, its field in
``TrainConfig``, and, when its keys depend on each other or on other sections, a check in
``checks``.

Key names are fixed by the project's CLI contract (scripts override them):
``output_dir``; ``parallel.tp/pp/vpp/cp/ep/etp/sequence_parallel``; ``deepspeed.zero_stage/
offload/config/hpz_partition_size/quantized_weights/quantized_gradients``; ``train.steps/epochs/
micro_batch/global_batch/seq_len/seed/precision/recompute/eval_interval``; ``optim.*``;
``checkpoint.*``; ``export.hf_dir``; ``logging.*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.parallel.layout import ParallelLayout
from toolkit.rules import RECOMPUTE
from toolkit.train.config.typed import as_dict, opt
from toolkit.train.data import MODES, SFT_FORMATS
from toolkit.train.objectives.dpo.spec import LOSSES as DPO_LOSSES
from toolkit.train.objectives.dpo.spec import REF_FREE
from toolkit.train.objectives.grpo.spec import IS_MODES


@dataclass
class ModelSection:
    """``path``: HF folder or hub id to fine-tune. ``config``: an HF config (config.json, a folder
    holding one, or a preset name) to pretrain from scratch. ``tokenizer`` defaults to ``path``."""

    path: str | None = None
    config: str | None = None
    tokenizer: str | None = None


@dataclass
class ParallelSection:
    tp: int = opt(1, minimum=1)
    pp: int = opt(1, minimum=1)
    vpp: int | None = opt(None, minimum=1)
    cp: int = opt(1, minimum=1)
    ep: int = opt(1, minimum=1)
    etp: int | None = opt(None, minimum=1)
    sequence_parallel: bool = False

    def layout(self) -> ParallelLayout:
        """The unresolved layout (dp inferred later by ``ParallelLayout.resolve``)."""
        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep,
                              etp=self.etp, sequence_parallel=self.sequence_parallel)


@dataclass
class DeepSpeedSection:
    """``config: auto`` builds the DeepSpeed JSON with the project's generator from
    ``zero_stage``/``offload`` (``auto`` there lets the generator choose from its memory model);
    a path uses the user's JSON (linted by the generator's check first).
    ``offload``: cpu/nvme moves optimizer states (ZeRO >= 1); at ZeRO-3 the generator also moves
    the parameters there only when the optimizer alone does not make the run fit.
    ZeRO++ (ZeRO-3, tp = pp = 1; written into the generated JSON): ``hpz_partition_size`` keeps
    a secondary copy of the parameters sharded over that many ranks (the GPUs per node) so most
    gathers stay inside the node (exact); ``quantized_weights`` (int8 gathers, qwZ) and
    ``quantized_gradients`` (int4 reduction, qgZ) are lossy and need CUDA kernels."""

    zero_stage: int | str = opt(1, choices=(0, 1, 2, 3, "auto"))
    offload: str = opt("none", choices=("none", "cpu", "nvme", "auto"))
    nvme_path: str | None = None
    hpz_partition_size: int = opt(1, minimum=1)
    quantized_weights: bool = False
    quantized_gradients: bool = False
    config: str = "auto"


@dataclass
class DataSection:
    """Sources are local json/jsonl/parquet/text files (globs and folders too) or hub dataset
    names. ``pretrain`` packs documents into seq_len+1 blocks; ``sft`` trains on responses only;
    ``dpo`` reads preference pairs (prompt, chosen, rejected; see the ``dpo`` section);
    ``reward`` the same pairs for a reward model (``reward``); ``kto`` unpaired rows (prompt,
    completion, label; ``kto``); ``distill`` SFT's rows, scored by a teacher (``distill``).
    ``format`` (sft only): ``auto`` detects each row's format from its keys (messages,
    prompt_response, alpaca, sharegpt; see docs/training.md), a name forces it for every row.
    ``template``: ``chat`` renders rows through the tokenizer's chat template, ``plain`` joins
    prompt + response + EOS, ``auto`` uses the chat template when the tokenizer has one.
    ``pack`` (sft only): several examples per sequence instead of one padded example, bin-packed
    and kept apart (attention and position ids restart at every example).
    ``reset_at_eod`` (pretrain only): attention and position ids restart after every EOS token,
    so a document never attends to the one before it (Megatron-LM's ``--reset-attention-mask
    --reset-position-ids``)."""

    mode: str = opt("sft", choices=tuple(MODES))
    format: str = opt("auto", choices=("auto", *SFT_FORMATS))
    sources: list[str] = opt(factory=list)
    validation_sources: list[str] = opt(factory=list)
    validation_split: float = opt(0.05, minimum=0.0)
    weights: list[float] = opt(factory=list)
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    conversations_field: str = "conversations"
    template: str = opt("auto", choices=("auto", "chat", "plain"))
    pack: bool = False
    reset_at_eod: bool = False
    shuffle: bool = True
    cache_dir: str | None = None
    num_proc: int = opt(1, minimum=1)


@dataclass
class DpoSection:
    """Preference tuning (``data.mode: dpo``), TRL's ``DPOTrainer`` settings by TRL's names.
    ``beta``: how far the policy may move from the reference (IPO: its tau). ``loss``: TRL's
    ``loss_type`` (sigmoid = the DPO paper; see docs/training.md). ``label_smoothing``: the
    robust and exo_pair losses only. ``reference``: the reference model's HF folder or hub id,
    same architecture and vocabulary as the policy; unset: the starting model (``model.path``),
    frozen. ``precompute_reference``: the reference log-probabilities of every pair computed once
    before training (cached beside the data), so no reference model is held while training.
    Reference-free losses on the same pairs: ``orpo`` (TRL's ORPOTrainer; ``beta`` is its
    lambda) and ``simpo`` (TRL's CPOTrainer ``loss_type="simpo"``: ``simpo_gamma``, the target
    margin, and ``cpo_alpha``, the weight of its NLL term; 0 is the SimPO paper)."""

    beta: float = opt(0.1, minimum=0.0)
    loss: str = opt("sigmoid", choices=(*DPO_LOSSES, *REF_FREE))
    label_smoothing: float = opt(0.0, minimum=0.0)
    reference: str | None = None
    precompute_reference: bool = False
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0


@dataclass
class RewardSection:
    """A Bradley-Terry reward model (``data.mode: reward``), TRL's ``RewardConfig`` names.
    ``center_rewards_coefficient``: adds coefficient x mean((r_chosen + r_rejected)^2), which
    keeps the rewards centred on 0 (null: off)."""

    center_rewards_coefficient: float | None = opt(None, minimum=0.0)


@dataclass
class KtoSection:
    """KTO on unpaired feedback (``data.mode: kto``), TRL's ``KTOConfig`` names. ``beta``: how
    far the policy may move from the reference (the starting model, frozen; with LoRA the
    policy with its adapters off); ``desirable_weight`` / ``undesirable_weight``: the weights
    of the two kinds of rows' losses (to balance unequal counts)."""

    beta: float = opt(0.1, minimum=0.0)
    desirable_weight: float = opt(1.0, minimum=0.0)
    undesirable_weight: float = opt(1.0, minimum=0.0)


@dataclass
class DistillSection:
    """Knowledge distillation (``data.mode: distill``), TRL's ``GKDConfig`` names. ``teacher``:
    an HF folder or hub id, or an mdtk / Megatron checkpoint of any layout, sharing the
    student's tokenizer (frozen, at the student's layout; ``teacher_dtype``: its precision,
    auto = the run's). ``beta``: the generalized Jensen-Shannon divergence's interpolation (0: KL of
    the student from the teacher, forward KL; 1: reverse KL). ``lmbda``: the share of on-policy
    (student-generated) completions: 0, the dataset's completions (offline); the share of steps
    that sample the student's completions on the training ranks, up to ``max_new_tokens``.
    ``temperature``: GKD's sampling temperature for on-policy completions (the loss itself
    compares the distributions at temperature 1, as TRL's GKD does)."""

    teacher: str | None = None
    beta: float = opt(0.5, minimum=0.0)
    temperature: float = opt(0.9, minimum=0.0)
    lmbda: float = opt(0.0, minimum=0.0)
    max_new_tokens: int = opt(128, minimum=1)
    teacher_dtype: str = opt("auto", choices=("auto", "bf16", "fp16", "fp32"))


@dataclass
class GrpoSection:
    """Online RL from verifiable rewards (``data.mode: grpo``: prompt rows), TRL's
    ``GRPOConfig`` names and meanings. ``num_generations``: completions per prompt (a group;
    ``train.global_batch`` counts completions). ``loss_type``: TRL's formula and normalisation
    (grpo, dr_grpo, dapo, bnpo, cispo); ``importance_sampling_level: sequence`` is GSPO.
    ``beta``: the weight of the k3 KL to the reference (the starting model, frozen; with LoRA
    the policy with its adapters off), times the ratio with ``use_bias_correction_kl``.
    ``epsilon`` / ``epsilon_high``: the clip range (null:
    ``epsilon``; cispo clips the ratio at ``epsilon_high`` alone). ``num_iterations``: optimizer
    steps per generation batch. ``scale_rewards``: the advantage's divisor (group: the group's
    std, batch: the batch's, none). ``rewards``: ``{function: "module:name" | "mdtk:name",
    weight, args}`` with TRL's signature ``f(prompts, completions, completion_ids, **columns)``.
    ``rollouts``: a JSONL of recorded rollouts (prompt, completion_ids or completion, reward)
    trained on instead of generating. ``engine``: who samples: ``megatron`` (mdtk's engine on
    the live chunks) or ``vllm`` (a vLLM engine colocated on every rank, the live weights
    streamed in before each generation batch; ``vllm_gpu_memory_utilization``: its share of a
    GPU; ``vllm_tensor_parallel_size``: ranks per engine, each holding 1/T of it; TRL's
    names). ``vllm_importance_sampling_*``: TRL's correction of the sampler's mismatch (rollouts
    from vLLM, or recorded with their ``logprobs``): each token's loss times the ratio of the
    policy's probability to the sampler's, per token or per completion (``mode``), truncated to
    or masked outside [clip_min, clip_max]."""

    num_generations: int = opt(8, minimum=1)
    max_completion_length: int = opt(512, minimum=1)
    temperature: float = opt(1.0, minimum=0.0)
    top_p: float = opt(1.0, minimum=0.0)
    top_k: int = opt(0, minimum=0)
    loss_type: str = opt("dapo", choices=("grpo", "dr_grpo", "dapo", "bnpo", "cispo"))
    importance_sampling_level: str = opt("token", choices=("token", "sequence"))
    beta: float = opt(0.0, minimum=0.0)
    use_bias_correction_kl: bool = True
    epsilon: float = opt(0.2, minimum=0.0)
    epsilon_high: float | None = opt(None, minimum=0.0)
    num_iterations: int = opt(1, minimum=1)
    scale_rewards: str = opt("group", choices=("group", "batch", "none"))
    mask_truncated_completions: bool = False
    rewards: list[dict[str, Any]] = opt(factory=list)
    rollouts: str | None = None
    engine: str = opt("megatron", choices=("megatron", "vllm"))
    vllm_gpu_memory_utilization: float = opt(0.3, minimum=0.0)
    vllm_tensor_parallel_size: int = opt(1, minimum=1)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = opt("sequence_mask", choices=IS_MODES)
    vllm_importance_sampling_clip_max: float | None = opt(3.0, minimum=0.0)
    vllm_importance_sampling_clip_min: float | None = opt(None, minimum=0.0)


@dataclass
class OptimSection:
    """AdamW (DeepSpeed's CPU Adam when offloading). ``clip_grad: 0`` turns clipping off."""

    lr: float = opt(1e-4, minimum=0.0)
    min_lr: float = opt(0.0, minimum=0.0)
    warmup_steps: int = opt(0, minimum=0)
    decay: str = opt("cosine", choices=("cosine", "linear", "constant"))
    weight_decay: float = opt(0.0, minimum=0.0)
    clip_grad: float = opt(1.0, minimum=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = opt(1e-8, minimum=0.0)


@dataclass
class TrainSection:
    """Exactly one of ``steps`` / ``epochs``. ``global_batch`` defaults to micro_batch * dp
    (no gradient accumulation). ``eval_interval: 0`` evaluates only at the end;
    ``eval_batches`` caps the validation global batches per evaluation (None: all).
    ``fused_kernels``: ``auto`` (on CUDA: the fused SwiGLU; docs/training.md), ``off``, or a
    comma list of swiglu, cross_entropy (faster, more memory), linear_cross_entropy (the
    logits never materialised: less memory, slower; tp=1, SFT and pretraining)."""

    steps: int | None = opt(None, minimum=1)
    epochs: float | None = opt(None, minimum=0.0)
    micro_batch: int = opt(1, minimum=1)
    global_batch: int | None = opt(None, minimum=1)
    seq_len: int = opt(512, minimum=2)
    seed: int = opt(1234, minimum=0)
    precision: str = opt("bf16", choices=("bf16", "fp16", "fp32"))
    recompute: str = opt("none", choices=RECOMPUTE)
    eval_interval: int = opt(0, minimum=0)
    eval_batches: int | None = opt(None, minimum=1)
    fused_kernels: str = "auto"


@dataclass
class CheckpointSection:
    """``dir`` defaults to ``{output_dir}/checkpoints``; ``interval: 0`` saves only at the end;
    ``keep_last: 0`` keeps all, ``keep_every: N`` also keeps every checkpoint whose step is a
    multiple of N (0: none); ``resume``: auto (the newest intact checkpoint, else start fresh) |
    none | a checkpoint folder. ``async``: the steps go on while the checkpoint is written (a
    host copy of the state is taken first; ``latest`` moves once every file is written);
    ``verify``: what resume checks against each checkpoint's manifest (``checksums``: every
    file's size and xxh3-128; ``sizes``: sizes only); ``on_save_error``: ``stop`` the run with
    the error, or ``continue`` training without that checkpoint (a warning)."""

    dir: str | None = None
    interval: int = opt(0, minimum=0)
    keep_last: int = opt(2, minimum=0)
    keep_every: int = opt(0, minimum=0)
    resume: str = "auto"
    async_: bool = False
    verify: str = opt("checksums", choices=("checksums", "sizes"))
    on_save_error: str = opt("stop", choices=("stop", "continue"))


@dataclass
class PeftSection:
    """Parameter-efficient fine-tuning (docs/training.md, "LoRA and DoRA"). ``method``: none
    (full fine-tuning), lora or dora. ``target_modules``: HF projection names (q_proj, ...;
    null: every linear layer of the blocks). ``adapter``: an HF PEFT folder to continue from
    (its own r, alpha, targets and method apply). ``rslora``: scale by alpha/sqrt(r)."""

    method: str = opt("none", choices=("none", "lora", "dora"))
    r: int = opt(16, minimum=1)
    alpha: float = opt(32.0, minimum=0.0)
    dropout: float = opt(0.0, minimum=0.0)
    target_modules: list[str] | None = None
    rslora: bool = False
    adapter: str | None = None


@dataclass
class ExportSection:
    """``hf_dir``: the trained model as an HF folder (with peft: the base with the adapters
    merged in float32, written in the model's dtype). ``adapter_dir`` (peft only): the adapters
    as an HF PEFT folder. ``verify``: reload each with transformers / PEFT and compare its
    logits with the live model's."""

    hf_dir: str | None = None
    adapter_dir: str | None = None
    verify: bool = True


@dataclass
class EvalSection:
    """lm-evaluation-harness tasks on the live model during training (docs/generation.md), at
    every ``interval`` steps (0: only at the end) and at the end: ``tasks`` from lm-eval's
    registry or YAMLs under ``include_path`` (e.g. ``bundled:examples/eval``), at most ``limit``
    documents each; their metrics go to metrics.jsonl (``eval/TASK/METRIC``), TensorBoard/W&B
    and the progress line. ``samples``: a prompts file (``mdtk generate``'s format) whose
    greedy completions (``max_new_tokens``) are printed and appended to samples.jsonl."""

    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    interval: int = opt(0, minimum=0)
    limit: int | None = opt(None, minimum=1)
    num_fewshot: int | None = opt(None, minimum=0)
    samples: str | None = None
    max_new_tokens: int = opt(32, minimum=1)

    @property
    def active(self) -> bool:
        return bool(self.tasks or self.samples)


@dataclass
class LoggingSection:
    """``peak_tflops`` overrides the per-device peak used for MFU (the table in metrics.py)."""

    interval: int = opt(1, minimum=1)
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    peak_tflops: float | None = opt(None, minimum=0.0)


@dataclass
class RuntimeSection:
    """``heartbeat_timeout_s``: a rank that completes no step (or checkpoint save) for this long
    is ended, so a hung collective fails the group fast (0: off). Set it above the longest step
    plus checkpoint save of the run."""

    heartbeat_timeout_s: float = opt(1800.0, minimum=0.0)


@dataclass
class TrainConfig:
    output_dir: str | None = None
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    data: DataSection = field(default_factory=DataSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    reward: RewardSection = field(default_factory=RewardSection)
    kto: KtoSection = field(default_factory=KtoSection)
    distill: DistillSection = field(default_factory=DistillSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    peft: PeftSection = field(default_factory=PeftSection)
    export: ExportSection = field(default_factory=ExportSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(str(self.output_dir)) / "checkpoints")

    @property
    def data_cache_dir(self) -> Path:
        return Path(self.data.cache_dir or Path(str(self.output_dir)) / "data_cache")

    @property
    def tokenizer_path(self) -> str:
        return str(self.model.tokenizer or self.model.path)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-safe dict (tuples become lists); ``config_from_dict`` reads it back."""
        return as_dict(self)
