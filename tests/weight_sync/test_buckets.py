import torch

from slimish.weight_sync.buckets import FlatBuffers, plan_buckets


def test_buckets_respect_size_and_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100])]
    buckets = list(plan_buckets(tensors, bucket_bytes=100))
    assert [b.names for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert all(b.nbytes <= 100 or len(b.names) == 1 for b in buckets)
    assert [n for b in buckets for n in b.names] == [n for n, _ in tensors]


def test_flattened_layout_matches_sglang():
    """SGLang's FlattenedTensorBucket: each tensor's bytes, in order, as one uint8 tensor."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.float32)), ("c", torch.randn(2))]
    (bucket,) = plan_buckets(named, bucket_bytes=1 << 20)
    flat = FlatBuffers().flatten(bucket)
    receiver = FlattenedTensorBucket.empty([n for n, _ in named], ["float32"] * 3, [list(t.shape) for _, t in named],
                                           "cpu")
    receiver.get_flattened_tensor().copy_(flat)
    for (name, tensor), (rname, rtensor) in zip(named, receiver.reconstruct_tensors()):
        assert name == rname and torch.equal(tensor, rtensor)


def test_flat_buffers_take_turns_and_grow():
    """Bucket k+2 reuses bucket k's buffer (never k+1's, which the engines may still be reading); a bucket larger
    than the buffer gets a larger one."""
    buffers = FlatBuffers()
    small, other, large = ([(n, torch.full((k,), float(k)))] for n, k in (("s", 4), ("o", 4), ("l", 8)))
    flats = [buffers.flatten(next(plan_buckets(named, bucket_bytes=1 << 20)))
             for named in (small, other, small, large)]
    assert flats[0].data_ptr() == flats[2].data_ptr() != flats[1].data_ptr()
    assert torch.equal(flats[1].view(torch.float32), torch.full((4,), 4.0))  # untouched by bucket 2
    assert flats[3].numel() == 32 and torch.equal(flats[3].view(torch.float32), torch.full((8,), 8.0))
