"""Models for ``hal sync``: transformers' Qwen2 built from a published configuration, or a safetensors checkpoint.

Presets (``qwen2.5-0.5b``: Qwen/Qwen2.5-0.5B, 494M parameters; ``qwen2.5-tiny``: the same layout scaled down)
are randomly initialised as Hugging Face's ``_init_weights`` does, so nothing is downloaded; the trainer keeps
fp32 master weights and publishes bf16. A path (a ``.safetensors`` file or a directory of them, with
``model.safetensors.index.json`` honoured) trains every floating-point tensor toward fixed random targets.
transformers is the ``models`` extra.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hal.apps.errors import MissingFileError, UsageError, require_extra

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B config.json: 494M parameters, 0.99 GB in bf16 (tied embeddings published once).
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                         initializer_range=0.02, bos_token_id=151643, eos_token_id=151643),
    # Same layout and tensor names, scaled down for tests and quick runs (about 1.6 MB in bf16).
    "qwen2.5-tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                         initializer_range=0.02, bos_token_id=0, eos_token_id=0),
}

INDEX_NAME = "model.safetensors.index.json"


def _transformers():
    require_extra("transformers", "models", "the model presets")  # setup.sh installs it
    import transformers

    return transformers


def qwen2_config(preset: str):
    """``transformers.Qwen2Config`` of a preset (eager attention: the same kernels on trainer and rollouts)."""
    return _transformers().Qwen2Config(**PRESETS[preset], attn_implementation="eager")


def meta_causal_lm(preset: str, dtype: torch.dtype) -> nn.Module:
    """A ``Qwen2ForCausalLM`` of ``preset`` in ``dtype`` on the meta device."""
    with torch.device("meta"):
        module = _transformers().Qwen2ForCausalLM(qwen2_config(preset))
    return module.to(dtype)


def rebuild_rotary(module: nn.Module, device: torch.device | str) -> None:
    """Recompute a materialised Qwen2 model's rotary frequencies (garbage after ``to_empty``) on ``device``."""
    module.model.rotary_emb = type(module.model.rotary_emb)(config=module.config).to(device)


def causal_lm(preset: str, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int | None = 0) -> nn.Module:
    """A ``Qwen2ForCausalLM`` of ``preset`` in ``dtype`` on ``device``, materialised once: initialised as Hugging
    Face does from ``seed``, zeros for ``None``. Tied embeddings stay one tensor."""
    config = qwen2_config(preset)
    module = meta_causal_lm(preset, dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty materialises the two names separately: tie them again
        module.lm_head.weight = module.model.embed_tokens.weight
    rebuild_rotary(module, device)
    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if seed is None:
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.is_cpu and p.dtype == torch.float32:
                p.normal_(0.0, config.initializer_range, generator=g)
            else:  # the same numbers as on the host, whatever the device and dtype
                host = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, config.initializer_range, generator=g)
                p.copy_(host)
    return module.eval()


