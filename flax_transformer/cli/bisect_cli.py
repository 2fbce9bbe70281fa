"""``flax-transformer verify --pair MODULE:FACTORY`` and ``verify --checkpoint PATH --bisect``.

Loading what the user names (a factory of their own, or a checkpoint and its tokenizer) and
printing ``compare.compare``'s or ``bisect.bisect``'s report; ``cli.py`` only parses flags.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flax_transformer.verification.certificate.subjects import call_factory


def load_model(path):
    """``training.run_loading.load_model``, imported when first needed (the CLI starts without JAX)."""
    from flax_transformer.training.run_loading import load_model as load

    return load(path)


def parse_renames(texts: list[str] | None) -> list[tuple[str, str]]:
    """``--rename REGEX=REPL`` (repeatable) as porting's ``[(regex, replacement), ...]``, checked
    (``layer_kinds.check_rename``: the same rule as ``porting.torch_to_flax(..., rename=)``).

    Each text is split at its first ``=`` that is not escaped (``\\=``, a literal ``=`` in the
    regex) and not part of a group's syntax (``(?=``, ``(?<=``, ``(?P=``).
    """
    from flax_transformer.interop.layer_kinds import check_rename

    pairs = []
    for text in texts or ():
        at = next((i for i, ch in enumerate(text) if ch == "=" and not text[:i].endswith(("\\", "(?", "(?<", "(?P"))),
                  None)
        if at is None or at == 0:
            raise ValueError(f"--rename must be REGEX=REPL (torch name pattern = the Flax model's torch name), "
                             f"got {text!r}")
        pairs.append((text[:at], text[at + 1:]))
    try:
        check_rename(pairs)  # a bad regex or replacement: one line naming it
    except ValueError as error:
        raise ValueError(f"--rename: {error}") from None
    return pairs


def text_inputs(folder, flax_model, texts: list[str]) -> tuple:
    """(ids, mask) of the texts through the checkpoint's own tokenizer.json, right-padded to one length."""
    from tokenizers import Tokenizer

    from flax_transformer.models.input_specs import input_spec

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tokenizer.no_padding()  # a tokenizer.json may pad to a fixed length (MiniLM's pads to 128)
    tokenizer.no_truncation()  # and cut at its own length (MiniLM's at 128): a longer text is refused below instead
    encodings = [tokenizer.encode(t).ids for t in texts]
    spec = input_spec(flax_model)
    longest = max(len(e) for e in encodings)
    if longest > spec.max_length:
        raise ValueError(f"--text is {longest} tokens; the model reads at most {spec.max_length}")
    if min(len(e) for e in encodings) == 0:
        raise ValueError("--text gives no tokens")
    ids = np.zeros((len(texts), longest), np.int64)
    mask = np.zeros((len(texts), longest), np.int64)
    for i, e in enumerate(encodings):
        ids[i, :len(e)], mask[i, :len(e)] = e, 1
    if ids.max() >= spec.vocab_size:
        raise ValueError(f"the tokenizer gives id {ids.max()}, beyond the model's vocabulary of {spec.vocab_size}")
    return ids, mask


def run(args) -> int:
    """``verify --pair`` (compare, or bisect with ``--bisect``) and ``verify --checkpoint --bisect``."""
    from flax_transformer.verification import bisect, compare, repro

    if getattr(args, "bisect_generate", False):
        from flax_transformer.cli import generation_cli

        return generation_cli.run(args)
    if args.pair and args.checkpoint:
        raise ValueError("--pair and --checkpoint exclude each other")
    if not (args.pair or args.checkpoint):
        raise ValueError("--bisect needs --checkpoint PATH or --pair MODULE:FACTORY")
    if args.text and not (args.checkpoint and args.bisect):
        raise ValueError("--text goes with --checkpoint PATH --bisect")
    if getattr(args, "rename", None) and not args.pair:
        raise ValueError("--rename goes with --pair MODULE:FACTORY (a checkpoint's names are the library's own)")
    rename = parse_renames(getattr(args, "rename", None))
    pictures = check_outputs(args)
    if getattr(args, "repro", None):  # verify_flags.mode has refused it without --bisect
        repro.check_directory(args.repro, overwrite=args.overwrite)
    torch_model, flax_model, call_args, call_kwargs = load_pair(args)
    what = args.pair or args.checkpoint
    allow = dict(allow_skipped=args.allow_skipped, allow_nonfinite=args.allow_nonfinite, rename=rename or None)
    try:
        if args.bisect:
            report = bisect.bisect(torch_model, flax_model, call_args, call_kwargs, grads=args.grads,
                                   use_jit=not args.no_jit, seed=args.seed, **allow)
        else:
            report = compare.compare(torch_model, flax_model, call_args, call_kwargs, grads=args.grads,
                                    use_jit=not args.no_jit, seed=args.seed, **allow)
    except SystemExit as stop:  # a model that exits while it is checked: no verdict, never exit 0
        raise ValueError(f"running {what} failed: the model called sys.exit({stop.code!r}) while it was checked; "
                         "nothing was compared") from None
    except Exception as error:  # the user's models, run (a KeyError, anything): one line, not a traceback
        message = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"running {what} failed: {type(error).__name__}: {message}") from None
    failed = write_outputs(args, report, pictures)  # compare's summary, printed, ends with pass or FAIL and why
    if getattr(args, "repro", None):
        print(write_repro(args.repro, report, torch_model, flax_model, call_args, call_kwargs,
                          use_jit=not args.no_jit, overwrite=args.overwrite))
    return 1 if failed else 0


