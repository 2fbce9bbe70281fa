"""``flax-transformer verify``'s flags: what each one means, and which of them go together.

``add_parser`` declares them; ``mode`` reads a parsed command line and says which check runs
(``commands._verify`` runs it), refusing in one line the flags that belong to another check
(``--text`` without ``--bisect`` or ``--pair``, ``--family`` with ``--pair``, ...).
"""

from __future__ import annotations

FAMILIES = ("former", "encoder", "gpt", "classic", "llama", "moe", "gemma", "gpt_oss", "deepseek")

# what ``mode`` returns: the check that runs
CERTIFIED_PAIR = "certified pair"  # --checkpoint PATH --pair MODULE:FACTORY: your own model's certified export
PAIR = "pair"  # --pair or --bisect: bisect_cli
TRAIN_STEPS = "train steps"  # --train-steps K [--through-torch-state]
CHECKPOINT = "checkpoint"  # --checkpoint PATH
SOURCE = "source"  # --checkpoint CONVERTED --source ORIGINAL [--pair] [--bisect]: source_cli
TABLE = "table"  # every module (or with --grads every full model's gradients)
RECORD = "record"  # --record OUT (--checkpoint PATH | --pair MODULE:FACTORY) [--grads]: trace_cli
TRACE = "trace"  # --bisect --trace FILE (--checkpoint FLAXPATH | --pair MODULE:FACTORY): trace_cli
ADVISE = "advise precision"  # --advise-precision (--checkpoint PATH | --pair MODULE:FACTORY) [--target T]


def mode(args) -> str:
    """The check ``args`` asks for; raises ValueError for flags that do not go with it."""
    if getattr(args, "bisect_generate", False):  # run by bisect_cli, which hands it to generation_cli
        taken = [flag for flag, value in (("--bisect", args.bisect), ("--pair", args.pair), ("--grads", args.grads),
                                          ("--text", args.text), ("--train-steps", args.train_steps),
                                          ("--family", args.family), ("--rename", args.rename),
                                          ("--source", getattr(args, "source", None)),
                                          ("--html", getattr(args, "html", None)), ("--png", getattr(args, "png", None)),
                                          ("--repro", getattr(args, "repro", None)),
                                          ("--record", getattr(args, "record", None)),
                                          ("--trace", getattr(args, "trace", None)))
                 if value]
        if taken:
            raise ValueError(f"--bisect-generate takes no {', '.join(taken)} (it decodes one checkpoint's prompt)")
        return PAIR
    if getattr(args, "prompt", None) is not None or getattr(args, "max_new_tokens", None) is not None:
        raise ValueError("--prompt and --max-new-tokens go with --bisect-generate")
    if getattr(args, "advise_precision", False):
        return _advise_mode(args)
    if getattr(args, "target", None) is not None:
        raise ValueError("--target goes with --advise-precision")
    if getattr(args, "record", None) or getattr(args, "trace", None):
        return _trace_mode(args)
    if getattr(args, "source", None) is not None:
        return _source_mode(args)
    pictures = [flag for flag, value in (("--html", getattr(args, "html", None)), ("--png", getattr(args, "png", None)))
                if value]
    if pictures and not args.bisect:  # a picture of bisect's report: compare's has no modules to draw
        raise ValueError(f"{' and '.join(pictures)} go{'es' if len(pictures) == 1 else ''} with --bisect "
                         "(a picture of its report)")
    if getattr(args, "repro", None) and not args.bisect:
        raise ValueError("--repro DIR goes with --bisect (the first divergent module's reproducer)")
    if getattr(args, "dtype", "fp32") != "fp32" and (not args.checkpoint or args.pair or args.train_steps
                                                     or args.grads and not args.bisect):
        raise ValueError("--dtype goes with --checkpoint PATH [--bisect] (a --pair factory builds its Flax model at "
                         "its own dtype, and bisect reads it from the model; --grads with --bisect)")
    if args.checkpoint and args.pair and not args.bisect:
        if args.train_steps or args.family or args.text or args.json or args.rename or args.allow_skipped \
                or args.allow_nonfinite:
            raise ValueError("--checkpoint PATH --pair MODULE:FACTORY re-checks your own model's certified export; "
                             "it takes no --train-steps, --family, --text, --json, --allow-skipped, "
                             "--allow-nonfinite or --rename (the certificate records the rename)")
        return CERTIFIED_PAIR
    if args.bisect or args.pair:
        if args.train_steps or args.family:
            raise ValueError("--bisect and --pair take no --train-steps or --family")
        return PAIR
    if args.text or args.json or args.allow_skipped or args.allow_nonfinite or args.rename:
        raise ValueError("--text, --json, --allow-skipped, --allow-nonfinite and --rename go with --bisect or --pair")
    if args.through_torch_state and not args.train_steps:
        raise ValueError("--through-torch-state goes with --train-steps K")
    if args.train_steps:
        return TRAIN_STEPS
    return CHECKPOINT if args.checkpoint else TABLE


