"""Pieces every torch_reference family shares: mask helpers, attention math, input checks.

Masks follow one convention inside this package (the same as flax_transformer's):
boolean, ``True`` = may attend, broadcastable to ``(batch, heads, q_len, k_len)``.
A family whose notebook uses another convention (additive, or True = masked out)
converts at its module boundary and says so in the docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flax_transformer.models.constructor_records import RecordsInit
from flax_transformer.models.state_dict_errors import StateDictError, check_state_dict_mapping

# transformers' ACT2FN names, as the llama family's configs give them
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class TorchStateDictError(StateDictError, RuntimeError):
    """``StateDictError`` that is also the ``RuntimeError`` torch's own loader raises."""


class Module(RecordsInit, nn.Module):
    """Base of every torch_reference module.

    Records its constructor arguments (for porting), and loads state_dicts all or
    nothing: torch's ``load_state_dict`` copies the matching keys before it raises on
    the rest; this one checks every key and shape first and reports them together.
    """

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        check_state_dict_mapping(state_dict)
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        mismatched = []
        for key, value in state_dict.items():
            if key not in own:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor; nothing was loaded")
            if tuple(value.shape) != tuple(own[key].shape):
                mismatched.append((key, tuple(value.shape), tuple(own[key].shape)))
            else:
                _check_value(key, value, own[key].dtype)
        if mismatched or (strict and (missing or unexpected)):
            raise TorchStateDictError(missing if strict else (), unexpected if strict else (), mismatched)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _check_value(key: str, value: torch.Tensor, target: torch.dtype) -> None:
    """Refuse a value the copy into a ``target`` parameter would change: complex, or beyond its range."""
    if value.is_complex() and not target.is_complex:
        raise TypeError(f"state_dict[{key!r}] is complex ({value.dtype}); parameters are real, and copying would "
                        "drop the imaginary part; nothing was loaded")
    if value.dtype == torch.bool or not target.is_floating_point or value.numel() == 0:
        return
    limit = torch.finfo(target).max
    info = torch.finfo(value.dtype) if value.is_floating_point() else torch.iinfo(value.dtype)
    if info.max <= limit:
        return
    magnitude = value.detach().abs()
    if value.is_floating_point():
        magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    largest = float(magnitude.max())
    if largest > limit:
        raise ValueError(f"state_dict[{key!r}] holds {largest:.6g}, beyond the range of the parameter's dtype "
                         f"{target} (max {limit:.6g}); it would become inf; nothing was loaded")


# ----------------------------------------------------------------------------- masks


def make_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, k_len) with 1/True = token, 0/False = pad  ->  bool (b, 1, 1, k_len)."""
    return attention_mask.bool()[:, None, None, :]


def make_causal_mask(length: int, device=None) -> torch.Tensor:
    """bool (1, 1, length, length), True on and below the diagonal."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of the masks that are not None (None if all are)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def normalize_mask(mask, batch: int, q_len: int, k_len: int, *, heads: int | None = None, name: str = "mask") -> torch.Tensor | None:
    """Check a user mask and bring it to bool (b|1, 1|h, q_len, k_len).

    Accepted shapes: (batch, k_len) padding mask (1 = token, 0 = pad); (batch, q_len,
    k_len); (batch, 1 or heads, 1 or q_len, k_len). Values must be bool or 0/1.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    shape = tuple(mask.shape)
    ok = (
        (mask.ndim == 2 and shape == (batch, k_len))
        or (mask.ndim == 3 and shape == (batch, q_len, k_len))
        or (mask.ndim == 4 and shape[0] in (1, batch) and shape[1] in (1, heads or shape[1])
            and shape[2] in (1, q_len) and shape[3] == k_len)
    )
    if not ok:
        raise ValueError(
            f"{name} has shape {shape}; expected (batch, length)=({batch}, {k_len}), "
            f"(batch, q_len, k_len)=({batch}, {q_len}, {k_len}) or (batch, 1|{heads or 'heads'}, 1|{q_len}, {k_len})"
        )
    if mask.dtype != torch.bool:
        if mask.dtype.is_complex:
            raise ValueError(f"{name} must be boolean or hold only 0 and 1")
        check_values((mask == 0) | (mask == 1), f"{name} must be boolean or hold only 0 and 1")
        mask = mask != 0
    if mask.ndim == 2:
        return make_padding_mask(mask)
    if mask.ndim == 3:
        return mask[:, None]
    return mask


# ------------------------------------------------------------------------- attention


def attend(q, k, v, mask=None, *, scale: float | None = None, dropout=None, softcap: float | None = None,
           sinks=None):
    """softmax(scale * q k^T) v with a boolean mask.

    Args:
        q: (b, h, q_len, d); k: (b, h, k_len, d); v: (b, h, k_len, d_v). Any leading
            dims that broadcast work.
        mask: bool, True = may attend, broadcastable to (b, h, q_len, k_len).
        scale: multiplies the scores; None when q and k already carry it.
        dropout: an ``nn.Dropout`` applied to the weights (None: no dropout).
        softcap: the scaled scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
        sinks: (h,) one logit per head that joins each row's softmax and takes its share of the
            probability, the rest going to the keys (GPT-OSS).

    Returns:
        out (b, h, q_len, d_v) and weights (b, h, q_len, k_len). A query row whose
        keys are all masked gets all-zero weights (so a zero output), never NaN.
    """
    scores = q @ k.transpose(-2, -1)  # (b, h, q, k)
    if scale is not None:
        scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # softmax statistics in fp32 whatever the compute dtype
    if sinks is None:
        weights = F.softmax(scores.float(), dim=-1).to(q.dtype)
    else:  # the sink is one more column of the softmax, dropped after
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = F.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    if mask is not None:
        # a fully masked row softmaxes to uniform weights over "min" scores: zero it
        weights = weights.masked_fill(~mask, 0.0)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ v, weights


def masked_mean(hidden, attention_mask=None):
    """Mean of (b, t, d) over the tokens whose mask is nonzero -> (b, d); a row with no token gives zeros."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    weight = (attention_mask != 0).to(hidden.dtype).unsqueeze(-1)  # (b, t, 1)
    return (hidden * weight).sum(dim=1) / weight.sum(dim=1).clamp(min=1.0)


