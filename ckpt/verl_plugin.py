"""Registers hal's checkpoint engines in verl's ``CheckpointEngineRegistry`` under hal-prefixed names.

Name this module in verl's config and pick a hal engine as the backend::

    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ckpt.verl_plugin
    actor_rollout_ref.rollout.checkpoint_engine.backend=hal-collective
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.hal-collective.timeout=300

verl imports it (``verl.utils.import_utils.import_external_libs``) in the trainer, in every
``CheckpointEngineWorker`` and in ``CheckpointEngineManager`` before it looks the backend up, then builds
the engine as ``cls(bucket_size=..., is_master=..., **engine_kwargs[backend])``. Importing this module
imports verl; nothing else in hal does (``import hal`` / ``import ckpt`` never touch verl).

Every engine class of hal's registry (built-ins, and third-party ones registered through the
``hal.checkpoint_engines`` entry points) is registered as ``hal-<name>``; factories that are not classes
are skipped (verl calls ``build_topology`` on the registered class).
"""

from __future__ import annotations

import inspect

from ckpt.registry import checkpoint_engine_factory, known_checkpoint_engines

PREFIX = "hal-"
"""Prefix of hal's engines in verl's registry: ``hal-collective``, ``hal-colocated``, ``hal-file``, ..."""


def register_with_verl() -> dict[str, type]:
    """Register every hal engine class in verl's registry as ``hal-<name>``; idempotent.

    Returns:
        ``{verl backend name: class}`` of what is registered.

    Raises:
        ImportError: verl is not installed (the message says what to install).
    """
    try:
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
    except ImportError as exc:
        raise ImportError(f"ckpt.verl_plugin registers hal's engines in verl, but verl cannot be imported: {exc}. "
                          "Install it as scripts/setup.sh does (the 'verl' extra; README, 'Using hal from verl')") from exc
    registered = {}
    for name in known_checkpoint_engines():
        cls = checkpoint_engine_factory(name)
        if not inspect.isclass(cls):
            continue
        CheckpointEngineRegistry.register(PREFIX + name)(cls)
        registered[PREFIX + name] = cls
    return registered


REGISTERED = register_with_verl()
"""What importing this module registered, ``{verl backend name: class}``."""
