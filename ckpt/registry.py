"""One registry of checkpoint engines: built-ins by name, third-party ones by call or entry point.

Registering a taken name raises. Built-ins and the ``hal.checkpoint_engines`` entry-point group load on first
lookup or registration; an import failure is remembered and shown when a lookup fails."""

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

    A class is checked against the async contract now, a factory's product at :func:`get_checkpoint_engine`.
    Raises :class:`DuplicateCheckpointEngineError` when ``name`` is taken, built-ins included."""
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
    """Remove ``name`` from the registry (no error if absent)."""
    _engines.pop(name, None)


def known_checkpoint_engines() -> list[str]:
    _load_once()
    return sorted(_engines)


def checkpoint_engine_says(name: str, fact: str) -> bool:
    """Return whether the class registered as ``name`` states the class fact ``fact`` (e.g. ``bucketed``).

    A factory that is not a class says nothing; a ``fact`` that is not one of :class:`ckpt.CheckpointEngine`'s
    raises ``AttributeError`` rather than reading ``False``."""
    from ckpt.base import CheckpointEngine

    if not isinstance(getattr(CheckpointEngine, fact, None), bool):
        facts = sorted(k for k, v in vars(CheckpointEngine).items() if isinstance(v, bool))
        raise AttributeError(f"{fact!r} is not a class fact of CheckpointEngine; facts: {', '.join(facts)}")
    return bool(getattr(checkpoint_engine_factory(name), fact, False))


def checkpoint_engine_transport(name: str, spec: Any) -> str | None:
    """Return how the engine ``name`` moves bytes on device kind ``spec``, in words, or ``None``."""
    from ckpt.base import CheckpointEngine

    factory = checkpoint_engine_factory(name)
    if isinstance(factory, type) and issubclass(factory, CheckpointEngine):
        return factory.transport_words(spec)
    return None


def checkpoint_engines_where(fact: str) -> list[str]:
    """Return the names of the registered engines whose class states ``fact``, sorted."""
    return [name for name in known_checkpoint_engines() if checkpoint_engine_says(name, fact)]


def checkpoint_engine_import_errors() -> dict[str, str]:
    """Return ``{name: "ExceptionType: message"}`` of the engines that failed to import."""
    _load_once()
    return dict(_import_errors)


def checkpoint_engine_factory(name: str) -> Callable[..., Any]:
    """Return the class (or factory) registered as ``name``, not instantiated."""
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
    """Return ``(ok, reason)`` from the engine's optional classmethod ``availability(device)``.

    ``device`` is passed when the probe takes it; ``None`` means hal's resolution."""
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
    """Return every engine, failed imports included, as ``{"name", "available", "reason"}`` (what ``hal info`` prints)."""
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
    """Build the engine registered as ``name`` with ``config``.

    Raises :class:`CheckpointEngineUnavailableError` (naming why and the available engines) when it cannot run
    here."""
    factory = checkpoint_engine_factory(name)
    ok, reason = checkpoint_engine_availability(name, config.get("device"))
    if not ok:
        usable = [n for n in sorted(_engines) if n != name and checkpoint_engine_availability(n)[0]]
        raise CheckpointEngineUnavailableError(
            f"checkpoint engine {name!r} is unavailable here: {reason}; available: {', '.join(usable) or 'none'}")
    engine = factory(**config)
    check_async_contract(engine)
    return engine
