"""``port SRC DST --verify``: the export written aside, reloaded from there and compared with SRC, and
swapped in only when the check passes.

A failed check leaves DST as it was (an earlier output intact, or nothing) and no new output, as a
failed write does (``interop.files``). The export and its certificate are written into a staging
folder beside DST (``.DST.ft-tmp-PID-...``: the same file system, so moving is a rename; one that a
killed port left is removed by the next write of DST), checked there, and moved into place whole
(``files.write_file`` / ``files.write_dir``: the certificate beside a file goes in with it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["against_transformers", "check", "staged", "wrote", "write_verified"]


def wrote(args, dst: Path, fmt: str, carried: list[str]) -> None:
    """The lines that say what ``port`` wrote."""
    from flax_transformer.verification import certificate

    print(f"wrote {dst} ({fmt}) " + ("without a certificate (--no-certify)" if args.no_certify
                                     else f"and its certificate {certificate.path_for(dst)}"))
    if carried:
        print(f"  with {args.src}'s tokenizer files: {', '.join(carried)}")


def write_verified(args, fmt: str, writer, flax_model, torch_model, dst: Path, options: dict,
                   carried: list[str]) -> int:
    """``port SRC DST --verify``: ``writer``'s export checked (``check``) where it was written aside, and
    moved to ``dst`` when it passes (0); when it fails, ``dst`` is unchanged (1)."""
    ok = staged(dst, lambda path: writer(flax_model, path, overwrite=False, certify=not args.no_certify, **options),
                lambda path: check(args, fmt, flax_model, torch_model, path, shown=dst), overwrite=args.overwrite)
    if ok:
        wrote(args, dst, fmt, carried)
    return 0 if ok else 1


def staged(dst: Path, write, passes, *, overwrite: bool) -> bool:
    """``write(path)`` into a staging folder beside ``dst``, then ``passes(path)``: True when the check
    passed and the output is now at ``dst``; False (said on a line) when it failed and ``dst`` is as it was.
    ``port --to peft/torch-state --verify`` (``run_ports``) write through it too."""
    from flax_transformer.interop import files

    stage = files.temp_name(dst)
    stage.mkdir()
    try:
        path = stage / dst.name
        write(path)
        if not passes(path):
            kept = "the one there is as it was" if os.path.lexists(dst) else "nothing is there"
            print(f"port: --verify failed, so {dst} was not written ({kept})")
            return False
        _move(path, dst, overwrite=overwrite)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return True


def _move(staged: Path, dst: Path, *, overwrite: bool) -> None:
    """The checked export from the staging folder to ``dst``, swapped in whole; a file's certificate
    beside it goes in with it (and an earlier certificate goes, when this export has none)."""
    from flax_transformer.interop import files
    from flax_transformer.verification import certificate

    if staged.is_dir():
        files.write_dir(dst, lambda tmp: [os.rename(p, tmp / p.name) for p in staged.iterdir()], overwrite=overwrite)
        return
    cert = certificate.path_for(staged)
    side = {cert.name: cert.read_bytes()} if cert.is_file() else None
    files.write_file(dst, lambda tmp: os.replace(staged, tmp), overwrite=overwrite,
                     before_swap=None if side is None else lambda tmp, path: side)
    if side is None:
        certificate.path_for(dst).unlink(missing_ok=True)  # an earlier export's would not describe these weights


def check(args, fmt: str, flax_model, torch_model, written: Path, *, shown: Path) -> bool:
    """Reload what was written at ``written``, independently of the model in memory, and compare it with
    SRC's torch model (and, for an HF SRC, with what transformers loads); lines name DST as ``shown``."""
    from flax_transformer.interop import checkpoints, hf
    from flax_transformer.verification import compare, reports
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    # bf16 weights are rounded: measured against SRC's fp32 model, they get hf.BF16_TOLERANCE (docs/porting.md)
    tolerance, what = (hf.BF16_TOLERANCE, " (bf16 weights)") if args.dtype == "bf16" else (reports.TOLERANCE, "")
    options = dict(tol=tolerance, fp64=args.dtype != "bf16")  # rounded weights: no float64 budget holds them
    if fmt == "torch":
        import torch

        reloaded = checkpoints.build(checkpoints.describe(flax_model), framework="torch")
        reloaded.load_state_dict(torch.load(written, weights_only=True))
        report = compare.compare(reloaded.eval(), flax_model, certificate_subjects.example_inputs(flax_model),
                                 **options)
    else:  # an HF folder of a classifier reloads as one (checkpoints.load reads its encoder)
        reloaded = (hf.classifier_from_pretrained(written) if fmt == "hf" and hf.kind_of(flax_model)[2]
                    else checkpoints.load(written))
        report = compare.compare(torch_model, reloaded, certificate_subjects.example_inputs(reloaded), **options)
    ok, out = report.passed, report.rows[0]  # the verdict, never the figures alone (an incomplete one fails)
    print(f"verify: max abs err {out.max_abs_err:.2e}{'' if out.finite else ' (NaN/inf)'} between {args.src} (torch) "
          f"and {shown}{what} (reloaded) -> {'pass' if ok else 'FAIL'} (tolerance {tolerance:g})"
          + ("" if ok else f": {report.summary().splitlines()[-1]}"))
    if Path(args.src).is_dir() and (Path(args.src) / "config.json").is_file():
        ok = against_transformers(args.src, shown, reloaded, tolerance, what) and ok
    return ok


def against_transformers(src, dst, reloaded, tolerance: float, what: str) -> bool:
    """``port --verify`` of an HF folder: what transformers itself loads from SRC against DST reloaded
    (a torch_reference model for a torch DST, else a Flax one), on the same random inputs. True when
    they agree, or when transformers is not installed (said on a line)."""
    import numpy as np

    from flax_transformer.interop import hf
    from flax_transformer.verification import verify
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        print(f"verify: transformers is not installed: {src} was not loaded by transformers")
        return True
    try:
        reference, missing = hf.transformers_from_pretrained(src)
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, the folder is not one it reads
        print(f"verify: transformers cannot load {src}: {type(error).__name__}: {str(error).splitlines()[0]} -> FAIL")
        return False
    ids, mask = certificate_subjects.example_inputs(reloaded)
    want = hf.transformers_output(reference, ids, mask)
    if isinstance(reloaded, torch.nn.Module):
        with torch.no_grad():
            got = reloaded(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()
    else:
        got = np.asarray(verify.flax_module_call(reloaded, ids, mask), dtype=np.float32)  # jitted
    finite = bool(np.isfinite(want).all() and np.isfinite(got).all())  # NaN never agrees with NaN
    err = float(np.max(np.abs(want - got))) if finite and want.shape == got.shape else float("inf")
    ok = finite and err <= tolerance
    note = f" (transformers initialised {len(missing)} missing keys: {', '.join(missing[:5])})" if missing else ""
    print(f"verify: max abs err {err:.2e}{'' if finite else ' (NaN/inf)'} between {src} (transformers) and "
          f"{dst}{what} (reloaded){note} -> {'pass' if ok else 'FAIL'} (tolerance {tolerance:g})")
    return ok
