"""Reproduce one module's divergence from float64, with only jax, torch and numpy installed.

``flax_transformer.verification.repro.write`` copies this file into a reproducer folder as
``repro.py``; it imports nothing of flax_transformer. It runs the JAX module
(``jax_module.jaxexport``, ``jax.export``'s serialization, which needs the ``flatbuffers``
package) and the torch module (``torch_module.pt2``, ``torch.export.load``; the saved torch
output where the folder has none) on the saved inputs, compares each with the saved float64
output, and prints the errors and the budget (``module.json``'s rule: JAX may be ``slack`` times
less accurate than torch at the same precision, or within ``floor_ulps`` steps of the output's
largest magnitude).

    python repro.py        exit 1: the divergence reproduces; 0: it does not; 2: it cannot run here
"""

import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def err(got, want) -> float:
    """max |got - want| in float64; equal values (infinities too) and NaN on both sides count as 0,
    NaN on one side as infinite."""
    import numpy as np

    out = 0.0
    for a, b in zip(got, want):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        with np.errstate(invalid="ignore"):
            d = np.atleast_1d(np.abs(a64 - b64))
        d[np.atleast_1d((a64 == b64) | (np.isnan(a64) & np.isnan(b64)))] = 0.0
        out = max(out, float(np.nan_to_num(d, nan=np.inf).max(initial=0.0)))
    return out


def scale(arrays) -> float:
    """max |finite value| of the float64 outputs."""
    import numpy as np

    values = [np.abs(np.asarray(a, np.float64)).ravel() for a in arrays]
    return max((float(v[np.isfinite(v)].max(initial=0.0)) for v in values), default=0.0)


def to_torch_layout(a, how: dict):
    """A JAX output in torch's layout: its axes moved (channels last), its features reordered (Meta's RoPE)."""
    import numpy as np

    if how.get("axes") is not None:
        a = np.transpose(a, how["axes"])
    if how.get("features") is not None:
        a = np.take(a, how["features"], axis=-1)
    return a


def main() -> int:
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import torch
        from jax import export
    except ImportError as error:
        print(f"cannot run: {error} (pip install jax torch numpy flatbuffers)")
        return 2
    spec = json.loads((HERE / "module.json").read_text())
    bf16 = set(spec["bfloat16"])
    arrays = {name: np.load(HERE / name) for name in ("flax_weights.npz", "inputs.npz", "outputs.npz")}

    def jax_array(file: str, key: str):
        a = arrays[file][key]
        return jnp.asarray(a.view(jnp.bfloat16) if f"{file}:{key}" in bf16 else a)

    rule = spec["rule"]
    name = spec["torch_path"] or "<model>"
    try:
        exported = export.deserialize(bytearray((HERE / "jax_module.jaxexport").read_bytes()))
    except Exception as error:  # flatbuffers missing, another jax's serialization
        print(f"cannot run: jax.export.deserialize failed: {type(error).__name__}: {error} (pip install flatbuffers)")
        return 2
    backend = jax.default_backend()
    if backend not in exported.platforms:
        print(f"cannot run: the JAX module was exported for {exported.platforms}, this machine runs {backend}")
        return 2
    weights = [jax_array("flax_weights.npz", k) for k in spec["jax"]["weights"]]
    inputs = [jax_array("inputs.npz", f"jax.{i}") for i in range(spec["jax"]["inputs"])]
    jax_out = [to_torch_layout(np.asarray(a, np.float64), how)
               for a, how in zip(exported.call(weights, inputs), spec["outputs"])]
    want = [arrays["outputs.npz"][f"float64.{i}"] for i in range(len(spec["outputs"]))]
    torch_dtype = getattr(torch, spec["torch"]["dtype"])
    if spec["torch"]["program"]:
        tensors = [torch.from_numpy(arrays["inputs.npz"][f"torch.{i}"]) for i in range(spec["torch"]["inputs"])]
        tensors = [t.to(torch_dtype) if t.is_floating_point() else t for t in tensors]
        program = torch.export.load(HERE / spec["torch"]["program"]).module()
        with torch.no_grad():
            torch_out = [t.detach().float().numpy() for t in program(*tensors)]
        torch_side = f"torch {torch.__version__} ({spec['torch']['dtype']}, cpu)"
    else:
        torch_out = [arrays["outputs.npz"][f"torch.{i}"] for i in range(len(spec["outputs"]))]
        torch_side = f"torch (saved output: {spec['torch']['why_not']})"
    torch_err, jax_err, size = err(torch_out, want), err(jax_out, want), scale(want)
    budget = max(rule["slack"] * torch_err, rule["floor_ulps"] * rule["eps"] * size)
    print(f"module {name}: {spec['constructor']['torch']['class']} (torch) / {spec['constructor']['flax']['class']} "
          f"(Flax at {spec['flax_path'] or '<model>'!r}), on its float64 reference input cast to {rule['precision']}")
    print(f"  JAX {jax.__version__} ({jax.devices()[0].device_kind}) vs float64: max abs error {jax_err:.3e}")
    print(f"  {torch_side} vs float64: max abs error {torch_err:.3e}")
    print(f"  budget {budget:.3e} = {rule['formula']} (max|float64| = {size:.3e})")
    when = spec["measured"]
    print(f"  when written: JAX {when['jax_err']:.3e}, torch {when['torch_err']:.3e}, budget {when['budget']:.3e}")
    if jax_err > budget:
        times = "" if budget == 0 else f" ({jax_err / budget:.3g} x the budget)"
        print(f"DIVERGENCE REPRODUCED: JAX's error {jax_err:.3e} is beyond the budget {budget:.3e}{times}")
        return 1
    print(f"no divergence: JAX's error {jax_err:.3e} is within the budget {budget:.3e}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # anything else that stops it here is no verdict: exit 2, never 1
        traceback.print_exc()
        print("cannot run: the error above stopped it (exit 2)")
        code = 2
    sys.exit(code)
