"""DeepSeek-V3's parity and folder figures (docs/deepseek.md), printed from the tests' own models.

    python bench/deepseek_figures.py [--parity] [--folders]

``--parity``: for each of ``parity_tests/models/test_deepseek.py``'s two configs, torch_reference's
logits against transformers' ``DeepseekV3ForCausalLM`` (padded rows), then the Flax port against
torch_reference in both porting directions with a fully masked row (``compare``: logits and every
gradient). ``--folders``: for each of ``parity_tests/interop/test_deepseek_hf.py``'s odd configs, a
folder transformers saved read into Flax and into torch_reference, our export loaded back by
transformers, and an FP8 export read by both (errors relative to max(1, |logits|)). Both without a
flag. The tests assert these at 1e-5; this prints them. Folders go to a temporary directory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' models: parity_tests


def parity() -> None:
    import numpy as np
    import torch

    from flax_transformer.verification.compare import compare
    from parity_tests.models import test_deepseek as td

    for variant in td.VARIANTS:
        theirs = td.hf_model(variant)
        ours = td.reference_of(theirs)
        ids, mask, positions = td.padded(empty_rows=False)
        args = [torch.from_numpy(a) for a in (ids, mask, positions)]
        with torch.no_grad():
            want = theirs(args[0], attention_mask=args[1], position_ids=args[2], use_cache=False).logits.numpy()
            got = ours(*args).numpy()
        keep = mask.astype(bool)
        print(f"{variant}: torch_reference vs transformers, logits: {np.abs(want - got)[keep].max():.2e} "
              f"(scale {np.abs(want[keep]).max():.2f})")
        for direction, torch_side, flax_side in td.flax_pairs(ours):
            r = compare(torch_side, flax_side, td.padded(empty_rows=True), grads=True, tol=td.TOL)
            print(f"{variant}: Flax vs torch_reference ({direction}, a fully masked row): logits "
                  f"{r.max_abs_err:.2e} (scale {r.scale:.2f}), worst gradient {r.grad_err:.2e} of its scale, "
                  f"{'pass' if r.passed else 'FAIL'}")


def folders(root: Path) -> None:
    import numpy as np

    from flax_transformer.interop import hf
    from parity_tests.interop.test_deepseek_hf import CONFIGS, _err, hf_model, padded_inputs, transformers_load
    from parity_tests.interop.test_llama_hf import logits

    ids, mask = padded_inputs()
    for name, kwargs in CONFIGS.items():
        saved, out, fp8 = (root / f"{name}{tail}" for tail in ("", "-export", "-fp8"))
        reference = hf_model(**kwargs)
        reference.save_pretrained(saved)
        want = logits(reference, ids, mask)
        flax = hf.from_pretrained(saved)
        hf.save_pretrained(flax, out)
        again, report = transformers_load(out)
        hf.save_pretrained(flax, fp8, quantisation="fp8")
        theirs, report8 = transformers_load(fp8)
        w8 = logits(theirs, ids, mask)
        print(f"{name}: |logits| {np.abs(want).max():.2f}; read into Flax {_err(logits(flax, ids, mask), want):.1e}, "
              f"into torch_reference {_err(logits(hf.torch_from_pretrained(saved), ids, mask), want):.1e}; our export "
              f"in transformers {_err(logits(again, ids, mask), want):.1e} (loading report {report or 'clean'}); FP8: "
              f"ours vs transformers {_err(logits(hf.torch_from_pretrained(fp8), ids, mask), w8):.1e} "
              f"({report8 or 'clean'}), FP8 vs unquantised {_err(w8, want):.1e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parity", action="store_true", help="the parity figures only")
    parser.add_argument("--folders", action="store_true", help="the folder figures only")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    warnings.simplefilter("ignore")
    both = not (args.parity or args.folders)
    if args.parity or both:
        parity()
    if args.folders or both:
        with tempfile.TemporaryDirectory() as root:
            folders(Path(root))


if __name__ == "__main__":
    main()
