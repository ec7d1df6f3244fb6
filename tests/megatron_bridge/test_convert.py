"""`slimish convert`: HF -> Megatron distributed checkpoint -> HF is bit-exact, and the distributed checkpoint
loads into Megatron-Core at TP2 (two gloo processes) with the same logits as HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimish.cli import main
from slimish.megatron_bridge.convert import hf_to_megatron, megatron_to_hf
from slimish.megatron_bridge.hf_io import INDEX
from tests.megatron_bridge.layouts import assert_logits_match_hf, run_layout
from tests.megatron_bridge.parity import assert_same_checkpoint

FAMILIES = ["qwen3", "qwen2", "llama"]


@pytest.fixture(scope="module")
def dist_ckpts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """family -> Megatron distributed checkpoint written by the CLI; llama's in many small row blocks, so loading and
    exporting are checked across chunk boundaries too."""
    root = tmp_path_factory.mktemp("dist")
    for family in ("qwen3", "qwen2"):
        assert main(["convert", "hf-to-megatron", "--hf", str(tiny_models[family]), "--out", str(root / family),
                     "--tp", "2", "--pp", "2"]) == 0
    hf_to_megatron(hf_dir=tiny_models["llama"], out_dir=root / "llama", chunk_bytes=3000, progress=False)
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family, tiny_models, dist_ckpts, tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", "--megatron", str(dist_ckpts[family]),
                 "--hf-config", str(tiny_models[family]), "--out", str(out)]) == 0
    assert_same_checkpoint(out, tiny_models[family])
    assert (out / "config.json").read_text() == (tiny_models[family] / "config.json").read_text()
    assert (out / "tokenizer.json").is_file() and not (out / INDEX).exists()


def test_sharded_output_has_an_index_and_loads_in_transformers(tiny_models, dist_ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    files = megatron_to_hf(megatron_dir=dist_ckpts["qwen3"], hf_config_dir=tiny_models["qwen3"], out_dir=tmp_path,
                           max_shard_bytes=100_000, progress=False)
    assert len(files) > 1
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert set(weight_map.values()) == {f.name for f in files}
    assert_same_checkpoint(tmp_path, tiny_models["qwen3"])
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def layout_run(request, tiny_models, dist_ckpts, tmp_path_factory):
    """One TP2 and one PP2 world load every converted checkpoint and save it again with Megatron-Core's own
    writer."""
    root = tmp_path_factory.mktemp(request.param)
    tp, pp = (2, 1) if request.param == "tp2" else (1, 2)
    results = run_layout(root / "results", tp=tp, pp=pp, save_dist=root / "saved",
                         models={f: f"{tiny_models[f]}:{dist_ckpts[f]}" for f in FAMILIES})
    return results, root / "saved"


@pytest.mark.parametrize("family", FAMILIES)
def test_dist_checkpoint_loads_at_tp2_and_pp2(family, tiny_models, layout_run):
    assert_logits_match_hf(layout_run[0][family], tiny_models[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_saved_by_megatron_converts_to_hf(family, tiny_models, layout_run, tmp_path):
    megatron_to_hf(megatron_dir=layout_run[1] / family, hf_config_dir=tiny_models[family], out_dir=tmp_path,
                   progress=False)
    assert_same_checkpoint(tmp_path, tiny_models[family])


def test_layout_that_does_not_split_is_an_error(tiny_models, tmp_path, capsys):
    code = main(["convert", "hf-to-megatron", "--hf", str(tiny_models["qwen3"]), "--out", str(tmp_path), "--tp", "3"])
    assert code == 2 and "num_attention_heads" in capsys.readouterr().err


def test_unsupported_config_field_is_named(tiny_models, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_models["qwen3"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert main(["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "out")]) == 2
    assert "rope_scaling" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prefetched_save_serves_any_request_order(tmp_path):
    """Chunks requested out of the planned order are still the right ones (produced on the spot), pooled buffers
    are reused only once given back, and the saved checkpoint reads back bit-exact."""
    from slimish.megatron_bridge import dist_ckpt_io

    pool = dist_ckpt_io.BufferPool(1 << 10)
    values = {(f"t{i}", (0,)): torch.arange(64, dtype=torch.int32) + 100 * i for i in range(5)}

    def producer(key):
        def produce():
            out = pool.take((64,), torch.int32)
            out.copy_(values[key])
            return out
        return produce

    prefetcher = dist_ckpt_io._Prefetcher({key: producer(key) for key in values}, pool)
    prefetcher.start(list(values))
    try:
        for key in list(values)[::-1] + list(values):
            assert torch.equal(prefetcher.get(key), values[key])
    finally:
        prefetcher.close()
    def row_chunk(row):
        produce = producer((f"t{row}", (0,)))
        return (row, 0), (1, 64), lambda: produce().unsqueeze(0)

    chunks = {f"w{i}": ((4, 64), torch.int32, [row_chunk(row) for row in range(4)]) for i in range(2)}
    dist_ckpt_io.save(tmp_path, tensors=chunks, objects={}, buffers=pool)
    ckpt = dist_ckpt_io.DistCheckpoint(tmp_path)
    for key in chunks:
        expected = torch.stack([values[(f"t{row}", (0,))] for row in range(4)])
        assert torch.equal(ckpt.read(key, offsets=(0, 0), sizes=(4, 64)), expected)


def test_parallel_writers_give_the_same_checkpoint(tiny_models, tmp_path):
    """Four writer threads (four files, chunks split by size) in small row blocks: the same checkpoint as one writer,
    bit-exact back to HF."""
    from slimish.megatron_bridge import dist_ckpt_io

    for workers in (1, 4):
        hf_to_megatron(hf_dir=tiny_models["llama"], out_dir=tmp_path / str(workers), chunk_bytes=3000,
                       workers=workers, progress=False)
    assert len(list((tmp_path / "4").glob("*.distcp"))) == 4
    one, four = dist_ckpt_io.DistCheckpoint(tmp_path / "1"), dist_ckpt_io.DistCheckpoint(tmp_path / "4")
    assert sorted(one.keys()) == sorted(four.keys())
    for key in one.keys():
        meta = one.meta(key)
        whole = dict(offsets=(0,) * meta.dim(), sizes=tuple(meta.shape))
        assert torch.equal(one.read(key, **whole), four.read(key, **whole)), key
    megatron_to_hf(megatron_dir=tmp_path / "4", hf_config_dir=tiny_models["llama"], out_dir=tmp_path / "hf",
                   progress=False)
    assert_same_checkpoint(tmp_path / "hf", tiny_models["llama"])


def test_each_writer_thread_holds_two_chunks_at_most():
    """`_PerThreadRelease`: a thread's previous chunk is released when it asks for its next, whatever the others do."""
    import threading

    from slimish.megatron_bridge import dist_ckpt_io

    keys = [(f"t{i}", (0,)) for i in range(12)]
    served = dist_ckpt_io._PerThreadRelease({key: (lambda: torch.ones(256)) for key in keys})
    held: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(3)

    def writer(index: int) -> None:
        mine = held.setdefault(index, [])
        for key in keys[index::3]:
            barrier.wait()  # the three threads interleave their requests
            mine.append(served.get(key))
            assert sum(t.untyped_storage().nbytes() > 0 for t in mine) == 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(len(v) for v in held.values()) == [4, 4, 4]