# ---------------------------------------------------------------------- input checks
# A check of tensor *values* (ids in range, a mask of 0/1) needs the answer on the host:
# ``int(t.max())``, ``if t.all()``. Eager on the CPU that is free, and the check raises a
# ValueError naming the problem before anything is computed. Under ``torch.compile`` the same
# read is a graph break (and a warning) in every compiled model, and on a CUDA device it is a
# host-device synchronisation on every call. There the check is ``torch._assert_async``
# instead (what torch's own ``one_hot`` decomposition does): traced into the graph, evaluated
# where the tensor lives, and failing only when the values are wrong: a RuntimeError with the
# same message on the CPU (compiled), a device-side assert on CUDA (reported at the next
# synchronisation, and fatal to the process's CUDA context, as an out-of-range index into
# ``nn.Embedding`` on CUDA already is). Shape checks read no values and stay Python ``if``s.


def reads_values(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values on the host: eager (not compiling) and not on CUDA.

    Other devices (mps, xpu) keep the host read: ``torch._assert_async`` has CPU and CUDA
    kernels only.
    """
    return not torch.compiler.is_compiling() and t.device.type != "cuda"


def check_values(ok: torch.Tensor, message: str) -> None:
    """``ValueError(message)`` unless the boolean tensor ``ok`` is all True; see the note above."""
    if reads_values(ok):
        if not bool(ok.all()):
            raise ValueError(message)
    else:
        torch._assert_async(ok.all(), message)


def check_token_ids(ids, vocab_size: int, *, name: str = "input_ids") -> None:
    """Ids must be an integer (b, t) tensor with 0 <= id < vocab_size."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer token ids (int64 or int32, as nn.Embedding takes), got dtype {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, length), got {tuple(ids.shape)}")
    if not ids.numel():
        return
    if reads_values(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must lie in [0, {vocab_size}); found values in [{lo}, {hi}]")
    else:  # the values stay on the device: no range in the message (that would be the sync)
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(), f"{name} must lie in [0, {vocab_size})")


def check_features(x, features: int, *, name: str = "x") -> None:
    """A (b, t, features) float tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor of shape (batch, length, {features}), got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != features:
        raise ValueError(f"{name} must have shape (batch, length, {features}), got {tuple(x.shape)}")


def stacked_heads(x, layers) -> torch.Tensor:
    """(..., e) -> (..., h*d) through every head's own ``nn.Linear`` (e -> d), in one matmul.

    A head whose layer is not a plain ``nn.Linear`` (PEFT's ``lora.Linear`` wrapping it, or any
    hook-bearing subclass) is called, so that what wraps it runs: stacking its ``weight`` alone
    would silently skip the adapter."""
    if all(type(layer) is nn.Linear for layer in layers):
        weight = torch.cat([layer.weight for layer in layers])  # (h*d, e)
        bias = torch.cat([layer.bias for layer in layers])  # (h*d,)
        return F.linear(x, weight, bias)
    return torch.cat([layer(x) for layer in layers], dim=-1)
