"""Peak host memory per process of building a ViT for trainer=fsdp on 2 CPU processes (gloo): laid out on the meta
device and initialised per shard (what trainer=fsdp does now, training/devices/sharding.py), against built whole on the host
and then sharded (what it did before). Each process is a fresh interpreter (spawned); its peak resident set is
`ru_maxrss`, measured after the model is sharded and initialised, beside the resident set once torch and vitlab are
imported. Writes meta_init_memory.json.

    python experiments/sharding/meta_init_memory.py [--variant g/14] [--ways meta,host]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time
from pathlib import Path


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank: int, world: int, port: int, variant: str, way: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vitlab.model import ViTConfig
    from vitlab.model.blocks import Block
    from vitlab.training.devices.sharding import materialize, networks_on_meta, new_vit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    imported = rss_mb()
    cfg = ViTConfig.from_variant(variant, img_size=224)
    torch.manual_seed(0)
    start = time.perf_counter()
    with networks_on_meta(way == "meta"):
        model = new_vit(cfg)
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, torch.device("cpu"))
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    probe = model.blocks[0].mlp.fc1.weight.full_tensor()[:2, :4].tolist()  # the same values both ways (seed 0)
    row = dict(way=way, rank=rank, variant=variant, params=sum(p.numel() for p in model.parameters()),
               full_fp32_mb=full / 2**20, shard_mb=local / 2**20, rss_after_imports_mb=imported,
               peak_rss_mb=peak, seconds=seconds, probe=probe)  # fmt: skip
    Path(out).with_suffix(f".{way}.{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="g/14")
    parser.add_argument("--ways", default="meta,host")
    args = parser.parse_args()
    here = Path(__file__).parent
    rows = []
    for way in args.ways.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = here / "meta_init_memory"
        mp.start_processes(worker, args=(2, port, args.variant, way, str(out)), nprocs=2, start_method="spawn")
        rows += [json.loads(out.with_suffix(f".{way}.{r}.json").read_text()) for r in range(2)]
        for r in range(2):
            out.with_suffix(f".{way}.{r}.json").unlink()
    (here / "meta_init_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    for row in rows:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items() if k != "probe"})


if __name__ == "__main__":
    main()
