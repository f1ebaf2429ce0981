"""The step time of one plan, built from the terms of ``toolkit.planner.cost`` in named parts:
each pipeline stage's micro-batch (``stage_time``: compute, and its tp/cp/ep collectives), the
pipeline with its bubble, the pipeline sends, the data-parallel / ZeRO collectives and what hides
them, the optimizer step with its offload traffic, ZeRO's buffer copies. Seconds and bytes are
kept apart (one unit per dict), and every traffic kind names the link it travels over."""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.memory import ModelShape
from toolkit.memory.states import DTYPE_BYTES, RankParams
from toolkit.planner.cost import (
    EAGER_SCORE_PASSES,
    MDTK,
    Candidate,
    Efficiency,
    Framework,
    Link,
    Network,
    StepCost,
    Workload,
    cp_exchange_bytes,
    cpu_adam_seconds,
    model_flops,
    model_terms,
    offload_bytes,
    ring_time,
    stage_params,
    tp_collectives_per_layer,
    zero_traffic,
)
from toolkit.planner.flops import attention_layers, delta_forward_flops
from toolkit.planner.zeropp import Zero3Group, ZeroPP, kernel_bytes, ring_split, zero3_transfers

# -- the step, one named part each ---------------------------------------------------------------

@dataclass(frozen=True)
class StepInputs:
    """What every part of one step's cost reads: the inputs and what follows from them once."""

    model: ModelShape
    work: Workload
    c: Candidate
    net: Network
    framework: Framework
    eff: Efficiency
    e: int  # bytes per parameter / activation element
    e_grad: int  # bytes per gradient element on the wire
    m: int  # micro-batches per step
    peak: float  # the device's FLOP/s in the workload's dtype
    tokens: float  # tokens of one micro-batch on one rank
    sp_div: int  # sequence-parallel split of the elementwise work

    @classmethod
    def of(cls, model: ModelShape, work: Workload, c: Candidate, net: Network,
           framework: Framework, eff: Efficiency) -> StepInputs:
        e = DTYPE_BYTES[work.dtype]
        m = work.global_batch // (c.micro_batch * c.dp)
        if m < 1 or m * c.micro_batch * c.dp != work.global_batch:
            raise ValueError(f"global batch {work.global_batch} is not micro_batch x dp x "
                             f"accumulation for {c.describe()}")
        return cls(model, work, c, net, framework, eff, e, framework.grad_reduce_bytes or e, m,
                   net.device.peak_flops(work.dtype),
                   work.seq_len * c.micro_batch * work.rows / c.cp,
                   c.tp if c.sequence_parallel else 1)


@dataclass(frozen=True)
class StageTime:
    """One micro-batch's forward + backward on one pipeline stage."""

    compute: float  # seconds of matmuls, attention and elementwise kernels
    backward: float  # of which the backward's (recomputation runs inside it)
    comm: dict[str, float]  # exposed seconds of the stage's collectives, by kind (tp, cp, ep)
    traffic: dict[str, float]  # bytes one rank sends in them, by kind
    links: dict[str, str]  # the Link.name of each kind

    @property
    def seconds(self) -> float:
        return self.compute + sum(self.comm.values())


def stage_time(st: StepInputs, layers: tuple[int, ...], is_last: bool) -> StageTime:
    """One micro-batch through ``layers`` (with the LM head when ``is_last``)."""
    passes = 4 if st.c.recompute == "full" else 3  # forward, backward (2x), recomputed forward
    compute = stage_compute(st, layers, is_last, passes)
    comm, traffic, links = stage_comms(st, layers, passes)
    return StageTime(compute, compute * (passes - 1) / passes, comm, traffic, links)


