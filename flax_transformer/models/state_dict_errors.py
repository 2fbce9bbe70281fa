"""A state_dict that does not fit a model: ``StateDictError`` lists every problem, and the mapping check.

Two shapes of a state_dict that a strict load would only list key by key are named: keys that start
with ``_orig_mod.`` (a ``torch.compile``'d model's state_dict: the error's first line says how to
strip it; a strict load does not strip it for you), and a training checkpoint dict
(``{"model": state_dict, "optimizer": ..., "step": ...}``, ``{"state_dict": ...}``): refused by the
in-memory loads, pointing at the entry; the file readers read the entry, with a warning naming it
and what was left out (``read_weights_entry``).

Pure Python (no JAX, no torch): torch_reference's loader and the porting layer raise the same error.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping


class StateDictError(ValueError):
    """A state_dict does not fit a model; the message lists every problem."""

    def __init__(self, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        lines = []
        if self.missing:
            lines.append(f"missing keys ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"unexpected keys ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        if self.mismatched:
            lines.append(f"shape mismatches ({len(self.mismatched)}): " + ", ".join(
                f"{k}: checkpoint {a} vs model {b}" for k, a, b in self.mismatched))
        if any(COMPILED_PREFIX in k for k in self.unexpected if isinstance(k, str)):
            lines.insert(0, COMPILED_HINT)
        super().__init__("state_dict does not match the model; nothing was loaded.\n  " + "\n  ".join(lines))


# torch.compile wraps a model in an OptimizedModule whose state_dict puts this before every key
COMPILED_PREFIX = "_orig_mod."
COMPILED_HINT = (f"keys start with `{COMPILED_PREFIX}` (a torch.compile'd model's state_dict): strip the prefix, "
                 "or save `model._orig_mod.state_dict()`")
# where training checkpoints keep the weights: {"model": state_dict, "optimizer": ..., "step": ...},
# Lightning's {"state_dict": ...}, {"model_state_dict": ...}
WEIGHTS_ENTRIES = ("model", "state_dict", "model_state_dict")


def weights_entry(state) -> str | None:
    """The entry of a training checkpoint dict that holds its state_dict, or None for anything else
    (a state_dict's values are all tensors; a training checkpoint also holds a step, an optimizer...)."""
    if not isinstance(state, Mapping) or all(hasattr(v, "shape") for v in state.values()):
        return None
    return next((e for e in WEIGHTS_ENTRIES if isinstance(state.get(e), Mapping)), None)


def read_weights_entry(state, where):
    """A file reader's state_dict of what a torch file held: a training checkpoint's weights entry,
    said in a warning that names what was left out (the optimizer, the step); anything else as it is."""
    entry = weights_entry(state)
    if entry is None:
        return state
    left = ", ".join(str(k) for k in state if k != entry)
    warnings.warn(f"{where} is a training checkpoint: its weights read from its {entry!r} entry"
                  + (f" (left out: {left})" if left else ""), stacklevel=3)
    return state[entry]


def check_state_dict_mapping(state) -> None:
    """A state_dict is a mapping with string keys (parameter names); anything else is a TypeError."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a state_dict must be a mapping of parameter names to arrays, got {type(state).__name__}")
    entry = weights_entry(state)
    if entry is not None:  # a strict load reads names: it does not guess which entry holds them
        error = StateDictError(unexpected=[str(k) for k in state])
        error.args = (f"a training checkpoint (entries: {', '.join(map(str, state))}), not a state_dict; nothing "
                      f"was loaded: its weights are its {entry!r} entry: load_state_dict(checkpoint[{entry!r}])",)
        raise error
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state_dict keys must be strings (parameter names); got {len(bad)} other keys: "
                        f"{', '.join(repr(k) for k in bad[:5])}")
