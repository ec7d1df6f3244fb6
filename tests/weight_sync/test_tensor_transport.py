"""The `tensor` transport's own logic, without an engine (tests/e2e/test_weight_sync_engines.py runs it against real
SGLang engines): its bucket buffer is shareable by name and carries SGLang's flattened-bucket metadata, a reused
buffer stays readable by name after engines have read it, and an engine on another host is refused naming the
config key."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys

import pytest
import torch

from slimish.config.errors import ConfigError
from slimish.engines.client import EngineClient
from slimish.weight_sync.buckets import Bucket, FlatBuffers
from slimish.weight_sync.tensor import TensorTransport, flattened_metadata, serialize, share_by_name
from slimish.weight_sync.transport import TransportContext
from tests.kit.engines import StandInClient


def context(master_addr: str) -> TransportContext:
    return TransportContext(master_addr=master_addr, master_port=0, backend="gloo", group_name="g", engine_tp=1,
                            disk_dir="")


def test_an_engine_on_another_host_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"weight_sync.transport.*http://10.1.2.3:30000 is not: use 'broadcast'"):
        TensorTransport(context("127.0.0.1")).connect([EngineClient("http://10.1.2.3:30000")])


def test_the_bucket_buffer_is_shared_by_name_with_sglang_metadata():
    bucket = Bucket()
    bucket.add("a", torch.arange(6, dtype=torch.float32).reshape(2, 3))
    bucket.add("b", torch.tensor([1, 2], dtype=torch.bfloat16))
    flat, metadata = FlatBuffers(share=share_by_name).flatten(bucket), flattened_metadata(bucket)
    assert flat.is_shared() and flat.numel() == bucket.nbytes
    assert [(m.name, m.start_idx, m.end_idx) for m in metadata] == [("a", 0, 24), ("b", 24, 28)]
    for m, tensor in zip(metadata, bucket.tensors):
        assert torch.equal(flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape), tensor)
    payload = base64.b64decode(serialize({"flattened_tensor": flat, "metadata": metadata}))
    assert b"rebuild_storage_filename" in payload  # by name (file_system), not by file descriptor
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # left as it was
    assert pickle.loads(payload)["metadata"][1].name == "b"


def read_in_a_new_process(payload: str) -> list[float]:
    """What a receiving engine rank does with a payload: unpickle it (mapping the segment by name), read the first
    tensor, let go of it (dropping its mapping)."""
    code = ("import base64, gc, pickle, sys, torch\n"
            "obj = pickle.loads(base64.b64decode(sys.argv[1]))\n"
            "m = obj['metadata'][0]\n"
            "print(obj['flattened_tensor'][m.start_idx:m.end_idx].view(m.dtype).tolist())\n"
            "del obj, m\n"
            "gc.collect()\n")
    out = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_reused_buffer_stays_readable_by_name_after_two_engines_read_it():
    """Each receiving rank gets a pickle of its own: one pickle read by two engines would drop the sender's own
    reference to the shared segment, and the buffer's name would be gone when bucket 2 reuses bucket 0's."""
    engines = [StandInClient("http://127.0.0.1:1"), StandInClient("http://127.0.0.1:2")]
    transport = TensorTransport(context("127.0.0.1"))
    transport.connect(engines)
    try:
        for value in (1.0, 2.0, 3.0):
            bucket = Bucket()
            bucket.add("w", torch.full((4,), value))
            transport.push(bucket, version=None)
            transport.wait_loaded()
            for engine in engines:
                (payload,) = engine.payloads[-1]
                assert read_in_a_new_process(payload) == [value] * 4
    finally:
        transport.close()


def test_a_cpu_tensor_is_pickled_as_torch_pickles_it():
    """The device-UUID rewrite touches CUDA tensors only (SGLang's own patch, applied process-wide, would fail on a
    CPU tensor's shorter reduction)."""
    from torch.multiprocessing import reductions

    from slimish.weight_sync.tensor import _reduce_with_device_uuid

    tensor = torch.arange(4.0)
    assert _reduce_with_device_uuid(tensor)[0] is reductions.reduce_tensor(tensor)[0]


def test_the_device_argument_sglang_maps_is_torchs_storage_device():
    """A CUDA tensor's handle names its device at the argument SGLang's receiver maps from a UUID back to its own
    device index; that index is SGLang's constant, which must be torch's `storage_device` of `rebuild_cuda_tensor`
    (checked here without a GPU: the sender rewrites exactly what the receiver reads)."""
    import inspect

    from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX
    from torch.multiprocessing import reductions

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[_REDUCE_TENSOR_ARG_DEVICE_INDEX] == "storage_device"


def test_fresh_buffers_are_new_for_every_bucket():
    """The GPU's buffers: a new one per bucket, never one the engines may still be reading."""
    buffers, bucket = FlatBuffers(reuse=False), Bucket()
    bucket.add("a", torch.ones(4))
    first, second, third = (buffers.flatten(bucket) for _ in range(3))
    assert len({t.untyped_storage().data_ptr() for t in (first, second, third)}) == 3


def read_pairs_in_a_new_process(payloads: list[str]) -> list[dict]:
    """What the engine ranks of a sharded sync unpickle, one payload each: (engine parameter, tensor) pairs; their
    names, values and how many distinct shared segments they map. (One process reads them all: each rank
    unpickles its own payload once, as in an engine.)"""
    code = ("import base64, json, pickle, sys, torch\n"
            "out = []\n"
            "for payload in sys.argv[1:]:\n"
            "    pairs = pickle.loads(base64.b64decode(payload))\n"
            "    out.append({'values': {n: t.tolist() for n, t in pairs},\n"
            "                'segments': len({t.untyped_storage().data_ptr() for _, t in pairs})})\n"
            "print(json.dumps(out))\n")
    out = subprocess.run([sys.executable, "-c", code, *payloads], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_each_engine_rank_maps_only_its_own_shard_from_one_segment():
    """`push_shards`: entry r of every engine's payload is rank r's (engine parameter, tensor) pairs, all views of
    one shared segment (however many tensors, and of mixed dtypes), loaded with load_format="direct"."""
    from slimish.weight_sync.buckets import ShardedBucket

    engines = [StandInClient("http://127.0.0.1:1"), StandInClient("http://127.0.0.1:2")]
    transport = TensorTransport(TransportContext(master_addr="127.0.0.1", master_port=0, backend="gloo",
                                                 group_name="g", engine_tp=2, disk_dir=""))
    transport.connect(engines)
    try:
        ranks = [Bucket(), Bucket()]
        ranks[0].add("qkv_proj.weight", torch.arange(6, dtype=torch.float32).reshape(3, 2))
        ranks[0].add("norm.weight", torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))  # 6 bytes: next is aligned
        ranks[0].add("o_proj.weight", torch.full((2, 2), 7.0))
        ranks[1].add("qkv_proj.weight", torch.full((3, 2), -1.0))
        assert transport.push_shards(ShardedBucket(ranks), version="1") == sum(b.nbytes for b in ranks)
        read = read_pairs_in_a_new_process([p for engine in engines for p in engine.payloads[0]])
        for rank0, rank1 in (read[:2], read[2:]):
            assert rank0 == {"values": {"qkv_proj.weight": [[0, 1], [2, 3], [4, 5]], "norm.weight": [1, 2, 3],
                                        "o_proj.weight": [[7, 7], [7, 7]]}, "segments": 1}
            assert rank1 == {"values": {"qkv_proj.weight": [[-1, -1]] * 3}, "segments": 1}
    finally:
        transport.close()
