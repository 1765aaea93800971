"""LoRA adapters published apart from their base, in verl's message shape (``peft_config``, ``base_sync_done``).

An update with ``peft_config`` and ``base_sync_done=True`` carries only the adapter's tensors, named as peft's
``get_peft_model_state_dict`` names them (``base_model.model.<module>.lora_A.weight``); with
``base_sync_done=False`` it carries the base model's tensors under their plain names, then (hal's trainer) the
adapter's. Engines carry them as any named tensors; ``peft_config`` and ``base_sync_done`` travel beside the
update, as ``update_weights`` keywords. :class:`LoraRolloutAdapter` serves a module with the adapter applied by
peft, unmerged: the base in one :class:`~ckpt.serving.ModelRolloutAdapter`, the adapter in another, two banks
swapped whole, so a refused adapter leaves the previous one in service. peft is imported on use."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, AsyncIterator, Iterable, Mapping

import torch
from torch import nn

from ckpt.base import NamedTensor, check_global_steps, drain
from ckpt.errors import CheckpointConfigError, WeightMismatchError
from ckpt.layout import named_weights
from ckpt.serving import AdapterMemory, ModelRolloutAdapter

ADAPTER_MARKER = ".lora_"  # in the name of every adapter tensor (peft's lora_A, lora_B, lora_embedding_A, ...)
ADAPTER_NAME = "default"  # the peft adapter a served module holds
# peft_config fields that decide the adapter's tensors and how they apply: an update must agree with the served one
SHAPE_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
                "rank_pattern", "alpha_pattern")


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is an adapter tensor's (else a base model's)."""
    return ADAPTER_MARKER in name


def plain_peft_config(config: Any) -> dict[str, Any]:
    """A peft ``LoraConfig`` (or its ``to_dict()``) as plain values: sets as sorted lists, enums as their value."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, enum.Enum):
            return value.value
        return value
    return {key: plain(value) for key, value in data.items()}


def lora_config(peft_config: Mapping[str, Any]) -> Any:
    """Build peft's ``LoraConfig`` from ``peft_config`` (a ``to_dict()``); fields it does not know are dropped."""
    import peft

    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)} - {"peft_type"}
    return peft.LoraConfig(**{k: v for k, v in plain_peft_config(peft_config).items() if k in fields})


def config_differences(served: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """The :data:`SHAPE_FIELDS` on which ``got`` differs from ``served``, as ``"r 16 (serves 8)"``."""
    served, got = plain_peft_config(served), plain_peft_config(got)
    return [f"{key} {got.get(key)!r} (serves {served.get(key)!r})" for key in SHAPE_FIELDS
            if served.get(key) != got.get(key)]


def adapter_module(name: str) -> str:
    """The base module an adapter tensor belongs to: ``base_model.model.x.q_proj.lora_A.weight`` -> ``x.q_proj``."""
    return name.removeprefix("base_model.model.").split(ADAPTER_MARKER)[0]


def adapter_misfits(shapes: Mapping[str, tuple[int, ...]], peft_config: Mapping[str, Any],
                    base_shapes: Mapping[str, tuple[int, ...]], max_rank: int | None = None) -> list[str]:
    """What keeps an adapter (``{name: shape}`` of its tensors) off a base (``{name: shape}`` of its tensors): its
    rank above ``max_rank``, a target module the base lacks, a ``lora_A`` / ``lora_B`` shape that does not fit the
    base weight at the adapter's rank; one sentence each, ``[]`` when it fits."""
    config = plain_peft_config(peft_config)
    rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()])
    out = [f"rank {rank} is above the rollout's max_lora_rank {max_rank}"] if max_rank is not None and rank > max_rank \
        else []
    for name, shape in shapes.items():
        module = adapter_module(name)
        base = base_shapes.get(f"{module}.weight")
        if base is None or len(base) != 2:
            out.append(f"tensor {name!r} targets {module!r}, which has no 2-D weight in the base")
            continue
        want = (shape[0], base[1]) if ".lora_A." in name else (base[0], shape[1]) if ".lora_B." in name else None
        ranked = shape[0] if ".lora_A." in name else shape[-1]
        if want is not None and (tuple(shape) != want or ranked > rank):
            out.append(f"tensor {name!r} has shape {tuple(shape)}, which does not fit {module}.weight {tuple(base)} "
                       f"at rank {rank}")
    return out


