"""Models for ``hal sync``: a locally built preset with a real LLM's tensor layout, or any safetensors file.

* Presets build a decoder-only transformer with the tensor names, shapes and dtype of a published model
  (the Qwen2.5-0.5B layout: hidden 896, 24 layers, 14 query / 2 key-value heads of 64, MLP 4864, vocab
  151936, tied embeddings, q/k/v biases; figures from the model's public ``config.json``), randomly
  initialised, so no download is needed. It trains on a synthetic token batch with the next-token loss.
* A path (a ``.safetensors`` file, or a directory of them as Hugging Face ships) loads tensors whose
  architecture the tool need not know. Its loss pulls every floating-point tensor toward fixed random
  targets, so each optimizer step changes every floating-point tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pathlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hal.cli.errors import MissingFileError, UsageError


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape of a Qwen2-style decoder (names as in Hugging Face ``Qwen2Config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, DecoderConfig] = {
    # Qwen/Qwen2.5-0.5B config.json: 494M parameters, about 0.99 GB in bf16.
    "qwen2.5-0.5b": DecoderConfig(151936, 896, 4864, 24, 14, 2),
    # Same layout and tensor names, scaled down for tests and quick runs (about 9 MB in bf16).
    "qwen2.5-tiny": DecoderConfig(4096, 128, 352, 2, 4, 2),
}


class Linear(nn.Linear):
    """``nn.Linear`` that stores bf16 weights but multiplies in fp32.

    On CPUs without native bf16 matrix units (this project's CI machines, and the simulated npu, whose
    operators fall back to the CPU) the weight-gradient matmul of a bf16 linear layer with few tokens runs
    about 25x slower than in fp32 (measured on torch 2.13: 45 s against 2 s for one backward of the 0.5B
    layout). Parameters, gradients and published weights stay bf16; only the products are fp32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` with shape (batch, heads, seq, head_dim)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.k_proj = Linear(cfg.hidden_size, kv, bias=True)
        self.v_proj = Linear(cfg.hidden_size, kv, bias=True)
        self.o_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, c.hidden_size))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """``model.*`` + ``lm_head`` as in Hugging Face's ``Qwen2ForCausalLM`` (lm_head tied to embeddings)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 token ids -> (batch, seq, vocab) logits."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


class TensorModel(nn.Module):
    """Tensors of a checkpoint as parameters (floating point) and buffers (the rest), under their own names.

    Submodules are created along each dotted name, so ``state_dict()`` keys equal the checkpoint's keys.
    """

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
                owner.register_parameter(leaf, nn.Parameter(tensor.clone()))
            else:
                owner.register_buffer(leaf, tensor.clone())


def init_decoder(cfg: DecoderConfig, seed: int = 0) -> DecoderForCausalLM:
    """A bf16 decoder with Hugging Face's Qwen2 initialisation: normal(0, 0.02) weights (``initializer_range``),
    zero biases, unit norms. Built on the meta device first, so no time goes into a default init that
    would be overwritten (494M parameters for the 0.5B layout)."""
    with torch.device("meta"):
        module = DecoderForCausalLM(cfg)
    module = module.to_empty(device="cpu").to(torch.bfloat16)
    if cfg.tie_word_embeddings:  # to_empty materialises the two names separately: tie them again
        module.lm_head.weight = module.model.embed_tokens.weight
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    return module


def _target(name: str, like: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random target for tensor ``name`` (same on every call; stored nowhere)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & (2**62 - 1)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g, dtype=torch.float32).to(device=like.device, dtype=like.dtype)


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The ``.safetensors`` files at ``path`` (the file itself, or every one in a directory, sorted).

    Raises:
        MissingFileError: ``path`` does not exist or holds no ``.safetensors`` file.
        UsageError: a file's safetensors header cannot be read.
    """
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise MissingFileError(f"--model {str(path)!r}: no such safetensors file or directory of them "
                                f"(presets: {', '.join(PRESETS)})")
    from safetensors import safe_open

    for file in files:  # read each header now: a wrong file is a usage error, not a crash in a rank
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:
            raise UsageError(f"--model {str(path)!r}: {file} is not a safetensors file ({exc})") from None
    return files


def build(model: str, seed: int = 0) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """(module on the host, loss_fn(module) -> scalar) for a preset name or a safetensors path.

    Presets are bf16 and train on a fixed synthetic batch of 2 x 16 tokens; checkpoints keep their own
    dtypes and regress toward fixed random targets.

    Raises:
        MissingFileError: ``model`` is neither a preset nor an existing safetensors file/directory.
    """
    torch.manual_seed(seed)
    if model in PRESETS:
        cfg = PRESETS[model]
        module = init_decoder(cfg, seed)
        tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))

        def lm_loss(m: nn.Module) -> torch.Tensor:
            device = next(m.parameters()).device
            batch = tokens.to(device)
            logits = m(batch[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

        return module, lm_loss

    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(pathlib.Path(model)):
        tensors.update(load_file(str(file)))
    module = TensorModel(tensors)

    def regression_loss(m: nn.Module) -> torch.Tensor:
        total = None
        for name, p in m.named_parameters():
            term = F.mse_loss(p.float(), _target(name, p).float())
            total = term if total is None else total + term
        if total is None:
            raise UsageError(f"--model {model!r} has no floating-point tensor to train")
        return total

    return module, regression_loss


def num_bytes(module: nn.Module) -> int:
    """Bytes of the module's state_dict (tied tensors counted once per name, as they are published)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


__all__ = ["PRESETS", "DecoderConfig", "DecoderForCausalLM", "TensorModel", "build", "num_bytes",
           "safetensors_files"]
