"""``flax-transformer verify --advise-precision (--checkpoint PATH | --pair MODULE:FACTORY) [--target T]``.

Loads what the user names (``bisect_cli.load_pair``: a checkpoint with example inputs or ``--text``
through its tokenizer, or a factory's pair), starts from the Flax model computing in bfloat16 (a
float32 one has every module's ``dtype`` set to bfloat16 first, parameters as loaded) and prints
``advisor.advise_precision``'s report: exit 0 when the advised set meets the target, 1 when even
every candidate in float32 misses it. ``verify_flags.mode`` has refused the flags of other checks;
``--target`` is read before any model loads.
"""

from __future__ import annotations

from flax_transformer.cli import bisect_cli


def run(args) -> int:
    import jax.numpy as jnp
    from flax import nnx

    from flax_transformer.verification import advisor, precision

    target = advisor.Target.parse(args.target or "budget")  # a bad --target: one line, before any work
    bisect_cli.check_outputs(args)  # --json OUT, before any work
    torch_model, flax_model, call_args, call_kwargs = bisect_cli.load_pair(args)
    what = args.pair or args.checkpoint
    if precision.of_model(flax_model) is not precision.BF16:
        flax_model = advisor.apply(nnx.clone(flax_model), list(advisor.dtype_modules(flax_model)), jnp.bfloat16)
        print(f"{what}: its Flax model computes in float32; every module's dtype set to bfloat16 to start from "
              "(parameters as loaded)")
    mask = call_args[1] if args.text and len(call_args) > 1 else None  # the real tokens of --text
    try:
        report = advisor.advise_precision(torch_model, flax_model, call_args, call_kwargs, target=target,
                                          lm_mask=mask)
    except ValueError as error:  # a target that needs logits the model has not, an fp16 model: one line
        raise ValueError(f"--advise-precision on {what}: {error}") from None
    except Exception as error:  # the user's models, run: one line, not a traceback
        message = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"running {what} failed: {type(error).__name__}: {message}") from None
    return 1 if bisect_cli.write_outputs(args, report, {}) else 0  # the report printed, --json written