def stage_compute(st: StepInputs, layers: tuple[int, ...], is_last: bool, passes: int) -> float:
    """Seconds of matmuls and attention at the device's peak times their efficiencies, and of
    the elementwise traffic at the memory bandwidth."""
    model, c, eff, tokens = st.model, st.c, st.eff, st.tokens
    s, e = st.work.seq_len, st.e
    matmul, elem, head_flops = model_terms(model)
    fwd_mm = sum(2.0 * matmul[i] for i in layers) * tokens / c.tp
    softmax = attention_layers(model, layers)
    fwd_att = (4.0 * model.q_dim * s * softmax + delta_forward_flops(model)
               * (len(layers) - softmax)) * tokens / c.tp
    frozen = 1 if model.lora and passes > 1 else 0  # LoRA: frozen weights, no weight gradient
    mm, att = (passes - frozen) * fwd_mm, passes * fwd_att
    if c.recompute == "selective":
        att += fwd_att
    elem_bytes = sum(w / st.sp_div + inner / c.tp for w, inner in (elem[i] for i in layers))
    elem_bytes *= e * tokens * passes
    if not st.work.flash:  # eager attention: the s x s scores go through memory
        score_passes = passes + (1 if c.recompute == "selective" else 0)
        elem_bytes += (EAGER_SCORE_PASSES * e * model.heads / c.tp * s * tokens
                       * softmax * score_passes)
    if is_last:  # the head is not recomputed: forward and backward (or forward only)
        mm += (min(passes, 3) - frozen) * head_flops * tokens / c.tp
        elem_bytes += eff.logits_bytes * tokens * model.padded_vocab(c.tp) / c.tp
    return (mm / (st.peak * eff.matmul) + att / (st.peak * eff.attention)
            + elem_bytes / (st.net.device.hbm * eff.memory))


def stage_comms(st: StepInputs, layers: tuple[int, ...], passes: int, forward_only: bool = False,
                ) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """The stage's tensor-, context- and expert-parallel collectives: (exposed seconds, bytes,
    link), each by kind; ``forward_only``: the forward's alone (a frozen model's pass)."""
    model, c, eff, tokens, e = st.model, st.c, st.eff, st.tokens, st.e
    h, s = model.hidden, st.work.seq_len
    comm: dict[str, float] = {}
    traffic: dict[str, float] = {}
    links: dict[str, str] = {}
    if c.tp > 1:
        link = links["tp"] = st.net.link(c.tp, 1, eff)
        calls = (2 if forward_only else tp_collectives_per_layer(c.recompute, c.sequence_parallel)
                 ) * len(layers)
        payload = tokens * h * e
        per = ring_time(payload, c.tp, "allreduce", link.bandwidth, link.latency)
        if c.sequence_parallel:
            per += link.latency  # an all-gather and a reduce-scatter: two launches
        comm["tp"] = calls * per * (1 - st.framework.tp_overlap)
        traffic["tp"] = calls * payload
    if c.cp > 1:
        link = links["cp"] = st.net.link(c.cp, c.tp, eff)
        nbytes = cp_exchange_bytes(model, tokens, c.cp, c.tp, e, c.recompute)
        if forward_only:
            nbytes = cp_exchange_bytes(model, tokens, c.cp, c.tp, e, "none") / 3
        per_layer = nbytes / link.bandwidth + passes * (c.cp - 1) * link.latency
        attention = passes * 4.0 * model.q_dim * s * tokens / c.tp / (st.peak * eff.attention)
        comm["cp"] = len(layers) * max(0.0, per_layer - attention)
        traffic["cp"] = len(layers) * nbytes
    moe = [i for i in layers if model.is_moe_layer(i)]
    if c.ep > 1 and moe:
        link = links["ep"] = st.net.link(c.ep, c.tp * c.cp, eff)
        calls = (2 if forward_only else 6 if c.recompute == "full" else 4) * len(moe)
        payload = tokens * model.top_k * h * e
        comm["ep"] = calls * ring_time(payload, c.ep, "alltoall", link.bandwidth, link.latency)
        traffic["ep"] = calls * payload * (c.ep - 1) / c.ep
    return comm, traffic, {k: v.name for k, v in links.items()}


