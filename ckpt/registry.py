"""One registry of checkpoint engines: built-ins by name, third-party ones by call or entry point.

Like ``torch.distributed.Backend.register_backend``, registering a taken name raises. Built-in engines and
those of the ``hal.checkpoint_engines`` entry-point group are imported on first lookup or registration (so
registering a built-in's name raises even before any lookup); an import failure
is remembered and shown when a lookup fails, so "unknown engine" also says which backend could not load.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Callable

from ckpt.base import check_async_contract
from ckpt.errors import (CheckpointConfigError, CheckpointEngineUnavailableError, ContractError,
                         DuplicateCheckpointEngineError, UnknownCheckpointEngineError)

ENTRY_POINT_GROUP = "hal.checkpoint_engines"

_BUILTINS = {
    "colocated": "ckpt.colocated:ColocatedCheckpointEngine",
    "collective": "ckpt.collective:CollectiveCheckpointEngine",
    "file": "ckpt.file:FileCheckpointEngine",
    "nixl": "ckpt.nixl:NixlCheckpointEngine",
    "mooncake": "ckpt.mooncake:MooncakeCheckpointEngine",
    "kimi": "ckpt.kimi:KimiCheckpointEngine",
    "ipc": "ckpt.ipc:IpcCheckpointEngine",
}

_engines: dict[str, Callable[..., Any]] = {}
_import_errors: dict[str, str] = {}
_loaded = False


def _load_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load_once() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    sources = [(name, target) for name, target in _BUILTINS.items()]
    try:
        sources += [(ep.name, ep) for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]
    except Exception as exc:  # noqa: BLE001 - a broken distribution must not break lookups
        _import_errors[f"<entry points {ENTRY_POINT_GROUP}>"] = f"{type(exc).__name__}: {exc}"
    for name, source in sources:
        if name in _engines:
            continue
        try:
            factory = _load_target(source) if isinstance(source, str) else source.load()
            register_checkpoint_engine(name, factory)
        except Exception as exc:  # noqa: BLE001 - recorded and reported by get_checkpoint_engine
            _import_errors[name] = f"{type(exc).__name__}: {exc}"


def register_checkpoint_engine(name: str, cls_or_factory: Callable[..., Any]) -> None:
    """Register an engine class (or a factory ``(**config) -> engine``) under ``name``.

    The built-in and entry-point engines are loaded first, so their names are taken even before any
    lookup (a built-in that failed to import leaves its name free). A class is checked against the async
    contract now; a factory's product is checked by :func:`get_checkpoint_engine`.

    Raises:
        CheckpointConfigError: ``name`` is not a non-empty ``str`` (a ``ValueError``; names the value).
        DuplicateCheckpointEngineError: ``name`` is taken (a ``ValueError``).
        ContractError: the class has a contract method that is not async (a ``TypeError``).
    """
    if not isinstance(name, str) or not name:
        raise CheckpointConfigError(f"checkpoint engine name must be a non-empty str, got {name!r}")
    _load_once()  # a no-op when called from inside it (already marked loaded)
    if name in _engines:
        raise DuplicateCheckpointEngineError(
            f"a checkpoint engine is already registered as {name!r} ({_engines[name]!r}); "
            f"unregister_checkpoint_engine({name!r}) first to replace it")
    if not callable(cls_or_factory):
        raise ContractError(f"engine {name!r} must be a class or factory, got {cls_or_factory!r}")
    if inspect.isclass(cls_or_factory):
        check_async_contract(cls_or_factory)
    _engines[name] = cls_or_factory


def unregister_checkpoint_engine(name: str) -> None:
    """Remove ``name`` from the registry (no error if absent); for tests and plugin reloads."""
    _engines.pop(name, None)


def known_checkpoint_engines() -> list[str]:
    """Names of the registered engines (built-ins and entry points included), sorted."""
    _load_once()
    return sorted(_engines)


def checkpoint_engine_says(name: str, fact: str) -> bool:
    """Whether the class registered as ``name`` states ``fact``, one of :class:`ckpt.CheckpointEngine`'s
    class facts (``bucketed``, ``hosts_rendezvous``, ``one_process``, ``publishes_to_files``, ...): how the job,
    the CLI and the benchmarks ask what an engine is instead of comparing its name. A factory that is not a
    class, or a class without the attribute, says nothing (``False``).

    Raises:
        UnknownCheckpointEngineError: no such name.
        AttributeError: ``fact`` is not a fact of :class:`ckpt.CheckpointEngine` (a misspelt fact would
            otherwise read ``False`` silently).
    """
    from ckpt.base import CheckpointEngine

    if not isinstance(getattr(CheckpointEngine, fact, None), bool):
        facts = sorted(k for k, v in vars(CheckpointEngine).items() if isinstance(v, bool))
        raise AttributeError(f"{fact!r} is not a class fact of CheckpointEngine; facts: {', '.join(facts)}")
    return bool(getattr(checkpoint_engine_factory(name), fact, False))


def checkpoint_engine_transport(name: str, spec: Any) -> str | None:
    """How the class registered as ``name`` moves bytes on the device kind ``spec`` (a ``hal.DeviceSpec``), in
    words (:meth:`ckpt.CheckpointEngine.transport_words`); ``None`` when it says nothing, or for a factory that
    is not such a class.

    Raises:
        UnknownCheckpointEngineError: no such name.
    """
    from ckpt.base import CheckpointEngine

    factory = checkpoint_engine_factory(name)
    if isinstance(factory, type) and issubclass(factory, CheckpointEngine):
        return factory.transport_words(spec)
    return None


def checkpoint_engines_where(fact: str) -> list[str]:
    """Names of the registered engines whose class states ``fact`` (see :func:`checkpoint_engine_says`),
    sorted; e.g. for a message listing the engines a flag accepts.

    Raises:
        AttributeError: ``fact`` is not a fact of :class:`ckpt.CheckpointEngine`.
    """
    return [name for name in known_checkpoint_engines() if checkpoint_engine_says(name, fact)]


def checkpoint_engine_import_errors() -> dict[str, str]:
    """``{name: "ExceptionType: message"}`` for built-in or entry-point engines that failed to import."""
    _load_once()
    return dict(_import_errors)


def checkpoint_engine_factory(name: str) -> Callable[..., Any]:
    """The class (or factory) registered as ``name``, not instantiated (for other frameworks' registries).

    Raises:
        UnknownCheckpointEngineError: no such name (the message lists the known ones).
    """
    _load_once()
    if name not in _engines:
        _raise_unknown(name)
    return _engines[name]


def _raise_unknown(name: str) -> None:
    failed = "; ".join(f"{n}: {e}" for n, e in sorted(_import_errors.items())) or "none"
    raise UnknownCheckpointEngineError(
        f"unknown checkpoint engine {name!r}; known: {', '.join(sorted(_engines)) or 'none'}; "
        f"failed to import: {failed}")


def checkpoint_engine_availability(name: str, device: Any = None) -> tuple[bool, str]:
    """``(ok, reason)`` for the engine registered as ``name``: an engine class may define a classmethod
    ``availability()`` (truthy, with ``.reason`` when not); engines without one are always available.

    Args:
        device: the device kind the engine would be built for (its ``device=`` argument); passed to
            ``availability(device)`` when the probe takes it (an engine that runs on some kinds only), else
            ``None`` means hal's resolution (``$HAL_DEVICE``, then the first available kind).

    Raises:
        UnknownCheckpointEngineError: no such name.
    """
    _load_once()
    if name not in _engines:
        _raise_unknown(name)
    probe = getattr(_engines[name], "availability", None)
    if probe is None:
        return True, ""
    try:
        takes_device = "device" in inspect.signature(probe).parameters
    except (TypeError, ValueError):  # a builtin or odd callable: call it without
        takes_device = False
    try:
        state = probe(device) if takes_device else probe()
    except Exception as exc:  # noqa: BLE001 - a failing probe means "not available", with its text
        return False, f"availability() raised {type(exc).__name__}: {exc}"
    return bool(state), getattr(state, "reason", "")


def checkpoint_engine_status(device: Any = None) -> list[dict[str, Any]]:
    """Every registered engine, and every built-in or entry-point one that failed to import, as
    ``{"name", "available", "reason"}`` sorted by name (what ``hal info`` prints), for the device kind
    ``device`` (``None``: hal's resolution; see :func:`checkpoint_engine_availability`)."""
    _load_once()
    rows = []
    for name in sorted(set(_engines) | set(_import_errors)):
        if name in _engines:
            ok, reason = checkpoint_engine_availability(name, device)
        else:
            ok, reason = False, f"failed to import: {_import_errors[name]}"
        rows.append({"name": name, "available": ok, "reason": reason})
    return rows


def get_checkpoint_engine(name: str, **config: Any) -> Any:
    """Build the engine registered as ``name`` with ``config`` (e.g. ``rank=0, world_size=3, bucket_size=...``).

    Raises:
        UnknownCheckpointEngineError: no such name; the message lists the known names and each backend
            that failed to import, with its error.
        CheckpointEngineUnavailableError: the engine cannot run here (library missing, no device kind it
            supports); the message says why and lists the engines that are available.
        ContractError: the factory returned an engine whose contract methods are not all async.
    """
    factory = checkpoint_engine_factory(name)
    ok, reason = checkpoint_engine_availability(name, config.get("device"))
    if not ok:
        usable = [n for n in sorted(_engines) if n != name and checkpoint_engine_availability(n)[0]]
        raise CheckpointEngineUnavailableError(
            f"checkpoint engine {name!r} is unavailable here: {reason}; available: {', '.join(usable) or 'none'}")
    engine = factory(**config)
    check_async_contract(engine)
    return engine