def load_pair(args) -> tuple:
    """(torch model, Flax model, args, kwargs) of ``--pair`` or ``--checkpoint`` (``--text``, ``--dtype``), inputs as float32."""
    from flax_transformer.verification import certificate, measure
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    if args.text and not (Path(args.checkpoint) / "tokenizer.json").is_file():
        raise ValueError(f"--text needs a checkpoint folder with a tokenizer.json; {args.checkpoint} has none "
                         "(leave --text out for random ids)")
    if args.pair:
        torch_model, flax_model, call_args, call_kwargs = call_factory(args.pair)
    else:
        bare = Path(args.checkpoint).suffix in (".pt", ".bin", ".pth")  # its certificate says its model, as in verify
        dtype = getattr(args, "dtype", "fp32")
        if dtype != "fp32" and (bare or (Path(args.checkpoint) / "run.json").is_file()):
            raise ValueError(f"--dtype {dtype} takes an HF folder, a safetensors file or an orbax folder; "
                             f"{args.checkpoint} is a {'training run' if not bare else 'bare state_dict'} "
                             "(port it first: flax-transformer port SRC DST)")
        flax_model, torch_model = (certificate.certified_pair(args.checkpoint)
                                   if bare and certificate.find(args.checkpoint) else
                                   certificate_subjects.load_pair(args.checkpoint, load=load_model, dtype=dtype))
        call_args = (text_inputs(args.checkpoint, flax_model, args.text) if args.text
                     else certificate_subjects.example_inputs(flax_model, seed=args.seed))
        call_kwargs = {}
    return torch_model, flax_model, *(measure.fp32_inputs(tuple(call_args)), measure.fp32_inputs(call_kwargs))


def check_outputs(args) -> dict[str, str]:
    """``--json``, ``--html`` and ``--png`` checked before any work; returns {suffix: path} of the pictures."""
    from flax_transformer.interop import files

    if args.json:
        files.check_target(args.json, kind="file", overwrite=args.overwrite)
    pictures = {suffix: out for suffix, out in ((".html", getattr(args, "html", None)),
                                                (".png", getattr(args, "png", None))) if out}
    for suffix, out in pictures.items():  # verify_flags.mode has refused them without --bisect
        if Path(out).suffix != suffix:
            raise ValueError(f"--{suffix[1:]} must end in {suffix}, got {out}")
        files.check_target(out, kind="file", overwrite=args.overwrite)
    return pictures


def write_outputs(args, report, pictures: dict[str, str]) -> bool:
    """The report printed, and written as ``--json``, ``--html``, ``--png``; returns whether it failed."""
    from flax_transformer.interop import files
    from flax_transformer.verification import reports

    print(report)
    if getattr(report, "unverified", None):
        print(f"\nFAIL: not verified: {report.unverified}")
    if args.json:
        files.write_text(args.json, reports.json_text(report.to_dict()) + "\n", overwrite=args.overwrite)
        print(f"wrote {args.json}")
    if ".html" in pictures:
        report.to_html(pictures[".html"], overwrite=args.overwrite)
        print(f"wrote {pictures['.html']}")
    if ".png" in pictures:
        report.to_png(pictures[".png"], overwrite=args.overwrite)
        print(f"wrote {pictures['.png']}")
    return not report.passed


def write_repro(directory, report, torch_model, flax_model, call_args, call_kwargs, **options) -> str:
    """``--repro DIR``: the report's first divergent module written alone (``repro.write``); the line
    that says so, or why nothing was written (the report passed, a module no reproducer can hold)."""
    from flax_transformer.verification import repro

    try:
        written = repro.from_report(directory, report, torch_model, flax_model, call_args, call_kwargs, **options)
    except Exception as error:  # the user's models, run again, or a module jax.export cannot lower: one line
        message = (str(error).strip().splitlines() or [""])[0]
        return f"no reproducer written to {directory}: {type(error).__name__}: {message}"
    if written is None:
        why = "the report passed" if report.first_divergent is None else f"first_divergent is {report.first_divergent}"
        return f"no reproducer written to {directory}: {why}, no single module to reproduce"
    return f"wrote {written} (the reproducer of {report.first_divergent}: cd there and run python repro.py)"
