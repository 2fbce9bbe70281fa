"""Generation's arguments checked before anything runs, greedy decoding's threshold, prompt lengths from a mask.

Pure Python and numpy (no JAX, no torch): the Flax ``generate`` and torch_reference's loop share them.
"""

from __future__ import annotations

import numpy as np

from flax_transformer.models.arg_checks import is_integer, is_real, shown

# Below this temperature sampling is greedy decoding (its limit): float32's smallest normal
# number. Dividing logits by a smaller (subnormal) temperature overflows, or divides by a
# zero where denormals are flushed, and gave tokens that differ from greedy.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


def is_greedy(greedy: bool, temperature) -> bool:
    """Whether to decode greedily: asked for, or a temperature too small to divide by in float32."""
    return bool(greedy) or temperature < GREEDY_BELOW


def check_generate_args(max_new_tokens, temperature, top_k, top_p, greedy, eos_id, vocab, seed=0):
    """The sampling arguments, checked before anything runs (shared with the torch twin)."""
    integer = is_integer

    if not integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {shown(max_new_tokens)}")
    for name, value in (("top_k", top_k), ("eos_id", eos_id)):
        if value is not None and not integer(value):
            raise ValueError(f"{name} must be an integer, got {shown(value)}")
    if not integer(seed):
        raise ValueError(f"seed must be an integer, got {shown(seed)}")
    if not isinstance(greedy, (bool, np.bool_)):
        raise ValueError(f"greedy must be True or False, got {shown(greedy)}")
    if not is_real(temperature) or not 0 < temperature < float("inf"):
        if not (greedy and is_real(temperature)):
            raise ValueError(f"temperature must be > 0 and finite when sampling (or pass greedy=True), "
                             f"got {shown(temperature)}")
    if top_p is not None and (not is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {shown(top_p)}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must lie in [1, {vocab}], got {top_k!r}")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id must lie in [0, {vocab}), got {eos_id!r}")


def check_padding_mask(mask, shape, name: str) -> None:
    """A (batch, length) padding mask of exactly ``shape`` holding only 0 and 1 (or booleans)."""
    values = np.asarray(mask)
    if values.shape != tuple(shape):
        raise ValueError(f"{name} must have shape (batch, length)={tuple(shape)}, got {values.shape}")
    if not np.all((values == 0) | (values == 1)):
        raise ValueError(f"{name} must hold only 0 (pad) and 1 (token)")


def prompt_lengths(input_ids, attention_mask) -> np.ndarray:
    """Per-row prompt length from a right-padded (b, p) mask (1 = token); checks the padding side."""
    b, p = input_ids.shape
    if p == 0:
        raise ValueError("every prompt needs at least one token (a start token for an empty prompt)")
    if attention_mask is None:
        return np.full(b, p, np.int32)
    mask = np.asarray(attention_mask)
    if mask.shape != (b, p):
        raise ValueError(f"attention_mask must have shape (batch, length)=({b}, {p}), got {mask.shape}")
    if not np.all((mask == 0) | (mask == 1)):
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    lengths = mask.sum(axis=1).astype(np.int32)
    if np.any(mask != (np.arange(p)[None] < lengths[:, None])):
        raise ValueError("prompts must be right-padded: attention_mask rows must be 1s followed by 0s")
    if np.any(lengths == 0):
        raise ValueError("every prompt needs at least one token (a start token for an empty prompt)")
    return lengths