def _trace_mode(args) -> str:
    """``--record OUT`` (a trace of torch's side written) or ``--bisect --trace FILE`` (a Flax model
    bisected against one): the flags of other checks refused."""
    record, trace = getattr(args, "record", None), getattr(args, "trace", None)
    if record and trace:
        raise ValueError("--record OUT writes a trace and --trace FILE reads one: give one of them")
    if bool(args.checkpoint) == bool(args.pair):
        raise ValueError(f"{'--record OUT' if record else '--trace FILE'} needs one of --checkpoint PATH and --pair "
                         "MODULE:FACTORY" + (" (the Flax model to bisect)" if trace else " (the torch model to record)"))
    if trace and not args.bisect:
        raise ValueError("--trace FILE goes with --bisect (bisect a Flax model against the recorded trace)")
    if args.pair and getattr(args, "dtype", "fp32") != "fp32":
        raise ValueError("--dtype goes with --checkpoint PATH (a --pair factory builds its Flax model at its own dtype)")
    common = (("--train-steps", args.train_steps), ("--family", args.family),
              ("--through-torch-state", args.through_torch_state), ("--repro", getattr(args, "repro", None)),
              ("--source", getattr(args, "source", None)))
    only = (("--bisect", args.bisect), ("--json", args.json), ("--html", getattr(args, "html", None)),
            ("--png", getattr(args, "png", None)), ("--rename", args.rename), ("--allow-skipped", args.allow_skipped),
            ("--allow-nonfinite", args.allow_nonfinite), ("--no-jit", args.no_jit)) if record else (
        ("--text", args.text),)
    taken = [flag for flag, value in (*common, *only) if value]
    if taken:
        raise ValueError(f"{'--record OUT' if record else '--bisect --trace FILE'} takes no {', '.join(taken)} "
                         + ("(it runs torch only; bisect the trace with --bisect --trace OUT)" if record else
                            "(the trace holds the inputs, and a reproducer needs torch)"))
    return RECORD if record else TRACE


def _advise_mode(args) -> str:
    """``--advise-precision``: one model (``--checkpoint`` or ``--pair``); the flags of other checks refused."""
    if bool(args.checkpoint) == bool(args.pair):
        raise ValueError("--advise-precision needs one of --checkpoint PATH and --pair MODULE:FACTORY")
    taken = [flag for flag, value in (
        ("--bisect", args.bisect), ("--grads", args.grads), ("--train-steps", args.train_steps),
        ("--through-torch-state", args.through_torch_state), ("--family", args.family), ("--rename", args.rename),
        ("--allow-skipped", args.allow_skipped), ("--allow-nonfinite", args.allow_nonfinite),
        ("--no-jit", args.no_jit), ("--record", getattr(args, "record", None)),
        ("--trace", getattr(args, "trace", None)), ("--source", getattr(args, "source", None)),
        ("--html", getattr(args, "html", None)), ("--png", getattr(args, "png", None)),
        ("--repro", getattr(args, "repro", None)),
        ("--dtype", getattr(args, "dtype", "fp32") != "fp32" and args.pair)) if value]
    if taken:
        raise ValueError(f"--advise-precision takes no {', '.join(taken)} (it measures one bf16 model against "
                         "float64 torch; --target, --text, --seed and --json go with it)")
    if args.text and not args.checkpoint:
        raise ValueError("--text goes with --checkpoint PATH (a --pair factory gives its own inputs)")
    return ADVISE


def _source_mode(args) -> str:
    """``--source ORIGINAL``: a conversion checked against its source; the flags of other checks refused."""
    if not args.checkpoint:
        raise ValueError("--source ORIGINAL goes with --checkpoint CONVERTED (the conversion to check against it)")
    taken = [flag for flag, value in (("--train-steps", args.train_steps), ("--family", args.family),
                                      ("--grads", args.grads), ("--text", args.text), ("--rename", args.rename),
                                      ("--allow-skipped", args.allow_skipped),
                                      ("--allow-nonfinite", args.allow_nonfinite),
                                      ("--through-torch-state", args.through_torch_state),
                                      ("--dtype", getattr(args, "dtype", "fp32") != "fp32"),
                                      ("--html", getattr(args, "html", None)), ("--png", getattr(args, "png", None)),
                                      ("--repro", getattr(args, "repro", None)))
             if value]
    if taken:
        raise ValueError(f"--checkpoint CONVERTED --source ORIGINAL takes no {', '.join(taken)} (it compares the two "
                         "in fp32 on example inputs; --pair, --bisect, --seed and --json go with it)")
    return SOURCE


