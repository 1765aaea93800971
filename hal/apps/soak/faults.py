"""The fault injector's vocabulary and its seeded plan: which fault strikes which worker at which moment of
which update.

A fault (:data:`KINDS`) strikes from inside its target's process (:mod:`hal.apps.soak.strike`) at one of
:data:`MOMENTS`. A fault the engine or machine cannot produce is reported skipped with the reason
(:func:`applicable`), never passed. The plan is a pure function of the seed and the update's number
(``random.Random(f"{seed}:{g}")``), with no fault on the first :data:`CLEAN_START` updates nor right after a
fault: it is prefix-stable, so a failure at update ``g`` replays with ``--updates g``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

# kill: SIGKILL (restarted); stop: SIGSTOP past the timeout, then SIGCONT; flip: one byte of the update flipped
# into a rollout; cut_link / slow_link: link down / throttled; full_disk: the file engine's disk; full_shm
KINDS = ("kill", "stop", "flip", "cut_link", "slow_link", "full_disk", "full_shm")

MOMENTS = ("before_send", "mid_bucket", "during_apply", "during_finalize")  # see hal.apps.soak.strike

CLEAN_START = 2  # updates without faults: the leak baselines

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

# kinds whose update may still succeed, every byte checked; the checker accepts a verified update or an error
ABSORBABLE = ("slow_link", "stop", "cut_link")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault on worker ``target`` (0: the trainer) at ``moment`` of update ``update``; ``fraction``
    (``mid_bucket``, in [0.2, 0.8]) of the bytes, ``byte`` the one a ``flip`` flips (modulo the tensor's size)."""

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


# wire formats whose updates carry checksums a rollout checks before serving: only there can a flip be refused
FLIP_CHECKED_FORMATS = ("delta",)


def applicable(kinds: Sequence[str], engine: str, machine: dict[str, str | None],
               wire_format: str = "full") -> tuple[list[str], dict[str, str]]:
    """Which of ``kinds`` a run of ``engine`` can produce here; returns ``(kinds that run, {kind: why
    skipped})``. ``machine`` is :func:`hal.apps.soak.sandbox.machine_support`'s."""
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
    """Update ``update``'s fault from its own generator (``random.Random(f"{seed}:{update}")``), or ``None``;
    the order of ``kinds`` is part of what the seed replays."""
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
    """The run's faults, ``{update: Fault}``, for updates ``1..updates``."""
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