@pytest.mark.parametrize("reference", ["config", "transformers"])
def test_weights_that_do_not_fit_the_config_leave_no_checkpoint(reference, tiny_models, tmp_path, monkeypatch, capsys):
    """Weights of another shape than config.json's are refused in one line, and the output is not a checkpoint (no
    metadata.json, no data): checked first from config.json alone, or, with --transformers-shape-check, against
    transformers' model in a child Python during the conversion (as from 1 GiB on)."""
    from slimish.megatron_bridge import convert

    monkeypatch.setattr(convert, "BACKGROUND_SHAPE_CHECK_BYTES", 0)
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_models["llama"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    flags = ["--transformers-shape-check"] if reference == "transformers" else []
    assert main(["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "out"),
                 "--workers", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert "embed_tokens" in err and err.count("\n") == 1
    out = tmp_path / "out"  # the check from config.json alone refuses before anything is written
    assert (sorted(p.name for p in out.iterdir()) == []) if reference == "transformers" else not out.exists()


@pytest.mark.parametrize("cores,args,workers", [("48", [], "32"), ("6", [], "6"), ("6", ["--workers", "3"], "3"),
                                                ("6", ["--workers=2"], None)])
def test_convert_sbatch_gives_a_writer_per_core(cores, args, workers, tmp_path):
    """launch/convert.sbatch passes the node's cores (SLURM_CPUS_ON_NODE, at most 32) as --workers unless the
    command line names it (either spelling); checked outside Slurm with `echo` as the command."""
    import os
    import subprocess

    from tests.conftest import REPO

    env = {**os.environ, "SLURM_CPUS_ON_NODE": cores, "SLIMISH_CONVERT_CMD": "echo hf-to-megatron",
           "SLIMISH_ROOT": str(REPO), "SLIMISH_VENV": str(tmp_path / "none")}
    out = subprocess.run(["bash", str(REPO / "launch" / "convert.sbatch"), "--hf", "in", "--out", "out", *args],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    line = next(line for line in out.splitlines() if line.startswith("hf-to-megatron "))
    given = line.split()[1:]
    assert given[:4] == ["--hf", "in", "--out", "out"]
    assert given.count("--workers") + sum(a.startswith("--workers=") for a in given) == 1
    if workers is not None:
        assert given[given.index("--workers") + 1] == workers
