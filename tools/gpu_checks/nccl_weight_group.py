"""The weight-sync group on NCCL at one rank (all one GPU allows: NCCL refuses two ranks on one device): the sender's
side of the `broadcast` transport as a job makes it, then one bucket broadcast through it and released the way a
stuck sync is released.

    python tools/gpu_checks/nccl_weight_group.py [--backend nccl|gloo] [--mib 256]

1. `new_weight_update_group` (the store, the PrefixStore named after the group, torch's private group helper, as
   SGLang's engines build their side) on NCCL, rank 0 of a world of 1;
2. a flat uint8 bucket broadcast from rank 0 through `slimish.collectives.broadcast` (which refuses a tensor not on
   the group's device), asynchronously, and waited for with a bound as the transport's `wire` does;
3. the communicator aborted (`_abort_process_group`: ncclCommAbort, what `BroadcastTransport._abort_nccl` does when a
   sync is released), and a second group then created, used and destroyed (`destroy_group`), as the next sync does.
With --backend gloo (the battery's dry run) the same calls on the CPU. Last line: `nccl_weight_group=ok ...`.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slimish import collectives  # noqa: E402
from slimish.network import free_port  # noqa: E402
from slimish.weight_sync.process_group import destroy_group, new_weight_update_group  # noqa: E402


def one_bucket(group, device: str, nbytes: int) -> float:
    flat = torch.arange(nbytes, dtype=torch.int64, device=device).to(torch.uint8)
    t0 = time.perf_counter()
    work = collectives.broadcast(flat, src=0, group=group, async_op=True)
    work.wait(timeout=timedelta(seconds=60))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["nccl", "gloo"])
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    nbytes = args.mib * 2**20
    group = new_weight_update_group(backend=args.backend, master_address="127.0.0.1", master_port=free_port(),
                                    world_size=1, rank=0, group_name="slimish_battery_1")
    seconds = one_bucket(group, device, nbytes)
    print(f"group 1 ({args.backend}, world 1): a {args.mib} MiB bucket broadcast in {seconds * 1e3:.1f} ms", flush=True)
    refused = False
    try:
        collectives.broadcast(torch.zeros(4, dtype=torch.uint8, device="cpu" if device == "cuda" else "meta"),
                              src=0, group=group)
    except Exception as error:  # noqa: BLE001  (the refusal's type is collectives'; any refusal will do)
        refused = True
        print(f"a tensor off the group's device is refused: {type(error).__name__}: {error}"[:200], flush=True)
    if args.backend == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        t0 = time.perf_counter()
        _abort_process_group(group)
        print(f"group 1 aborted (ncclCommAbort) in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    else:
        destroy_group(group)
    group = new_weight_update_group(backend=args.backend, master_address="127.0.0.1", master_port=free_port(),
                                    world_size=1, rank=0, group_name="slimish_battery_2")
    seconds = one_bucket(group, device, nbytes)
    destroy_group(group)
    print(f"group 2 after it: a {args.mib} MiB bucket in {seconds * 1e3:.1f} ms, destroyed", flush=True)
    print(f"nccl_weight_group=ok backend={args.backend} off_device_refused={refused}")


if __name__ == "__main__":
    main()
