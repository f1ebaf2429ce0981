"""DCP ``.metadata`` written and read through stand-ins (``dcp_pickle``): the bytes are the
pickle of torch's own classes, and reading never constructs a torch.distributed class."""

from __future__ import annotations

import io
import pickle

import pytest
import torch


def _both(save_id: str) -> tuple[object, object]:
    """The same metadata (two tensors in two chunks, bf16 and fp32, one bytes object) built
    from torch's classes and from the stand-ins, in mcore_dist_writer.write_metadata's way."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from toolkit.checkpoint.torchfree import dcp_pickle as d

    tensors = {"decoder.layers.mlp.linear_fc1.weight": (torch.bfloat16, (2, 6, 4)),
               "embedding.word_embeddings.weight": (torch.float32, (256, 4))}
    real_state, real_storage, state, storage = {}, {}, {}, {}
    for key, (dtype, size) in tensors.items():
        offs = [(0, 0, 0), (1, 0, 0)] if len(size) == 3 else [(0, 0), (128, 0)]
        sizes = [(1, *size[1:])] * 2 if len(size) == 3 else [(128, 4)] * 2
        real_chunks, chunks = [], []
        for i, (o, s) in enumerate(zip(offs, sizes, strict=True)):
            real_chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
            chunks.append(d.ChunkStorageMetadata.make(offsets=d.Size(o), sizes=d.Size(s)))
            file = f"__{i}_0.distcp"
            real_storage[MetadataIndex(key, o, i)] = _StorageInfo(file, 100 * i, 4321 + i)
            storage[d.MetadataIndex.make(fqn=key, index=i, offset=d.Size(o))] = \
                d.StorageInfo.make(relative_path=file, offset=100 * i, length=4321 + i)
        real_state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                                real_chunks)
        props = d.TensorProperties.make(dtype=d.dtype_ref(dtype), layout=d.STRIDED,
                                        requires_grad=False, memory_format=d.CONTIGUOUS,
                                        pin_memory=False)
        state[key] = d.TensorStorageMetadata.make(properties=props, size=d.Size(size),
                                                  chunks=chunks)
    fqn = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_2"
    real_state[fqn] = BytesStorageMetadata()
    real_storage[MetadataIndex(fqn)] = _StorageInfo("__extra_0.distcp", 0, 12)
    state[fqn] = d.BytesStorageMetadata.make()
    storage[d.MetadataIndex.make(fqn=fqn, index=None, offset=None)] = d.StorageInfo.make(
        relative_path="__extra_0.distcp", offset=0, length=12)
    real = Metadata(state_dict_metadata=real_state, storage_data=real_storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=save_id),
                    version=CURRENT_DCP_VERSION)
    ours = d.Metadata.make(state_dict_metadata=state, planner_data=None, storage_data=storage,
                           storage_meta=d.StorageMeta.make(checkpoint_id=None, save_id=save_id,
                                                           load_id=None, modules=[]),
                           version=d.DCP_VERSION)
    return real, ours


def _globals(data: bytes) -> list[tuple[str, str]]:
    """The globals a pickle names, in order (as the unpickler resolves them)."""
    seen: list[tuple[str, str]] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.append((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return seen


def test_dumps_is_the_pickle_of_torch_classes():
    """Loads (plain pickle, torch's classes) equal to the Metadata of torch's classes that
    write_metadata pickled before, naming the same globals (the bytes differ by one memo hit:
    torch's pickle spells the module name of ``torch.Size`` and of dtypes as two strings)."""
    from toolkit.checkpoint.torchfree import dcp_pickle

    real, ours = _both("0f1e2d3c")
    data, ref = dcp_pickle.dumps(ours), pickle.dumps(real)
    assert pickle.loads(data) == real
    assert _globals(data) == _globals(ref)
    assert abs(len(data) - len(ref)) <= 8


def test_reader_builds_stand_ins_only(tmp_path):
    """Reading gives the stand-ins (dtypes as ``dtypes.DType``, equal to torch's; sizes as
    tuples); any other global in the file is refused."""
    from toolkit.checkpoint import CheckpointError
    from toolkit.checkpoint.torchfree import dcp_pickle, dtypes
    from toolkit.checkpoint.torchfree.safe_load import load_dcp_metadata

    real, _ = _both("x")
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(real))
    md = load_dcp_metadata(path)
    assert isinstance(md, dcp_pickle.Metadata)
    tsm = md.state_dict_metadata["embedding.word_embeddings.weight"]
    assert isinstance(tsm, dcp_pickle.TensorStorageMetadata)
    assert tsm.properties.dtype is dtypes.FLOAT32 and tuple(tsm.size) == (256, 4)
    assert tsm.properties.dtype == torch.float32 and torch.float32 == tsm.properties.dtype
    assert [tuple(c.offsets) for c in tsm.chunks] == [(0, 0), (128, 0)]
    info = {(k.fqn, k.index): v for k, v in md.storage_data.items()}
    assert (info[("embedding.word_embeddings.weight", 1)].relative_path,
            info[("embedding.word_embeddings.weight", 1)].length) == ("__1_0.distcp", 4322)
    assert md.version == real.version

    class Evil:
        def __reduce__(self):
            return (print, ("boom",))

    real.planner_data = Evil()
    path.write_bytes(pickle.dumps(real))
    with pytest.raises(CheckpointError, match="builtins.print is not a DCP metadata class"):
        load_dcp_metadata(path)


def test_no_torch_distributed_import():
    """Reading and writing .metadata import no torch.distributed.checkpoint (the point)."""
    import subprocess
    import sys

    code = ("import sys, io, pickle; from toolkit.checkpoint.torchfree import dcp_pickle as d; "
            "m = d.Metadata.make(state_dict_metadata={}, planner_data=None, storage_data={}, "
            "storage_meta=None, version=d.DCP_VERSION); "
            "d.Reader(io.BytesIO(d.dumps(m))).load(); "
            "print('torch.distributed.checkpoint' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_load_plain_reads_run_arguments_and_hands_the_rest_to_torch_load(tmp_path):
    """``common.pt`` without tensors reads without torch (dtypes by name, equal to torch's,
    megatron classes inert); a tensor or a class outside the allowlist gives None, and then
    ``load_torch`` reads or refuses it as before (nothing from the file is executed)."""
    import argparse
    import os

    from toolkit.checkpoint import CheckpointError
    from toolkit.checkpoint.torchfree import dtypes
    from toolkit.checkpoint.torchfree.safe_load import load_plain, load_torch

    args = argparse.Namespace(params_dtype=torch.bfloat16, tensor_model_parallel_size=2,
                              rotary_base=500000, window_size=None, lr=1e-4)
    plain = {"args": args, "checkpoint_version": 3.0, "iteration": 7}
    torch.save(plain, tmp_path / "common.pt")
    got = load_plain(tmp_path / "common.pt")
    assert got["args"].params_dtype is dtypes.BFLOAT16
    assert vars(got["args"]) == vars(args) and got == plain  # DType == torch dtype
    assert got == load_torch(tmp_path / "common.pt")

    torch.save({**plain, "rng": torch.arange(3)}, tmp_path / "tensor.pt")
    assert load_plain(tmp_path / "tensor.pt") is None
    assert torch.equal(load_torch(tmp_path / "tensor.pt")["rng"], torch.arange(3))

    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    torch.save({"args": Evil()}, tmp_path / "evil.pt")
    assert load_plain(tmp_path / "evil.pt") is None
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        load_torch(tmp_path / "evil.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    assert load_plain(tmp_path / "junk.pt") is None
