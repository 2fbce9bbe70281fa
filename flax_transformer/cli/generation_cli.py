"""``flax-transformer verify --checkpoint PATH --bisect-generate --prompt TEXT [--max-new-tokens N]``.

Loads the checkpoint's pair and tokenizer, runs ``generation_bisect.bisect_generation`` and prints
one line per step and the verdict: exit 0 when every step and the cache agree, 1 when not. A user
mistake is a ``ValueError`` (``commands`` prints it in one line, exit 2), raised before any work.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_NEW_TOKENS = 16


def prompt_ids(folder, text: str) -> list[int]:
    """The prompt's ids through the checkpoint folder's own tokenizer.json, unpadded and uncut."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()  # a prompt too long for the model is refused by name, not cut
    ids = tokenizer.encode(text).ids
    if not ids:
        raise ValueError("--prompt gives no tokens")
    return ids


def run(args) -> int:
    from flax_transformer.interop import files
    from flax_transformer.training.run_loading import load_model  # as bisect_cli.load_model: run directories too
    from flax_transformer.verification import reports
    from flax_transformer.verification.certificate import subjects as certificate_subjects
    from flax_transformer.verification.generation_bisect import bisect_generation, check_inputs

    if not args.checkpoint:
        raise ValueError("--bisect-generate needs --checkpoint PATH (an HF folder or a run, with its tokenizer.json)")
    if args.prompt is None:
        raise ValueError("--bisect-generate needs --prompt TEXT")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"--prompt is not valid UTF-8 text: {ascii(args.prompt)}") from None
    new = DEFAULT_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    if new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {new}")
    if not (Path(args.checkpoint) / "tokenizer.json").is_file():
        raise ValueError(f"--prompt needs a checkpoint folder with a tokenizer.json; {args.checkpoint} has none")
    if args.json:
        files.check_target(args.json, kind="file", overwrite=args.overwrite)
    ids = prompt_ids(args.checkpoint, args.prompt)
    flax_model, torch_model = certificate_subjects.load_pair(args.checkpoint, load=load_model)
    check_inputs(flax_model, ids, new)  # a prompt too long, a model without a cache: one line, before any work
    try:
        report = bisect_generation(torch_model, flax_model, ids, new, use_jit=not args.no_jit,
                                   allow_skipped=args.allow_skipped)
    except Exception as error:  # the models, run: one line, not a traceback
        message = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"running {args.checkpoint} failed: {type(error).__name__}: {message}") from None
    print(report)
    if args.json:
        files.write_text(args.json, reports.json_text(report.to_dict()) + "\n", overwrite=args.overwrite)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