def prompt_ids(preset: str, length: int = 8, seed: int = 1234) -> torch.Tensor:
    """The fixed decode prompt of the greedy check: (1, length) int64 token ids."""
    vocab = PRESETS[preset]["vocab_size"]
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_decode(module: nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode ``new_tokens`` tokens after ``prompt`` with a fresh KV cache; returns ``(tokens, logits)``,
    the logits (new_tokens, vocab) float32 on the host."""
    import inspect

    device = next(module.parameters()).device
    # transformers 5 names the cache argument and output `cache`; 4.x `past_key_values`
    key = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
    step_ids, past = prompt.to(device), None
    chosen, rows = [], []
    for _ in range(new_tokens):
        out = module(input_ids=step_ids, use_cache=True, logits_to_keep=1, **({key: past} if past is not None else {}))
        last = out.logits[0, -1]
        token = int(last.argmax())
        chosen.append(token)
        rows.append(last.float().cpu())
        step_ids, past = torch.tensor([[token]], device=device), out[key]
    return chosen, torch.stack(rows)


class TensorModel(nn.Module):
    """Tensors of a checkpoint as parameters (floating point) and buffers (the rest), under their own names."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if tensor.is_floating_point():
                owner.register_parameter(leaf, nn.Parameter(tensor))
            else:
                owner.register_buffer(leaf, tensor)


def _target(name: str, like: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random target for tensor ``name`` (same on every call; stored nowhere)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & (2**62 - 1)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g, dtype=torch.float32).to(device=like.device, dtype=like.dtype)


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The ``.safetensors`` files of the checkpoint at ``path``: a file, the shards an index names, or every one
    in a directory, sorted. MissingFileError or UsageError name what is wrong."""
    index = path / INDEX_NAME if path.is_dir() else None
    if index is not None and index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"--model {str(path)!r}: {INDEX_NAME} has no readable weight_map ({exc!r})") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise MissingFileError(f"--model {str(path)!r}: {INDEX_NAME} lists shard {missing[0]!r}, which the "
                                    f"directory lacks ({len(missing)} of {len(shards)} shards missing)")
        files = [path / s for s in shards]
    else:
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise MissingFileError(f"--model {str(path)!r}: no such safetensors file or directory of them "
                                f"(presets: {', '.join(PRESETS)})")
    from safetensors import safe_open

    for file in files:  # read each header now: a wrong file is a usage error, not a crash in a rank
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad header; all mean the same
            raise UsageError(f"--model {str(path)!r}: {file} is not a safetensors file ({exc})") from None
    return files


def resolve_model(model: str) -> str:
    """The model ``--model`` names: a :data:`PRESETS` key (also in any letter case when no such path exists), or
    the checkpoint path as given; raises what :func:`safetensors_files` raises."""
    if model in PRESETS:
        return model
    path = pathlib.Path(model)
    if not path.exists():
        folded = {key.casefold(): key for key in PRESETS}
        if model.casefold() in folded:
            return folded[model.casefold()]
    safetensors_files(path)
    return model


def load_checkpoint(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` on the host (with an index, those it names, each from its
    shard)."""
    from safetensors.torch import load_file

    files = safetensors_files(path)
    index = path / INDEX_NAME if path.is_dir() else None
    if index is None or not index.is_file():
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    by_shard = {file.name: load_file(str(file)) for file in files}
    tensors = {}
    for name, shard in weight_map.items():
        if name not in by_shard[shard]:
            raise UsageError(f"--model {str(path)!r}: {INDEX_NAME} puts tensor {name!r} in {shard!r}, which lacks it")
        tensors[name] = by_shard[shard][name]
    return tensors


class TransposedHead(nn.Linear):
    """A bias-free ``nn.Linear`` head computing ``(W @ x^T)^T``: a tied embedding's gradient is then summed in
    place (``F.linear`` costs one more vocab x hidden fp32 tensor at the trainer's peak)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.mm(self.weight, flat.t()).t().reshape(*x.shape[:-1], self.weight.shape[0])


FSDP2_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"  # torch 2.13


def build(model: str, seed: int = 0) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The trainer's (module on the host, loss_fn(module) -> scalar) for a preset or a safetensors path.

    Presets: fp32 master weights on a fixed batch of 2 x 16 tokens, with a :class:`TransposedHead`; checkpoints
    keep their dtypes and regress toward fixed random targets.
    """
    torch.manual_seed(seed)
    if model in PRESETS:
        module = causal_lm(model, torch.float32, seed=seed).train()
        module.lm_head.__class__ = TransposedHead  # same parameter, same name: only its forward changes
        vocab = PRESETS[model]["vocab_size"]
        tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))

        def lm_loss(m: nn.Module) -> torch.Tensor:
            batch = tokens.to(next(m.parameters()).device)
            with warnings.catch_warnings():
                # TransposedHead's logits are a view (of mm(W, x^T)); FSDP2 warns that an in-place op on a view
                # it returns would skip its pre-backward hook. This loss only reads them (out of place).
                warnings.filterwarnings("ignore", FSDP2_VIEW_WARNING, UserWarning)
                logits = m(input_ids=batch[:, :-1], use_cache=False).logits.flatten(0, 1)
            return F.cross_entropy(logits.float(), batch[:, 1:].flatten())

        return module, lm_loss

    module = TensorModel(load_checkpoint(pathlib.Path(model)))

    def regression_loss(m: nn.Module) -> torch.Tensor:
        total = None
        for name, p in m.named_parameters():
            # in the tensor's own dtype: backward keeps no fp32 copies (4 x the weights' bytes for bf16)
            term = F.mse_loss(p, _target(name, p)).float()
            total = term if total is None else total + term
        if total is None:
            raise UsageError(f"--model {model!r} has no floating-point tensor to train")
        return total

    return module, regression_loss


def serving_model(model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A rollout's model before its first update (zeros): a preset's ``Qwen2ForCausalLM`` in ``dtype``, or a
    :class:`TensorModel` of a checkpoint's names, shapes and dtypes."""
    if model in PRESETS:
        return causal_lm(model, dtype, device=device, seed=None)
    from safetensors import safe_open

    path = pathlib.Path(model)
    files = safetensors_files(path)
    index = path / INDEX_NAME if path.is_dir() else None
    wanted = set(json.loads(index.read_text())["weight_map"]) if index is not None and index.is_file() else None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if wanted is not None and name not in wanted:
                    continue
                meta = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES[meta.get_dtype()]
                tensors[name] = torch.zeros(meta.get_shape(), dtype=dtype, device=device)
    return TensorModel(tensors)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def published(module: nn.Module, dtype: torch.dtype | None = None):
    """``(name, tensor)`` pairs a trainer publishes: parameters (tied ones once) then persistent buffers,
    floating-point ones cast to ``dtype``."""
    for name, p in module.named_parameters():
        t = p.detach()
        yield name, t if dtype is None or not t.is_floating_point() or t.dtype == dtype else t.to(dtype)
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers():
        if name in persistent:
            yield name, b.detach()


def num_bytes(module: nn.Module) -> int:
    """Bytes of the module's state_dict (tied tensors counted once per name, as they are published)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


__all__ = ["PRESETS", "INDEX_NAME", "TensorModel", "TransposedHead", "build", "causal_lm", "greedy_decode", "load_checkpoint", "meta_causal_lm",
           "num_bytes", "prompt_ids", "published", "qwen2_config", "rebuild_rotary", "resolve_model", "safetensors_files",
           "serving_model"]
