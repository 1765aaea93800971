"""Fused Ascend operators of ``torch_npu`` that the simulated npu offers, as plain-torch compositions.

Only operators torch_npu documents and verl 0.9.1 calls (``npu_fusion_attention``: transformers imports it
unguarded), each computing its documented definition with autograd; ``tests/devices/test_torch_npu_compat.py``
checks each against a plain-torch reference. Other fused operators are absent, so ``hasattr`` probes fall back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(y, rstd)``: RMS normalisation of ``x`` over the trailing ``gamma.dim()`` dimensions, in float32.

    ``rstd = 1 / sqrt(mean(x**2) + epsilon)`` (shape ``x.shape[:-gamma.dim()] + (1,) * gamma.dim()``),
    ``y = x * rstd * gamma`` in ``x``'s dtype.
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
    """Return ``silu(a) * b`` of ``x``'s two halves ``a, b`` along ``dim`` (ValueError if that size is odd)."""
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: size {x.shape[dim]} along dim {dim} must be even")
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """Return the rotary position embedding ``x * r1 + rotate(x) * r2`` (``r1``, ``r2``: cos and sin tables).

    ``rotate``: ``cat(-x2, x1)`` of the last dimension's halves for ``"half"``; each pair ``(x[2i], x[2i+1])`` to
    ``(-x[2i+1], x[2i])`` for ``"interleave"``.
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


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0, return_zloss: bool = False):
    """Return ``(loss, log_prob, zloss, lse_for_zloss)``: cross-entropy from ``(N, C)`` logits, and log-softmax.

    ``loss`` as ``torch.nn.functional.cross_entropy``; ``log_prob`` float32 ``(N, C)``; the z-loss outputs are
    empty (NotImplementedError if one is requested).
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


_NO_BAND = 2147483647


def _heads_first(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """Return ``t`` in ``layout`` with ``heads`` heads as ``(B, N, S, D)``."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise ValueError(f"npu_fusion_attention: input_layout must be BSH, SBH, BSND, BNSD or TND, got {layout!r}")


def _heads_back(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Return ``(B, N, S, D)`` ``t`` in ``layout``."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2)
    return t.permute(2, 0, 1, 3).flatten(2)  # SBH


def _attend(q, k, v, scale, sparse_mode, atten_mask):
    """Attend ``(B, N, Sq, D)`` x ``(B, Nkv, Skv, D)`` in float32; return (out, row max, row sum)."""
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    sq, skv = scores.shape[-2:]
    if sparse_mode in (2, 3):  # causal; 2 aligned top-left, 3 aligned bottom-right
        offset = 1 if sparse_mode == 2 else skv - sq + 1
        mask = torch.ones(sq, skv, dtype=torch.bool, device=scores.device).triu(offset)
    else:
        mask = None if atten_mask is None else atten_mask.to(torch.bool)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_sum = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, row_max, row_sum


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse=None, padding_mask=None, atten_mask=None, scale: float = 1.0,
                         keep_prob: float = 1.0, pre_tockens: int = _NO_BAND, next_tockens: int = _NO_BAND,
                         inner_precise: int = 0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                         sparse_mode: int = 0, gen_mask_parallel: bool = True, sync: bool = False):
    """Return torch_npu's fused attention ``softmax(q @ k^T * scale, masked) @ v`` and its softmax statistics.

    Layouts: ``"BSND"``, ``"BNSD"``, ``"BSH"``, ``"SBH"``, ``"TND"`` (with ``actual_seq_qlen`` / ``actual_seq_kvlen``
    cumulative end offsets); ``key``/``value`` may have fewer heads. ``atten_mask``: ``True`` = masked out, used
    with ``sparse_mode=0``; 2 and 3 derive a causal mask (top-left / bottom-right). Returns ``(attention_out,
    softmax_max, softmax_sum, softmax_out, seed, offset, numels)``: row max/sum float32 ``(B, N, Sq, 8)``
    (``(T, N, 8)`` for TND), an empty ``softmax_out``, ``0, 0, 0``. ``pse``, padding, prefix, dropout and bands
    raise NotImplementedError.
    """
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("npu_fusion_attention on npu-sim: pse, padding_mask and prefix are not supported")
    if keep_prob != 1.0:
        raise NotImplementedError(f"npu_fusion_attention on npu-sim: no dropout (keep_prob must be 1.0, got {keep_prob})")
    if sparse_mode not in (0, 2, 3) or (sparse_mode == 0 and (pre_tockens, next_tockens) != (_NO_BAND, _NO_BAND)):
        raise NotImplementedError(f"npu_fusion_attention on npu-sim: sparse_mode 0 (no band), 2 or 3 only, "
                                  f"got {sparse_mode}")
    if input_layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            raise ValueError("npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen")
        if sparse_mode == 0 and atten_mask is not None:
            raise NotImplementedError("npu_fusion_attention on npu-sim: TND takes no explicit mask (use sparse_mode 2/3)")
        outs, maxes, sums = [], [], []
        q0 = k0 = 0
        for q1, k1 in zip(actual_seq_qlen, actual_seq_kvlen):
            q1, k1 = int(q1), int(k1)
            o, m, s = _attend(query[q0:q1].transpose(0, 1)[None], key[k0:k1].transpose(0, 1)[None],
                              value[k0:k1].transpose(0, 1)[None], scale, sparse_mode, None)
            outs.append(o[0].transpose(0, 1))
            maxes.append(m[0].transpose(0, 1))
            sums.append(s[0].transpose(0, 1))
            q0, k0 = q1, k1
        out, row_max, row_sum = torch.cat(outs), torch.cat(maxes), torch.cat(sums)
    else:
        kv_heads = head_num * key.shape[-1] // query.shape[-1]  # BSH/SBH: same head size for q, k and v
        q = _heads_first(query, input_layout, head_num)
        k = _heads_first(key, input_layout, kv_heads)
        v = _heads_first(value, input_layout, kv_heads)
        o, row_max, row_sum = _attend(q, k, v, scale, sparse_mode, atten_mask)
        out = _heads_back(o, input_layout)
    empty = query.new_empty((0,), dtype=torch.float32)
    return out, row_max.expand(*row_max.shape[:-1], 8), row_sum.expand(*row_sum.shape[:-1], 8), empty, 0, 0, 0


# Name -> implementation of every fused operator the compatibility torch_npu exposes.
FUSED_OPS = {fn.__name__: fn for fn in (npu_rms_norm, npu_swiglu, npu_rotary_mul, npu_cross_entropy_loss,
                                        npu_fusion_attention)}