def add_parser(sub, func) -> None:
    """The ``verify`` subcommand and its flags, calling ``func(args)``."""
    p = sub.add_parser("verify", help="torch vs Flax parity table for every module of every family, or one checkpoint")
    p.add_argument("--checkpoint", help="verify one checkpoint (HF folder, safetensors or orbax) against its torch twin, "
                                        "and re-check its certificate (verification.json) if it has one")
    p.add_argument("--source", metavar="ORIGINAL",
                   help="with --checkpoint CONVERTED: is the conversion right? ORIGINAL (an HF folder, read by "
                        "transformers; a Meta folder; a torch state_dict or training checkpoint, or a safetensors "
                        "file, built by --pair or as CONVERTED's architecture) and CONVERTED run on the same inputs, "
                        "their logits and tensors compared; exit 1 naming the tensors that differ")
    p.add_argument("--family", action="append", choices=list(FAMILIES),
                   help="only this family (repeatable; default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    p.add_argument("--no-jit", action="store_true", help="run the Flax side eagerly instead of under jit")
    p.add_argument("--grads", action="store_true",
                   help="compare every parameter's gradient of every full model instead (error relative to the "
                        "gradient's scale)")
    p.add_argument("--train-steps", type=int, metavar="K", default=0,
                   help="instead, train each family's full model K steps with the notebooks' torch setup and with "
                        "the optax chain, and print both loss curves")
    p.add_argument("--through-torch-state", action="store_true",
                   help="with --train-steps K: K steps in one framework, a torch training checkpoint (Adam moments, "
                        "step, schedule), K in the other, against 2K uninterrupted; both ways")
    p.add_argument("--bisect", action="store_true",
                   help="with --checkpoint or --pair: every submodule's output (and with --grads every parameter's "
                        "gradient) against float64 torch, and the first module where Flax diverges")
    p.add_argument("--bisect-generate", action="store_true",
                   help="with --checkpoint and --prompt: decode greedily in torch fp32, torch fp64 and JAX with its "
                        "cache, and report the first step whose logits leave the budget, then the first module and "
                        "the first layer's cached keys/values that disagree there")
    p.add_argument("--prompt", help="with --bisect-generate: the text to continue, through the checkpoint's "
                                    "tokenizer.json")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="with --bisect-generate: how many steps to decode (default 16)")
    p.add_argument("--dtype", type=lambda name: {"float32": "fp32", "bfloat16": "bf16"}.get(name, name),
                   choices=("fp32", "bf16"), default="fp32",
                   help="with --checkpoint [--bisect]: the Flax model's compute dtype (default fp32); bf16 is judged "
                        "by bf16's budget, against torch run in bf16 (docs/verification.md, 'bf16 budgets')")
    p.add_argument("--pair", metavar="MODULE:FACTORY",
                   help="verify your own pair: FACTORY() in MODULE (a dotted module or a .py file) returns "
                        "(torch_model, flax_model, args) or (torch_model, flax_model, args, kwargs); with "
                        "--checkpoint PATH: re-check PATH, a certified export of that model, with them")
    p.add_argument("--text", action="append",
                   help="with --checkpoint --bisect: a text to run through the checkpoint's tokenizer.json "
                        "(repeatable: a batch; default: random ids)")
    p.add_argument("--allow-skipped", action="store_true",
                   help="with --bisect or --pair: pass a report in which some module calls, outputs or gradients "
                        "could not be compared (they are listed; by default they fail it)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="with --bisect or --pair: pass values that are NaN/inf in both frameworks alike (by default "
                        "they fail; NaN/inf on one side always fails)")
    p.add_argument("--rename", action="append", metavar="REGEX=REPL",
                   help="with --pair: torch names that differ from the Flax model's (repeatable, applied in order "
                        "with re.sub, as porting's rename=): module paths and gradients are matched through them")
    p.add_argument("--json", metavar="OUT", help="with --bisect or --pair: also write the report as JSON")
    p.add_argument("--html", metavar="OUT.html", help="with --bisect: also draw the report as one self-contained "
                                                      "HTML page (every module's errors on a log scale)")
    p.add_argument("--png", metavar="OUT.png", help="with --bisect: also draw the report as a PNG")
    p.add_argument("--repro", metavar="DIR",
                   help="with --bisect: write the first divergent module alone into the new folder DIR, a script and "
                        "data files that reproduce the divergence with only jax, torch and numpy (docs/reproducers.md)")
    p.add_argument("--record", metavar="OUT",
                   help="with --checkpoint PATH or --pair MODULE:FACTORY: run the torch model in float64 and at its "
                        "precision (--dtype) and write a trace folder (every module call, the weights' hashes, the "
                        "versions and device; with --grads every gradient) to bisect elsewhere (docs/traces.md)")
    p.add_argument("--trace", metavar="FILE",
                   help="with --bisect and --checkpoint FLAXPATH or --pair: bisect the Flax model against a trace "
                        "--record wrote, torch's side read from it (torch need not be installed)")
    p.add_argument("--advise-precision", action="store_true",
                   help="with --checkpoint or --pair: the modules a bf16 Flax model must keep in float32 for its "
                        "output to meet --target against float64 torch, searched by path and by kind, every set "
                        "measured (docs/precision-advisor.md); exit 1 when no set meets it")
    p.add_argument("--target", metavar="T",
                   help="with --advise-precision: 'budget' (the default: every output within 1 bf16 step of its "
                        "largest |float64| value; 'budget=N': N steps), 'kl=X' (a language model's mean per-token "
                        "KL against float64 torch) or 'top1=Y' (its top-1 agreement)")
    p.add_argument("--overwrite", action="store_true", help="replace --json, --html or --png OUT, --repro DIR or "
                                                            "--record OUT if it exists")
    p.set_defaults(func=func)
