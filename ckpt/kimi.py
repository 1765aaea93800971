"""``kimi``: Kimi's ``checkpoint-engine`` (``ParameterServer``) where that library runs.

Its ``ParameterServer`` supports only the device types its ``DeviceManager`` knows; on any other
(``cpu``, ``npu-sim``) its constructor raises ``TypeError: The current device type is not supported``.
Which hal device kinds it runs on is device knowledge (the spec field ``kimi_checkpoint_engine``), so on
a machine without one of them :func:`ckpt.get_checkpoint_engine` refuses ``"kimi"`` with
:class:`ckpt.CheckpointEngineUnavailableError`, saying why and which engines are available.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable

import hal
from ckpt.base import CheckpointEngine, NamedTensor
from ckpt.errors import CheckpointEngineUnavailableError

SPEC_FIELD = "kimi_checkpoint_engine"


def supported_kinds() -> list[str]:
    """Device kinds whose spec says Kimi's checkpoint-engine runs there."""
    from hal.registry import get_spec

    return [k for k in hal.known_kinds() if getattr(get_spec(k), SPEC_FIELD, False)]


class KimiCheckpointEngine(CheckpointEngine):
    """Placeholder registered under ``"kimi"``: :meth:`availability` says where the library runs.

    The peer-to-peer path of ``checkpoint_engine.ps.ParameterServer`` (``register_checkpoint``,
    ``gather_metas``, ``update(ranks=...)`` over Mooncake, delivery to the inference worker by device IPC)
    needs real devices; this class is only constructed where :meth:`availability` is ok.
    """

    @classmethod
    def availability(cls) -> hal.Availability:
        """Ok when a device kind with ``kimi_checkpoint_engine`` is available and the library imports."""
        kinds = supported_kinds()
        usable = [k for k in kinds if hal.availability(k)]
        if not usable:
            return hal.Availability.unavailable(
                f"Kimi's checkpoint-engine runs only on device kinds {kinds} (its ParameterServer raises "
                f"'TypeError: The current device type is not supported' on others), and none of them is "
                f"available here ({'; '.join(f'{k}: {hal.availability(k).reason}' for k in kinds)})")
        try:
            import checkpoint_engine.ps  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - ImportError of it or its dependencies
            return hal.Availability.unavailable(
                f"import checkpoint_engine.ps failed ({type(exc).__name__}: {exc}); install the 'kimi' extra "
                "(pip install checkpoint-engine==0.4.2)")
        return hal.Availability.available(len(usable))

    def __init__(self, **config: Any) -> None:
        state = self.availability()
        if not state:
            raise CheckpointEngineUnavailableError(f"checkpoint engine 'kimi' is unavailable here: {state.reason}")
        raise CheckpointEngineUnavailableError(
            "checkpoint engine 'kimi': the wrapper around checkpoint-engine's ParameterServer is not "
            "implemented in this build; use 'nixl' or 'mooncake' (the transfer library it uses)")

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        raise CheckpointEngineUnavailableError("checkpoint engine 'kimi' is not implemented in this build")

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[NamedTensor]:
        raise CheckpointEngineUnavailableError("checkpoint engine 'kimi' is not implemented in this build")
        yield  # pragma: no cover - makes this an async generator
