"""Fused Ascend operators of ``torch_npu`` that the simulated npu offers, as plain-torch compositions.

Only operators whose definition torch_npu documents and that verl 0.9.1 calls are here; each computes what
that definition says (autograd included, since it is built from differentiable torch operations), and
``tests/devices/test_torch_npu_compat.py`` checks each against an independent plain-torch reference.
Every other fused operator (``npu_fusion_attention``, ``npu_grouped_matmul``, MoE permutes, quantisers)
is absent from the compatibility module, so consumers that probe with ``hasattr`` take their fallback path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS normalisation over the trailing ``gamma.dim()`` dimensions of ``x``.

    ``rstd = 1 / sqrt(mean(x**2) + epsilon)``, ``y = x * rstd * gamma``, computed in float32.

    Args:
        x: ``(..., *gamma.shape)``, float16/bfloat16/float32.
        gamma: the scale, shape equal to ``x``'s trailing dimensions.
        epsilon: added to the mean square before the square root.

    Returns:
        ``(y, rstd)``: ``y`` of ``x``'s shape and dtype; ``rstd`` float32 of shape
        ``x.shape[:-gamma.dim()] + (1,) * gamma.dim()``.

    Raises:
        ValueError: ``gamma``'s shape is not ``x``'s trailing shape.
    """
    nd = gamma.dim()
    if nd == 0 or tuple(x.shape[-nd:]) != tuple(gamma.shape):
        raise ValueError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dimensions "
                         f"of x {tuple(x.shape)}")
    dims = tuple(range(-nd, 0))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: ``x`` split in two halves ``a, b`` along ``dim``; returns ``silu(a) * b``.

    Args:
        x: any float tensor whose size along ``dim`` is even.
        dim: the dimension to split.

    Returns:
        ``x``'s shape with ``dim`` halved, ``x``'s dtype.

    Raises:
        ValueError: the size along ``dim`` is odd.
    """
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: size {x.shape[dim]} along dim {dim} must be even")
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """Rotary position embedding: ``x * r1 + rotate(x) * r2``.

    ``rotate`` for ``rotary_mode="half"``: ``cat(-x2, x1)`` of the two halves of the last dimension; for
    ``"interleave"``: each pair ``(x[2i], x[2i+1])`` becomes ``(-x[2i+1], x[2i])``.

    Args:
        x: ``(..., D)`` with ``D`` even. r1, r2: the cos and sin tables, broadcastable to ``x``.
        rotary_mode: ``"half"`` or ``"interleave"``.

    Returns:
        A tensor of ``x``'s shape (the broadcast dtype of the inputs).

    Raises:
        ValueError: an unknown ``rotary_mode`` or an odd last dimension.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"npu_rotary_mul: the last dimension of x must be even, got {x.shape[-1]}")
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    return x * r1 + rotated * r2


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,  # noqa: A002
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0, return_zloss: bool = False):
    """Cross-entropy from logits, also returning the log-probabilities.

    Args:
        input: ``(N, C)`` logits, float16/bfloat16/float32. target: ``(N,)`` int64 class indices.
        weight: optional ``(C,)`` float32 class weights. reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: targets equal to it contribute 0. label_smoothing: in ``[0, 1]``.
        lse_square_scale_for_zloss, return_zloss: the z-loss; only ``0.0`` / ``False`` are supported here.

    Returns:
        ``(loss, log_prob, zloss, lse_for_zloss)``: ``loss`` as ``torch.nn.functional.cross_entropy`` with the
        same arguments (``(N,)`` for ``"none"``, else a scalar), ``log_prob`` the ``(N, C)`` float32
        log-softmax of ``input``; ``zloss`` and ``lse_for_zloss`` empty (no z-loss requested).

    Raises:
        NotImplementedError: a z-loss was requested (the sim does not compute it).
        ValueError: an unknown ``reduction``.
    """
    if lse_square_scale_for_zloss != 0.0 or return_zloss:
        raise NotImplementedError("npu_cross_entropy_loss on npu-sim computes no z-loss "
                                  "(lse_square_scale_for_zloss must be 0.0 and return_zloss False)")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"npu_cross_entropy_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    log_prob = torch.log_softmax(input.float(), dim=-1)
    loss = F.cross_entropy(input.float(), target, weight=weight, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    empty = input.new_empty((0,), dtype=torch.float32)
    return loss.to(input.dtype), log_prob, empty, empty


FUSED_OPS = {fn.__name__: fn for fn in (npu_rms_norm, npu_swiglu, npu_rotary_mul, npu_cross_entropy_loss)}
"""Name -> implementation of every fused operator the compatibility ``torch_npu`` exposes."""
