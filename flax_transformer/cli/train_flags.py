"""Flags shared by the ``train/`` entry points, and how they become a frozen config.

A config starts from ``--preset`` (or, with ``--resume`` and no preset, from the run's own
``run.json``), then every flag given on the command line replaces its field. A resumed
run whose resulting config differs from the saved one is refused (``prepare_run_dir``).

Every mistake is one line on stderr and exit status 2, with no traceback: a flag out of
range (``UsageError``, raised as argparse does, before anything runs) and every error the
run raises for bad input, files or resources (``run_main``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flax_transformer.cli.commands import cli_message
from flax_transformer.training.distributed import initialize_distributed, parse_mesh
from flax_transformer.training.errors import NonFiniteLoss, RunError
from flax_transformer.training.run_config import field_names, from_dict, replace
from flax_transformer.training.rundir import read_run_config


class UsageError(SystemExit):
    """A wrong flag: exit status 2 (as argparse's), the message printed once, on stderr, when raised
    through ``usage_error``; ``str(error)`` is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.args = (message,)


def usage_error(message: str) -> UsageError:
    """Print ``error: message`` and return the ``UsageError`` (exit 2) to raise."""
    print(f"error: {message}", file=sys.stderr)
    return UsageError(message)


def common_parser(description: str, presets, *, prog: str | None = None) -> argparse.ArgumentParser:
    """The flags every entry point shares. ``prog`` is how a user runs it (``python -m train.lm``):
    argparse would otherwise show the script's file name (``lm.py``)."""
    parser = argparse.ArgumentParser(description=description, prog=prog)
    parser.add_argument("--preset", choices=list(presets), default=None,
                        help="model and run size: tiny (< 1 min on 2 CPU cores, for tests), small (the CPU "
                             "benchmark, the default), base (sized for a GPU)")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default runs/<task>-<preset>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the initial weights, dropout and the order of batches (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer updates (overrides --epochs)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the training data, instead of --steps (may be fractional)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="examples per optimizer update, over all devices (default: the preset's)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="data folder (default ../shared/data beside the repo when present, else a download)")
    parser.add_argument("--export-torch", type=Path, default=None, metavar="FILE.safetensors",
                        help="also write the trained weights as a torch_reference state_dict")
    parser.add_argument("--init-from-torch", type=Path, default=None, metavar="FILE.pt",
                        help="start a new run from a torch training checkpoint (model, Adam/AdamW and LambdaLR state, "
                             "step N): it trains steps N+1 .. --steps (docs/training.md)")
    parser.add_argument("--export-torch-state", type=Path, default=None, metavar="FILE.pt",
                        help="also write the finished run as a torch training checkpoint (model, optimizer, scheduler, "
                             "step) that a plain torch loop continues")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --export-torch (or --export-hf, --export-peft, --export-torch-state) "
                             "output; "
                             "without it, one is refused before training starts")
    parser.add_argument("--dtype", type=lambda name: {"fp32": "float32", "bfloat16": "bf16"}.get(name, name),
                        choices=["float32", "fp32", "bf16", "bfloat16"], default=None,
                        help="compute dtype: float32 (or fp32), bf16 (or bfloat16: mixed precision, parameters and "
                             "softmax/LayerNorm statistics fp32)")
    parser.add_argument("--attention", choices=["reference", "xla", "cudnn"], default=None,
                        help="attention math: the notebooks' (reference) or jax.nn.dot_product_attention")
    parser.add_argument("--mesh", default=None, metavar="data=N,fsdp=M[,expert=K]",
                        help="shard over N*M(*K) devices: batches over all, parameters and optimizer state over "
                             "fsdp, a mixture of experts' experts (and their Adam moments and LoRA adapters) over "
                             "expert, K dividing the number of experts")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="one process of a multi-process run (with --num-processes, --process-id): start the "
                             "same command in each, with --mesh covering all their devices; process 0 serves "
                             "HOST:PORT and alone writes the run's files")
    parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                        help="with --coordinator: how many processes the run has in all")
    parser.add_argument("--process-id", type=int, default=None, metavar="I", help="0 .. N-1")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def add_lora_flags(parser: argparse.ArgumentParser, *, task: str) -> None:
    """The LoRA flags of ``train.classify`` and ``train.lm`` (``--model hf``: ``training.lora_runs``)."""
    group = parser.add_argument_group("LoRA (--model hf)")
    group.add_argument("--lora-rank", type=int, default=None, metavar="R",
                       help="train rank-R LoRA adapters (and, classifying, the head) on the frozen pretrained model")
    group.add_argument("--lora-alpha", type=float, default=None, metavar="A", help="LoRA's alpha (default 2 * R)")
    group.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                       help="dropout on the LoRA branch's input (default 0)")
    group.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                       help="module names or regexes to adapt (default PEFT's for the model type: q_proj v_proj for "
                            "the llama family, c_attn for GPT-2, query value for BERT and RoBERTa, q_lin v_lin for "
                            "DistilBERT)")
    group.add_argument("--init-adapter", default=None, metavar="PEFT_FOLDER",
                       help="start from a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors), whose "
                            "settings it takes")
    group.add_argument("--export-peft", type=Path, default=None, metavar="DIR",
                       help=f"also write the adapter{' and head' if task == 'classify' else ''} as a PEFT folder "
                            "(checked in peft's PeftModel against this library's logits when peft is installed)")


