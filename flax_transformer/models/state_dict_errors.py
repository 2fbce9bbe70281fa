"""A state_dict that does not fit a model: ``StateDictError`` lists every problem, and the mapping check.

Pure Python (no JAX, no torch): torch_reference's loader and the porting layer raise the same error.
"""

from __future__ import annotations

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
        super().__init__("state_dict does not match the model; nothing was loaded.\n  " + "\n  ".join(lines))


def check_state_dict_mapping(state) -> None:
    """A state_dict is a mapping with string keys (parameter names); anything else is a TypeError."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a state_dict must be a mapping of parameter names to arrays, got {type(state).__name__}")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"state_dict keys must be strings (parameter names); got {len(bad)} other keys: "
                        f"{', '.join(repr(k) for k in bad[:5])}")
