"""ckpt: checkpoint engines that publish weights tagged with ``global_steps`` (trainer -> rollout).

Engines by registry name: ``colocated``, ``collective`` (NCCL, HCCL or gloo), ``file``, ``ipc``, ``nixl``,
``mooncake``, ``kimi``."""

from ckpt.base import CheckpointEngine, check_async_contract, contract_violations
from ckpt.errors import (
    CheckpointConfigError,
    CheckpointEngineUnavailableError,
    CheckpointEngineError,
    ContractError,
    DuplicateCheckpointEngineError,
    SendInProgressError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
    UnknownCheckpointEngineError,
    UpdateRefusedError,
    VersionMismatchError,
    WeightCheckError,
    WeightMismatchError,
)
from ckpt.registry import (
    checkpoint_engine_factory,
    checkpoint_engine_availability,
    checkpoint_engine_import_errors,
    checkpoint_engine_says,
    checkpoint_engine_transport,
    checkpoint_engine_status,
    checkpoint_engines_where,
    get_checkpoint_engine,
    known_checkpoint_engines,
    register_checkpoint_engine,
    unregister_checkpoint_engine,
)
from ckpt.layout import WeightLayout
from ckpt.lora import LoraRolloutAdapter
from ckpt.serving import InMemoryRolloutAdapter, ModelRolloutAdapter
from ckpt.shards import RowShard, dim0_rows, local_parts
from ckpt.workers import CheckpointEngineWorker, TrainerWorker


def __getattr__(name: str):
    lazy = {"ColocatedCheckpointEngine": "ckpt.colocated", "CollectiveCheckpointEngine": "ckpt.collective",
            "FileCheckpointEngine": "ckpt.file", "NixlCheckpointEngine": "ckpt.nixl",
            "MooncakeCheckpointEngine": "ckpt.mooncake", "KimiCheckpointEngine": "ckpt.kimi",
            "IpcCheckpointEngine": "ckpt.ipc"}
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")


__all__ = [
    "CheckpointEngine", "check_async_contract", "contract_violations",
    "get_checkpoint_engine", "register_checkpoint_engine", "unregister_checkpoint_engine",
    "known_checkpoint_engines", "checkpoint_engine_import_errors", "checkpoint_engine_factory",
    "checkpoint_engine_availability", "checkpoint_engine_status", "checkpoint_engine_says", "checkpoint_engine_transport",
    "checkpoint_engines_where",
    "ColocatedCheckpointEngine", "CollectiveCheckpointEngine", "FileCheckpointEngine",
    "NixlCheckpointEngine", "MooncakeCheckpointEngine", "KimiCheckpointEngine", "IpcCheckpointEngine",
    "TrainerWorker", "CheckpointEngineWorker", "InMemoryRolloutAdapter", "ModelRolloutAdapter", "LoraRolloutAdapter",
    "WeightLayout",
    "CheckpointEngineError", "CheckpointConfigError", "CheckpointEngineUnavailableError", "VersionMismatchError", "WeightMismatchError",
    "TransferError", "TransferAbortedError", "TransferTimeoutError", "DuplicateCheckpointEngineError", "UnknownCheckpointEngineError",
    "ContractError", "SendInProgressError", "UpdateRefusedError", "WeightCheckError", "RowShard", "dim0_rows",
    "local_parts",
]