def reference_forward(st: StepInputs, first: RankParams, last: RankParams) -> float:
    """DPO's reference model, when one is held: a forward-only pass of the step's micro-batches
    through its own pipeline (the slowest stage's pace, the fill and drain, the activation
    sends), with its ZeRO-3 parameter gathers where they are not hidden. 0 without one."""
    if not st.work.reference_model:
        return 0.0
    c = st.c

    def forward(layers: tuple[int, ...], is_last: bool) -> float:
        comm = stage_comms(st, layers, 1, forward_only=True)[0]
        return stage_compute(st, layers, is_last, 1) + sum(comm.values())

    t_last = forward(last.layers, True)
    t_first = t_last if c.pp == 1 else forward(first.layers, False)
    mean = (t_first * (c.pp - 1) + t_last) / c.pp
    seconds = st.m * max(t_first, t_last) + (c.pp - 1) / c.vpp * mean
    sends, _, _ = pipeline_sends(st)
    seconds += sends / 2  # forward activations only
    if c.zero == 3:
        held = max(r.total + r.frozen for r in (first, last))  # LoRA: the base, adapters off
        link = st.net.link(c.dp * c.cp, c.tp, st.eff)
        gather = ring_time(held * st.e, first.dense_dp, "allgather", link.bandwidth,
                           link.latency)
        seconds += max(0.0, st.m * gather - st.m * mean)
    return seconds


@dataclass(frozen=True)
class Pipeline:
    """The micro-batches through the stages: the slowest stage sets the pace, the mean one
    fills the bubble (1F1B, interleaved: divided by vpp)."""

    slow: StageTime
    t_mean: float  # seconds of a micro-batch on the mean stage
    bwd_mean: float  # of which backward
    seconds: float  # m x the slowest stage + the bubble
    bubble: float


def pipeline(st: StepInputs, first: RankParams, last: RankParams) -> Pipeline:
    c, m = st.c, st.m
    t_last = stage_time(st, last.layers, True)
    t_first = t_last if c.pp == 1 else stage_time(st, first.layers, False)
    slow = t_last if t_last.seconds >= t_first.seconds else t_first
    t_mean = (t_first.seconds * (c.pp - 1) + t_last.seconds) / c.pp
    bwd_mean = (t_first.backward * (c.pp - 1) + t_last.backward) / c.pp
    bubble = (c.pp - 1) / c.vpp * t_mean
    return Pipeline(slow, t_mean, bwd_mean, m * max(t_first.seconds, t_last.seconds) + bubble,
                    bubble)


def pipeline_sends(st: StepInputs) -> tuple[float, float, Link | None]:
    """Activations forward and their gradients backward, once per chunk boundary per
    micro-batch: (seconds, bytes one rank sends, link); none without pipelining."""
    c = st.c
    if c.pp <= 1:
        return 0.0, 0.0, None
    link = st.net.link(2, c.tp * c.cp * c.dp, st.eff)
    payload = st.tokens * st.model.hidden * st.e / st.sp_div
    seconds = st.m * 2 * c.vpp * ring_time(payload, 2, "p2p", link.bandwidth, link.latency)
    return seconds, st.m * 2 * c.vpp * payload, link


@dataclass
class Overlap:
    """Seconds of data-parallel and offload traffic by what they can hide behind: the backward
    passes (gradients reduced or sent down per micro-batch), any compute (ZeRO-3 gathers,
    prefetched parameter fetches), or nothing but one pass (after the step)."""

    backward: float = 0.0
    anywhere: float = 0.0
    after_step: float = 0.0


@dataclass
class DataParallel:
    """The data-parallel collectives of one step: seconds by overlap, and by kind the payload
    bytes (volume), what one rank sends over the GPU link and across nodes, and the link."""

    overlap: Overlap = field(default_factory=Overlap)
    volumes: dict[str, float] = field(default_factory=dict)
    intra: dict[str, float] = field(default_factory=dict)
    inter: dict[str, float] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)

    def add(self, kind: str, link: str, volume: float, intra: float, inter: float) -> None:
        if not volume and kind not in self.volumes:
            return  # an empty group (no experts): no traffic kind
        for d, v in ((self.volumes, volume), (self.intra, intra), (self.inter, inter)):
            d[kind] = d.get(kind, 0.0) + v
        self.links[kind] = link