def lora_paths(args) -> None:
    """``--init-adapter`` as an absolute path: run.json records it, and a resume or load from elsewhere finds it."""
    if getattr(args, "init_adapter", None) is not None:
        args.init_adapter = str(Path(args.init_adapter).absolute())


# flags that are not config fields (a resumed run may change them: the mesh, the processes)
_RUN_FLAGS = {"preset", "out", "resume", "data_dir", "export_torch", "export_hf", "overwrite", "no_progress", "mesh",
              "coordinator", "num_processes", "process_id", "init_from_torch", "export_torch_state", "export_peft"}
_PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")


def _check_process_flags(args) -> None:
    given = [name for name in _PROCESS_FLAGS if getattr(args, name, None) is not None]
    if not given:
        return
    if len(given) < len(_PROCESS_FLAGS):
        missing = [f"--{name.replace('_', '-')}" for name in _PROCESS_FLAGS if name not in given]
        raise usage_error("--coordinator, --num-processes and --process-id go together; "
                          f"missing {' '.join(missing)}")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise usage_error(f"--coordinator {args.coordinator!r}: expected HOST:PORT")
    if not 1 <= args.num_processes <= 1 << 16 or not 0 <= args.process_id < args.num_processes:
        raise usage_error(f"--process-id {args.process_id} with --num-processes {args.num_processes}: "
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
        raise usage_error("--resume needs --out RUN_DIR (the run to continue)")
    if args.resume and args.preset is None:
        try:
            saved = read_run_config(args.out)
        except (RunError, OSError) as error:
            raise usage_error(f"--resume: {error}") from None
        saved.pop("task", None)
        try:
            config = from_dict(config_cls, saved)
        except (TypeError, ValueError) as error:
            raise usage_error(f"--resume: {args.out / 'run.json'}: {error}") from None
    else:
        config = presets[args.preset or "small"]()
    changes = {}
    fields = field_names(config_cls)
    for name, value in vars(args).items():
        if name in _RUN_FLAGS or value is None:
            continue
        field = renames.get(name, name)
        if field not in fields:
            raise usage_error(f"--{name.replace('_', '-')} does not apply to {task}")
        changes[field] = value
    if "epochs" in changes and "steps" not in changes and "epochs" in fields:
        changes["steps"] = None  # --epochs alone decides the length (a preset's steps would win otherwise)
    if args.out is None:
        args.out = Path("runs") / f"{task}-{args.preset or 'small'}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        return replace(config, **changes)
    except (TypeError, ValueError) as error:
        raise usage_error(str(error)) from None


def _out_of_memory(error: BaseException) -> bool:
    """XLA's allocation failures (``RESOURCE_EXHAUSTED``) and numpy's ``MemoryError``."""
    text = str(error)
    return isinstance(error, MemoryError) or (type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and (
        "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text))


def run_main(function):
    """Run an entry point: clear one-line errors (exit 2), NaN loss (exit 3), Ctrl-C (exit 130: after
    saving, or, a second Ctrl-C or one before training, without).

    Before anything computes, malloc is told to keep freed memory (``malloc.keep_freed_memory``:
    each train step would otherwise fault its temporaries' pages in again)."""
    from flax_transformer.training.malloc import keep_freed_memory

    keep_freed_memory()
    try:
        interrupted = function()
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130
    except (RunError, OSError, ValueError) as error:  # OSError: missing files, failed downloads, a full disk
        print(f"error: {cli_message(error)}", file=sys.stderr)
        return 2
    except Exception as error:
        if not _out_of_memory(error):
            raise
        first = (str(error).strip().splitlines() or [""])[0][:300]
        print(f"error: out of memory ({type(error).__name__}: {first}): lower --batch-size or the lengths "
              "(--max-length, --context, --max-digits)", file=sys.stderr)
        return 2
    return 130 if interrupted else 0