class TensorHolder(nn.Module):
    """A module holding the given tensors themselves (not copies) under the given dotted names."""

    def __init__(self, tensors: Iterable[NamedTensor]) -> None:
        super().__init__()
        for name, tensor in tensors:
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if isinstance(tensor, nn.Parameter):
                owner.register_parameter(leaf, tensor)
            else:
                owner.register_buffer(leaf, tensor)


def inject_lora(module: nn.Module, peft_config: Mapping[str, Any]) -> list[NamedTensor]:
    """Put peft's LoRA layers of ``peft_config`` into ``module`` (in place, in its dtype, eval mode); returns the
    adapter's parameters under ``get_peft_model_state_dict``'s names. Raises :class:`WeightMismatchError` naming
    targets ``module`` lacks (``module`` is then unchanged)."""
    import peft

    try:
        model = peft.get_peft_model(module, lora_config(peft_config), adapter_name=ADAPTER_NAME,
                                    autocast_adapter_dtype=False)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError: no target module found
        raise WeightMismatchError(f"the adapter's target_modules {plain_peft_config(peft_config).get('target_modules')!r} "
                                  f"do not fit the served model: {exc}") from None
    module.eval()
    suffix = f".{ADAPTER_NAME}"
    return [(name.replace(suffix, ""), p) for name, p in model.named_parameters() if is_adapter_tensor(name)]


class _Split:
    """One update stream as its base part (up to the first adapter tensor) and the rest."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.first_adapter = stream.__aiter__(), None
        self.ended = False

    @property
    def global_steps(self) -> int | None:
        return getattr(self.stream, "global_steps", None)

    async def base(self) -> AsyncIterator[NamedTensor]:
        async for name, tensor in self.stream:
            if is_adapter_tensor(name):
                self.first_adapter = (name, tensor)
                return
            yield name, tensor
        self.ended = True

    async def rest(self) -> AsyncIterator[NamedTensor]:
        if self.first_adapter is not None:
            first, self.first_adapter = self.first_adapter, None
            yield first
        if not self.ended:
            async for item in self.stream:
                yield item
            self.ended = True


class _Tagged:
    """An async iterator with the stream's ``global_steps`` attribute (what ``ModelRolloutAdapter`` reads)."""

    def __init__(self, items: AsyncIterator[NamedTensor], split: _Split) -> None:
        self.items, self.split = items, split

    @property
    def global_steps(self) -> int | None:
        return self.split.global_steps

    def __aiter__(self):
        return self

    async def __anext__(self) -> NamedTensor:
        return await self.items.__anext__()


class LoraPlacement:
    """The ``ReceivePlacement`` of a :class:`LoraRolloutAdapter`: each tensor's view in its part's staging bank."""

    def __init__(self, adapter: LoraRolloutAdapter) -> None:
        self._adapter = adapter

    def target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        part = self._adapter.adapter if is_adapter_tensor(name) else self._adapter.base
        return None if part is None else part.staging_target(name, dtype, shape)


