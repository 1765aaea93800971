"""The fault injector's vocabulary and its seeded plan: which fault strikes which worker at which moment of
which update.

A fault is one of :data:`KINDS`; it strikes at one of :data:`MOMENTS` of an update, from inside the targeted
worker's process (:mod:`hal.apps.soak.strike`), so the moment is exact: before the first byte is sent (or
asked for; a full filesystem before the trainer stages the update, which it may stage into shared memory),
after part of the update went through the engine (``mid_bucket``: a fraction of the update's bytes
drawn by the plan), when a rollout has received everything and applies it (``during_apply``), or when the
engine's ``finalize()`` runs. Which faults a run can produce depends on the engine and on the machine
(:func:`applicable`): a fault it cannot produce is reported as skipped with the reason, never as passed.

The plan (:func:`plan`) is a pure function of the seed and the update's number: update ``g``'s fault is drawn
from ``random.Random(f"{seed}:{g}")``, and no fault is planned on the first :data:`CLEAN_START` updates nor on
the update right after a fault (that update must succeed: the checker's recovery rule). A plan is therefore
prefix-stable: the first ``g`` updates of a run of ``N`` are those of a run of ``g``, so a failure at update
``g`` replays with ``--updates g`` (Jepsen's nemesis schedule, TigerBeetle's replay from a seed).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

KINDS = ("kill", "stop", "flip", "cut_link", "slow_link", "full_disk", "full_shm")
"""``kill``: SIGKILL of the target (restarted, re-seeded); ``stop``: SIGSTOP longer than the timeout, then
SIGCONT; ``flip``: one byte of the update flipped on its way into a rollout; ``cut_link`` / ``slow_link``: the
target's network link down / throttled (network namespaces and ``tc``); ``full_disk``: the file engine's
filesystem filled; ``full_shm``: ``/dev/shm`` filled."""

MOMENTS = ("before_send", "mid_bucket", "during_apply", "during_finalize")
"""When a fault strikes within an update (see the module docstring)."""

CLEAN_START = 2
"""Updates (from 1) that never get a fault: they set the leak baselines."""

TRAINER, ROLLOUT = "trainer", "rollout"

MOMENTS_OF: dict[str, dict[str, tuple[str, ...]]] = {
    # kind -> role -> the moments it can strike at there
    "kill": {TRAINER: ("before_send", "mid_bucket", "during_finalize"),
             ROLLOUT: ("before_send", "mid_bucket", "during_apply", "during_finalize")},
    "stop": {TRAINER: ("before_send", "mid_bucket", "during_finalize"),
             ROLLOUT: ("before_send", "mid_bucket", "during_apply", "during_finalize")},
    "flip": {ROLLOUT: ("mid_bucket",)},
    "cut_link": {TRAINER: ("before_send", "mid_bucket"), ROLLOUT: ("before_send", "mid_bucket")},
    "slow_link": {TRAINER: ("before_send", "mid_bucket"), ROLLOUT: ("before_send", "mid_bucket")},
    "full_disk": {TRAINER: ("before_send", "mid_bucket")},
    "full_shm": {TRAINER: ("before_send",)},
}

ABSORBABLE = ("slow_link", "stop", "cut_link")
"""Kinds whose update may still succeed, every byte checked (a slowed link that stays within the timeout;
a stop whose process resumes before its peers' timeouts end, e.g. during ``finalize``; a link cut once the
update's last bytes had crossed it): for them the checker accepts a verified update as well as an error."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault.

    Attributes:
        update: the ``global_steps`` of the update it strikes.
        kind: one of :data:`KINDS`.
        target: the worker's index (0: the trainer; 1..R: rollout ranks).
        moment: one of :data:`MOMENTS`.
        fraction: for ``mid_bucket``, the fraction of the update's bytes (sent by the trainer, received by the
            rollout) after which it strikes, in ``[0.2, 0.8]``.
        byte: for ``flip``, which byte of the tensor received at that point is flipped (taken modulo its size).
    """

    update: int
    kind: str
    target: int
    moment: str
    fraction: float = 0.5
    byte: int = 0

    @property
    def role(self) -> str:
        """``"trainer"`` or ``"rollout"``."""
        return TRAINER if self.target == 0 else ROLLOUT

    def describe(self) -> str:
        """The fault in words, e.g. ``"kill rollout rank 2 mid_bucket (after 40% of the bytes) of update 7"``."""
        who = "the trainer" if self.target == 0 else f"rollout rank {self.target}"
        where = f" (after {self.fraction:.0%} of the bytes)" if self.moment == "mid_bucket" else ""
        return f"{self.kind} {who} {self.moment}{where} of update {self.update}"


FLIP_CHECKED_FORMATS = ("delta",)
"""Wire formats whose updates carry checksums a rollout checks before it serves (verl's ``delta_flush`` hash):
only there can a byte flipped in transit be refused. The full format, as verl's, carries none; the job's
verification names the step only after the switch."""


def applicable(kinds: Sequence[str], engine: str, machine: dict[str, str | None],
               wire_format: str = "full") -> tuple[list[str], dict[str, str]]:
    """Which of ``kinds`` a run of ``engine`` can produce here.

    Args:
        kinds: the kinds asked for (each one of :data:`KINDS`).
        engine: the checkpoint engine's registry name.
        wire_format: ``"full"`` or ``"delta"``: ``flip`` runs only on :data:`FLIP_CHECKED_FORMATS`.
        machine: what the machine allows, ``{"links": reason or None, "mounts": reason or None}`` (``None``:
            it works; see :func:`hal.apps.soak.sandbox.machine_support`).

    Returns:
        ``(kinds that run, {kind: why it is skipped})``.

    Raises:
        ValueError: a kind that is not one of :data:`KINDS`.
    """
    import ckpt

    runs, skipped = [], {}
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {kind!r}")
        reason = None
        if kind in ("kill", "stop") and ckpt.checkpoint_engine_says(engine, "one_process"):
            reason = (f"the {engine} engine runs the trainer and the rollouts in one process: killing or stopping "
                      "one of them is killing or stopping the whole job")
        elif kind == "flip" and wire_format not in FLIP_CHECKED_FORMATS:
            reason = (f"the {wire_format} wire format carries no checksum a rollout checks before serving (as "
                      f"verl's): a flipped byte would be served until the job's verification names it "
                      f"(formats that do: {', '.join(FLIP_CHECKED_FORMATS)})")
        elif kind in ("cut_link", "slow_link"):
            if not ckpt.checkpoint_engine_says(engine, "bytes_cross_a_network"):
                reason = f"the {engine} engine moves no bytes over a network link (engines that do: " \
                         f"{', '.join(ckpt.checkpoint_engines_where('bytes_cross_a_network'))})"
            elif machine.get("links"):
                reason = f"no emulated links here: {machine['links']}"
        elif kind == "full_disk":
            if not ckpt.checkpoint_engine_says(engine, "publishes_to_files"):
                reason = (f"the {engine} engine writes nothing to a disk (engines that do: "
                          f"{', '.join(ckpt.checkpoint_engines_where('publishes_to_files'))})")
            elif machine.get("mounts"):
                reason = f"no private filesystem to fill here: {machine['mounts']}"
        elif kind == "full_shm":
            if not ckpt.checkpoint_engine_says(engine, "stages_in_shared_memory"):
                reason = (f"the {engine} engine allocates nothing in /dev/shm (engines that do: "
                          f"{', '.join(ckpt.checkpoint_engines_where('stages_in_shared_memory'))})")
            elif machine.get("mounts"):
                reason = f"no private /dev/shm to fill here (the machine's is shared): {machine['mounts']}"
        if reason is None:
            runs.append(kind)
        else:
            skipped[kind] = reason
    return runs, skipped


def draw(seed: int, update: int, kinds: Sequence[str], rollouts: int, rate: float) -> Fault | None:
    """Update ``update``'s fault from its own generator (``random.Random(f"{seed}:{update}")``), or ``None``.

    Args:
        seed: the run's seed.
        kinds: the kinds that run (order matters: it is part of what the seed replays).
        rollouts: rollout ranks (targets ``1..rollouts``).
        rate: the probability that an update gets a fault, in ``[0, 1]``.
    """
    rng = random.Random(f"{seed}:{update}")
    if not kinds or rng.random() >= rate:
        return None
    kind = rng.choice(list(kinds))
    roles = sorted(MOMENTS_OF[kind])
    role = rng.choice(roles)
    target = 0 if role == TRAINER else rng.randint(1, rollouts)
    moment = rng.choice(MOMENTS_OF[kind][role])
    return Fault(update=update, kind=kind, target=target, moment=moment, fraction=round(rng.uniform(0.2, 0.8), 3),
                 byte=rng.randrange(1 << 30))


def plan(seed: int, updates: int, kinds: Sequence[str], rollouts: int, rate: float) -> dict[int, Fault]:
    """The run's faults, ``{update: Fault}``, for updates ``1..updates`` (see the module docstring).

    Raises:
        ValueError: ``rate`` outside ``[0, 1]`` or ``rollouts`` < 1.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be a probability in [0, 1], got {rate!r}")
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1, got {rollouts!r}")
    faults: dict[int, Fault] = {}
    for update in range(CLEAN_START + 1, updates + 1):
        if update - 1 in faults:
            continue  # the update after a fault must succeed
        fault = draw(seed, update, kinds, rollouts, rate)
        if fault is not None:
            faults[update] = fault
    return faults


__all__ = ["ABSORBABLE", "CLEAN_START", "FLIP_CHECKED_FORMATS", "Fault", "KINDS", "MOMENTS", "MOMENTS_OF", "ROLLOUT",
           "TRAINER", "applicable", "draw", "plan"]
