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

from .loop import NonFiniteLoss, RunError, initialize_distributed, parse_mesh


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
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="one process of a multi-process run (with --num-processes, --process-id): start the "
                             "same command in each, with --mesh covering all their devices; process 0 serves "
                             "HOST:PORT and alone writes the run's files")
    parser.add_argument("--num-processes", type=int, default=None, metavar="N")
    parser.add_argument("--process-id", type=int, default=None, metavar="I", help="0 .. N-1")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# flags that are not config fields (a resumed run may change them: the mesh, the processes)
_RUN_FLAGS = {"preset", "out", "resume", "data_dir", "export_torch", "export_hf", "no_progress", "mesh",
              "coordinator", "num_processes", "process_id"}
_PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")


def _check_process_flags(args) -> None:
    given = [name for name in _PROCESS_FLAGS if getattr(args, name, None) is not None]
    if not given:
        return
    if len(given) < len(_PROCESS_FLAGS):
        missing = [f"--{name.replace('_', '-')}" for name in _PROCESS_FLAGS if name not in given]
        raise SystemExit("error: --coordinator, --num-processes and --process-id go together; "
                         f"missing {' '.join(missing)}")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"error: --coordinator {args.coordinator!r}: expected HOST:PORT")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise SystemExit(f"error: --process-id {args.process_id} with --num-processes {args.num_processes}: "
                         "need 0 <= process id < number of processes")


def mesh_of(args):
    """The ``--mesh`` of the run, after joining its other processes when ``--coordinator`` is given.

    Call it before anything else touches JAX's devices (``jax.distributed`` must start first).
    """
    if args.coordinator is not None:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return parse_mesh(args.mesh)


def make_config(args, config_cls, presets, task: str, *, renames: dict | None = None):
    """The run's config from ``--preset`` (default small) or the resumed run, with the given flags applied."""
    renames = renames or {}
    _check_process_flags(args)
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
    """Run an entry point: clear one-line errors (exit 2), NaN loss (exit 3), Ctrl-C after saving (exit 130).

    Before anything computes, malloc is told to keep freed memory (``malloc.keep_freed_memory``:
    each train step would otherwise fault its temporaries' pages in again)."""
    from .malloc import keep_freed_memory

    keep_freed_memory()
    try:
        interrupted = function()
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except (RunError, OSError, ValueError) as error:  # OSError: missing files, failed downloads
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 130 if interrupted else 0