def data_parallel(st: StepInputs, params: RankParams, pipe: Pipeline) -> DataParallel:
    """Data parallel / ZeRO over dp x cp (dense) and the expert-data-parallel group (experts).
    Exposure: gradients reduced at every micro-batch hide behind all backward passes, a
    once-per-step reduction only behind the last one; ZeRO-3 gathers (prefetched) hide behind
    any compute; the ZeRO-1/2 parameter all-gather follows the step (Megatron: overlapped with
    the next forward). ZeRO-3's dense collectives, with the plan's ZeRO++ options, are
    ``toolkit.planner.zeropp``'s."""
    c, m, fw = st.c, st.m, st.framework
    link = st.net.link(c.dp * c.cp, c.tp, st.eff)
    out = DataParallel()
    fwd_mean = pipe.t_mean - pipe.bwd_mean
    groups = [(params.dense_dp, params.dense), (params.expert_dp, params.expert)]
    if c.zero == 3:
        group = Zero3Group(st.net, st.eff, params.dense_dp, c.tp, st.model.hidden)
        zpp = ZeroPP(c.hpz, c.qwz, c.qgz)
        for t in zero3_transfers(group, params.dense, m, st.e, st.e_grad, zpp):
            out.add(t.kind, t.link, t.payload, t.intra, t.inter)
            if t.hides == "anywhere":
                out.overlap.anywhere += t.seconds
            elif t.calls > 1:
                out.overlap.backward += t.seconds
            else:  # one reduction: only the last backward hides it
                out.overlap.after_step += max(0.0, t.seconds - pipe.bwd_mean)
        groups = groups[1:]
    per_node = min(c.dp * c.cp, max(1, st.net.gpus_per_node // c.tp))
    for n, count in groups:
        traffic = zero_traffic(c.zero, count, n, m, st.e, st.e_grad, fw.grad_reduce_per_micro)
        for kind, nbytes in traffic.items():
            calls = 1
            if kind == "reducescatter" and (fw.grad_reduce_per_micro or c.zero == 3):
                calls = m
            elif kind == "allgather" and c.zero == 3:
                calls = 2 * m
            factor = (2.0 if kind == "allreduce" else 1.0) * (n - 1) / n
            out.add(f"dp_{kind}", link.name, nbytes,
                    *ring_split(factor * nbytes, n, min(n, per_node)))
            t = calls * ring_time(nbytes / calls, n, kind, link.bandwidth, link.latency)
            if kind == "allgather":
                if c.zero == 3:
                    out.overlap.anywhere += t
                else:
                    out.overlap.after_step += (max(0.0, t - fwd_mean) if fw.param_gather_overlap
                                               else t)
            elif kind == "reducescatter" and calls > 1:
                out.overlap.backward += t
            elif kind == "reducescatter" or fw.zero0_overlap:
                out.overlap.after_step += max(0.0, t - pipe.bwd_mean)
            else:
                out.overlap.after_step += t
    return out


@dataclass(frozen=True)
class OptimizerStep:
    """The optimizer step and the offload traffic around it."""

    seconds: float  # the step: GPU Adam (memory-bound), or DeepSpeed's CPU Adam
    offload: float  # exposed seconds of the parameters coming back up
    hidden_in_backward: float  # seconds of gradients going down, behind the backward passes
    hidden_anywhere: float  # seconds of ZeRO-3 parameter fetches, behind any compute
    to_host: float  # bytes
    to_device: float  # bytes


def optimizer_step(st: StepInputs, params: RankParams) -> OptimizerStep:
    c, dev, eff = st.c, st.net.device, st.eff
    shard = params.dense / params.dense_dp + params.expert / params.expert_dp
    stepped = shard if c.zero >= 1 else params.total
    down, up = offload_bytes(c.zero, c.offload, shard, st.m, st.e, st.e_grad)
    if c.offload == "none":
        return OptimizerStep(stepped * eff.optimizer_bytes / (dev.hbm * eff.memory), 0.0, 0.0,
                             0.0, down, up)
    pcie = dev.pcie * eff.pcie
    fetch = 2 * st.m * shard * st.e if c.offload == "all" else 0.0
    return OptimizerStep(cpu_adam_seconds(stepped, dev, st.net.gpus_per_node, eff),
                         (up - fetch) / pcie, down / pcie, fetch / pcie, down, up)


def zero_buffers(st: StepInputs, params: RankParams) -> float:
    """ZeRO's memory-bound copies, every micro-batch: ZeRO-3 writes each gathered parameter
    twice (forward, backward; 16-bit); gradients reduced per micro-batch are first copied into
    the framework's reduce buffers. ZeRO++'s quantization kernels add theirs (per step)."""
    c, fw = st.c, st.framework
    copies = 4.0 * params.total if c.zero == 3 else 0.0
    if c.zero >= 1 and (fw.grad_reduce_per_micro or c.zero == 3):
        copies += fw.grad_copy_bytes * params.total
    quantized = 0.0
    if c.qwz or c.qgz:
        group = Zero3Group(st.net, st.eff, params.dense_dp, c.tp, st.model.hidden)
        zpp = ZeroPP(c.hpz, c.qwz, c.qgz and group.nodes > 1)
        quantized = kernel_bytes(params.dense, st.m, st.work.dtype, st.e, zpp, group.n,
                                 group.per_node)
    return (st.m * copies + quantized) / (st.net.device.hbm * st.eff.memory)


def exposed_dp(st: StepInputs, pipe: Pipeline, overlap: Overlap) -> float:
    """What of the data-parallel and offload traffic the step's compute does not hide."""
    window_bwd = st.m * pipe.bwd_mean
    exposed_bwd = max(0.0, overlap.backward - window_bwd)
    window_all = max(0.0, st.m * pipe.t_mean - min(overlap.backward, window_bwd))
    exposed_all = max(0.0, overlap.anywhere - window_all)
    return exposed_bwd + exposed_all + overlap.after_step


def step_cost(model: ModelShape, work: Workload, c: Candidate, net: Network,
              framework: Framework = MDTK, eff: Efficiency | None = None) -> StepCost:
    """Estimated seconds per optimizer step of ``c`` and the throughput that follows."""
    st = StepInputs.of(model, work, c, net, framework, eff or Efficiency())
    m = st.m
    first, last = stage_params(model, c.tp, c.pp, c.vpp, c.cp, c.ep, c.dp)
    pipe = pipeline(st, first, last)
    volumes = {k: m * v for k, v in pipe.slow.traffic.items()}
    links = dict(pipe.slow.links)
    pp_send, pp_bytes, pp_link = pipeline_sends(st)
    if pp_link is not None:
        volumes["pp"], links["pp"] = pp_bytes, pp_link.name
    params = max(first, last, key=lambda r: r.total)
    dp = data_parallel(st, params, pipe)
    overlap = dp.overlap
    volumes.update(dp.volumes)
    links.update(dp.links)
    opt = optimizer_step(st, params)
    volumes["offload_to_host"], volumes["offload_to_device"] = opt.to_host, opt.to_device
    if c.offload != "none":
        links["offload_to_host"] = links["offload_to_device"] = "pcie"
        overlap.backward += opt.hidden_in_backward
        overlap.anywhere += opt.hidden_anywhere
    dp_comm = exposed_dp(st, pipe, overlap)
    buffers = zero_buffers(st, params)
    reference = reference_forward(st, first, last)
    step = pipe.seconds + pp_send + dp_comm + buffers + opt.seconds + opt.offload + reference
    per_gpu = work.global_batch * work.rows * work.seq_len / step / c.world_size
    slow = pipe.slow
    return StepCost(
        compute=m * slow.compute, tp_comm=m * slow.comm.get("tp", 0.0),
        cp_comm=m * slow.comm.get("cp", 0.0), ep_comm=m * slow.comm.get("ep", 0.0),
        pp_bubble=pipe.bubble, pp_send=pp_send, dp_comm=dp_comm, buffers=buffers,
        optimizer=opt.seconds, offload=opt.offload, step=step, num_microbatches=m,
        reference=reference, tokens_per_s_per_gpu=per_gpu,
        mfu=model_flops(model, work.seq_len) * per_gpu / st.peak,
        volumes=volumes, links=links, sent_intra=dp.intra, sent_inter=dp.inter)