class LoraRolloutAdapter:
    """Rollout side of LoRA updates into a live module (see the module overview).

    ``atomic`` is the base's mode (:class:`~ckpt.serving.ModelRolloutAdapter`); the adapter is always swapped whole.
    The LoRA layers are put in by the first ``peft_config`` (or ``peft_config`` here); a later one must agree on
    :data:`SHAPE_FIELDS`. ``served_step`` is the adapter's step, ``None`` while no base was received."""

    def __init__(self, module: nn.Module, atomic: bool = True, peft_config: Mapping[str, Any] | None = None) -> None:
        self.module = module
        self.base = ModelRolloutAdapter(TensorHolder(named_weights(module)), atomic=atomic)  # plain names
        self.adapter: ModelRolloutAdapter | None = None
        self.peft_config: dict[str, Any] | None = None  # the served adapter's (plain_peft_config)
        self.device, self.atomic = self.base.device, atomic
        self.receive_placement = LoraPlacement(self)
        if peft_config is not None:
            self._attach(peft_config)

    def _attach(self, peft_config: Mapping[str, Any]) -> None:
        self.adapter = ModelRolloutAdapter(TensorHolder(inject_lora(self.module, peft_config)), atomic=True)
        self.peft_config = plain_peft_config(peft_config)

    @property
    def needs_base(self) -> bool:
        """No whole base is served (none received yet, or an in-place base update failed part way)."""
        return self.base.served_step is None

    @property
    def served_step(self) -> int | None:
        if self.needs_base or self.adapter is None:
            return None
        return self.adapter.served_step

    @property
    def degraded(self) -> str | None:
        return self.base.degraded or (self.adapter.degraded if self.adapter is not None else None)

    @property
    def layout(self) -> Any:
        return self.base.layout

    @property
    def staging(self) -> torch.Tensor:
        return self.base.staging

    def memory(self) -> AdapterMemory:
        """The base's and the adapter's banks together (the adapter's spread over the base's bank count)."""
        base = self.base.memory()
        extra = self.adapter.memory() if self.adapter is not None else None
        adapter_bytes = 0 if extra is None else -(-extra.total_bytes // base.banks)
        return AdapterMemory(model_bytes=base.model_bytes + (extra.model_bytes if extra else 0), banks=base.banks,
                             bank_bytes=base.bank_bytes + adapter_bytes,
                             staging_bytes=base.staging_bytes + (extra.staging_bytes if extra else 0),
                             last_copied_bytes=base.last_copied_bytes + (extra.last_copied_bytes if extra else 0))

    def state_dict(self, with_base: bool = True) -> dict[str, torch.Tensor]:
        """Return the tensors in service: the base's (unless ``with_base`` is false), then the adapter's."""
        out = self.base.state_dict() if with_base else {}
        if self.adapter is not None:
            out.update(self.adapter.state_dict())
        return out

    def _check_config(self, peft_config: Mapping[str, Any] | None) -> None:
        if peft_config is None:
            raise CheckpointConfigError("this rollout serves a LoRA adapter: an update needs peft_config (verl's "
                                        "keyword), got None; nothing applied")
        if self.adapter is None:
            self._attach(peft_config)
            return
        differ = config_differences(self.peft_config, peft_config)
        if differ:
            raise WeightMismatchError(f"the adapter does not fit the served one: {', '.join(differ)}; refused, the "
                                      f"adapter of step {self.served_step} stays in service")

    async def update_weights(self, weights: AsyncIterator[NamedTensor], global_steps: int | None = None,
                             wire_format: str = "named_tensors", *, peft_config: Mapping[str, Any] | None = None,
                             base_sync_done: bool = False, **_verl_kwargs: Any) -> None:
        """Load one update (verl's keywords): the adapter alone (``base_sync_done``), else the base, then any
        adapter tensors that follow it.

        The whole stream is consumed even after an error. Raises :class:`WeightMismatchError` for an adapter that
        does not fit (rank, targets, a tensor's shape) and :class:`CheckpointConfigError` for an adapter while no
        base is served; what stays in service is said in the module overview."""
        try:
            if wire_format != "named_tensors":
                raise CheckpointConfigError(f"LoraRolloutAdapter takes wire_format 'named_tensors', got {wire_format!r}")
            check_global_steps(global_steps)
            self._check_config(peft_config)
            if base_sync_done and self.needs_base:
                raise CheckpointConfigError(
                    "an adapter update (base_sync_done=True) reached a rollout that serves no base; refused: the base "
                    "(base_sync_done=False) must come first")
        except Exception:
            await drain(weights)
            raise
        if base_sync_done:
            await self.adapter.update_weights(weights, global_steps)
            return
        split = _Split(weights)
        try:
            await self.base.update_weights(_Tagged(split.base(), split), global_steps)
        except BaseException:
            await drain(split.rest())
            raise
        rest = split.rest()
        first = await anext(rest, None)
        if first is not None:
            await self.adapter.update_weights(_Tagged(_prepend(first, rest), split), global_steps)


async def _prepend(first: NamedTensor, rest: AsyncIterator[NamedTensor]) -> AsyncIterator[NamedTensor]:
    yield first
    async for item in rest:
        yield item


__all__ = ["ADAPTER_MARKER", "ADAPTER_NAME", "LoraPlacement", "LoraRolloutAdapter", "SHAPE_FIELDS", "TensorHolder",
           "adapter_misfits", "adapter_module", "config_differences", "inject_lora", "is_adapter_tensor", "lora_config", "plain_peft_config"]
