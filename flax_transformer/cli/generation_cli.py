"""``flax-transformer verify --checkpoint PATH --bisect-generate --prompt TEXT [--max-new-tokens N]``.

Loads the checkpoint's pair and tokenizer, runs ``generation_bisect.bisect_generation`` and prints
one line per step and the verdict: exit 0 when every step and the cache agree, 1 when not. A user
mistake is a ``ValueError`` (``commands`` prints it in one line, exit 2), raised before any work.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

DEFAULT_NEW_TOKENS = 16


def prompt_ids(checkpoint, text: str):
    """The prompt's ids as ``generate`` gives them to the same checkpoint (one rule for both:
    ``training.prompts.prompt_ids``): a ``train.lm`` run's through ``lm.prompt_ids``, a folder's through its
    own tokenizer (``prompts.folder_tokenizer``); the template's BOS kept, even before an empty prompt."""
    from flax_transformer.training import prompts

    path = Path(checkpoint)
    if (path / "run.json").is_file():
        from flax_transformer.training import lm
        from flax_transformer.training.rundir import config_of_run, read_tokenizer

        config = dataclasses.replace(config_of_run(path, "lm", lm.LMConfig), prompt=text)
        return lm.prompt_ids(config, read_tokenizer(path / "tokenizer.json"))
    tokens = prompts.folder_tokenizer(path)
    return prompts.prompt_ids(tokens.tokenizer, text, prefix=tokens.prefix)


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
    if not any((Path(args.checkpoint) / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ValueError(f"--prompt needs a checkpoint folder with a tokenizer.json (or tokenizer.model); "
                         f"{args.checkpoint} has none")
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
