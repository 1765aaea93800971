"""The soak's default model: a small safetensors checkpoint the run writes, trained by the job's regression
loss, so hundreds of updates cost seconds each. It mixes bf16 and fp32, 2-D and 1-D, many small tensors, one
larger than a 1 MiB bucket, and an untrained int64 buffer."""

from __future__ import annotations

import os

NAME = "tensors"  # --model value
FILE = "soak-model.safetensors"  # in the run's scratch directory
# {name: (shape, dtype)}: 2.3 MB in all; embed.weight (1.25 MiB) is larger than a 1 MiB bucket
TENSORS: dict[str, tuple[tuple[int, ...], str]] = {
    **{f"layers.{i}.proj.weight": ((256, 256), "bfloat16") for i in range(6)},
    **{f"layers.{i}.norm.weight": ((256,), "float32") for i in range(6)},
    **{f"layers.{i}.gate.weight": ((96, 256), "float32") for i in range(2)},
    "embed.weight": ((1024, 640), "bfloat16"),
    "embed.position_ids": ((512,), "int64"),
}


def write(directory: str, seed: int = 0) -> str:
    """Write the checkpoint (random values from ``seed``) into ``directory``; returns its path."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, dtype) in TENSORS.items():
        if dtype == "int64":
            tensors[name] = torch.arange(shape[0], dtype=torch.int64)
        else:
            tensors[name] = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    path = os.path.join(directory, FILE)
    save_file(tensors, path)
    return path


__all__ = ["FILE", "NAME", "TENSORS", "write"]
