"""``flax-transformer verify --record OUT`` and ``verify --bisect --trace FILE``.

``--record OUT (--checkpoint PATH | --pair MODULE:FACTORY) [--grads] [--dtype bf16]`` runs the torch
model where torch is (``trace.record``) and writes a trace folder; ``--bisect --trace FILE
(--checkpoint FLAXPATH | --pair MODULE:FACTORY)`` bisects a Flax model against it
(``trace_bisect.bisect``), torch's side read from the trace: ``--checkpoint`` loads the Flax model
alone, without torch. ``verify_flags.mode`` has refused the flags of other checks; this module
loads what the user names and prints.
"""

from __future__ import annotations

from pathlib import Path

from flax_transformer.cli import bisect_cli


def run(args) -> int:
    return record(args) if args.record else bisect(args)


def record(args) -> int:
    """``--record OUT``: the trace of the torch model of ``--pair`` or ``--checkpoint``, at ``--dtype``
    (a ``--pair``'s: its Flax model's precision), with ``--grads`` its gradients too."""
    from flax_transformer.interop import files
    from flax_transformer.verification import precision, trace

    files.check_target(args.record, kind="dir", overwrite=args.overwrite)  # before any work
    torch_model, flax_model, call_args, call_kwargs = bisect_cli.load_pair(args)
    rule = precision.of_model(flax_model) if args.pair else precision.PRECISIONS[args.dtype]
    try:
        path = trace.record(torch_model, call_args, args.record, call_kwargs, grads=args.grads, seed=args.seed,
                            precision=rule, overwrite=args.overwrite)
    except Exception as error:  # the user's model, run: one line, not a traceback
        message = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"recording {args.pair or args.checkpoint} failed: {type(error).__name__}: {message}") from None
    found = trace.read(path, verify=False)
    size = sum(entry["bytes"] for entry in found.index["shards"].values())
    env = found.environment
    print(f"wrote {path}: {len(found.index['calls'])} module calls of torch {env['torch']} on {env['device_name']}, "
          f"{rule.name}{', with gradients' if args.grads else ''}; {size / 1e6:.1f} MB in "
          f"{len(found.index['shards'])} shard(s)")
    print(f"bisect a Flax model against it: flax-transformer verify --bisect --trace {path} --checkpoint FLAXPATH")
    return 0


def bisect(args) -> int:
    """``--bisect --trace FILE``: the Flax model of ``--checkpoint`` (alone) or ``--pair`` against the trace."""
    import jax.numpy as jnp

    from flax_transformer.verification import trace, trace_bisect

    rename = bisect_cli.parse_renames(args.rename)
    pictures = bisect_cli.check_outputs(args)
    found = trace.read(args.trace)  # the whole trace checked before any model is loaded
    if args.grads and not found.grads:
        raise ValueError(f"--grads: the trace {args.trace} was recorded without gradients (record it with --grads)")
    if args.pair:
        from flax_transformer.verification.certificate.subjects import call_factory

        flax_model = call_factory(args.pair)[1]
    else:
        if args.dtype != "fp32" and (Path(args.checkpoint) / "run.json").is_file():
            raise ValueError(f"--dtype {args.dtype} takes an HF folder, a safetensors file or an orbax folder; "
                             f"{args.checkpoint} is a training run (port it first: flax-transformer port SRC DST)")
        flax_model = bisect_cli.load_model(args.checkpoint, **({} if args.dtype == "fp32" else
                                                               {"dtype": jnp.bfloat16}))
    try:
        report = trace_bisect.bisect(args.trace, flax_model, grads=args.grads, use_jit=not args.no_jit,
                                     allow_skipped=args.allow_skipped, allow_nonfinite=args.allow_nonfinite,
                                     rename=rename or None, verify=False)
    except ValueError:
        raise
    except Exception as error:  # the user's model, run (a KeyError, anything): one line, not a traceback
        message = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"running {args.pair or args.checkpoint} failed: {type(error).__name__}: {message}") from None
    return 1 if bisect_cli.write_outputs(args, report, pictures) else 0
