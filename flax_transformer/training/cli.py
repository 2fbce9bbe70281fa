"""Flags shared by the ``train/`` entry points, and how they become a frozen config.

A config starts from ``--preset`` (or, with ``--resume`` and no preset, from the run's own
``run.json``), then every flag given on the command line replaces its field. A resumed
run whose resulting config differs from the saved one is refused (``prepare_run_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from .loop import NonFiniteLoss, RunError


def common_parser(description: str, presets) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", choices=list(presets), default=None,
                        help="model and run size: tiny (< 1 min on 2 CPU cores, for tests), small (the CPU "
                             "benchmark, the default), base (sized for a GPU)")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default runs/<task>-<preset>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer updates (overrides --epochs)")
    parser.add_argument("--epochs", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="data folder (default ../shared/data beside the repo when present, else a download)")
    parser.add_argument("--export-torch", type=Path, default=None, metavar="FILE.safetensors",
                        help="also write the trained weights as a torch_reference state_dict")
    parser.add_argument("--dtype", choices=["float32", "bf16"], default=None,
                        help="compute dtype (bf16: mixed precision, parameters and softmax/LayerNorm statistics fp32)")
    parser.add_argument("--attention", choices=["reference", "xla", "cudnn"], default=None,
                        help="attention math: the notebooks' (reference) or jax.nn.dot_product_attention")
    parser.add_argument("--mesh", default=None, metavar="data=N,fsdp=M",
                        help="shard over N*M devices: batches over all, parameters and optimizer state over fsdp")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# flags that are not config fields
_RUN_FLAGS = {"preset", "out", "resume", "data_dir", "export_torch", "export_hf", "no_progress", "mesh"}  # a resumed run may change mesh


def make_config(args, config_cls, presets, task: str, *, renames: dict | None = None):
    """The run's config from ``--preset`` (default small) or the resumed run, with the given flags applied."""
    renames = renames or {}
    if args.resume and args.out is None:
        raise SystemExit("error: --resume needs --out RUN_DIR (the run to continue)")
    if args.resume and args.preset is None:
        try:
            saved = json.loads((args.out / "run.json").read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"error: --resume: {args.out} holds no readable run.json ({error})") from None
        saved.pop("task", None)
        fields = {f.name for f in dataclasses.fields(config_cls)}
        config = config_cls(**{k: v for k, v in saved.items() if k in fields})
    else:
        config = presets[args.preset or "small"]()
    changes = {}
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for name, value in vars(args).items():
        if name in _RUN_FLAGS or value is None:
            continue
        field = renames.get(name, name)
        if field not in fields:
            raise SystemExit(f"error: --{name.replace('_', '-')} does not apply to {task}")
        changes[field] = value
    if "epochs" in changes and "steps" not in changes and hasattr(config, "steps"):
        changes["steps"] = None  # --epochs alone decides the length (a preset's steps would win otherwise)
    if args.out is None:
        args.out = Path("runs") / f"{task}-{args.preset or 'small'}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None


def run_main(function):
    """Run an entry point: clear one-line errors (exit 2), NaN loss (exit 3), Ctrl-C after saving (exit 130)."""
    try:
        interrupted = function()
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except (RunError, OSError, ValueError) as error:  # OSError: missing files, failed downloads
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 130 if interrupted else 0
