"""``flax-transformer port`` of training run directories: ``--to torch-state`` (a run as a torch training
checkpoint), and for LoRA runs ``--to peft`` (the adapter as a PEFT folder, certified through ``peft``)
and ``--merge`` (the adapter folded into the weights, then any other ``--to``)."""

from __future__ import annotations

from pathlib import Path

from flax_transformer.cli import port_verify
from flax_transformer.cli.bisect_cli import load_model


def lora_loader(merge: bool):
    """``port``'s model loader: a LoRA run's model is refused unless ``merge`` folds its adapter in
    (``lora.remove``), since the other formats hold a plain model."""
    def load(path, **kwargs):
        from flax_transformer.models import lora

        model = load_model(path) if not kwargs else load_model(path, **kwargs)
        if lora.layers(model):
            if not merge:
                raise ValueError(f"{path} holds a LoRA adapter: --to peft writes the adapter as a PEFT folder, "
                                 "--merge folds it into the weights first")
            lora.remove(model, merge_weights=True)
        elif merge:
            raise ValueError(f"--merge folds a LoRA adapter into the weights; {path} has none")
        return model
    return load


def _base_of(run_dir: Path) -> Path:
    """The init folder a LoRA run's adapter was trained on (its ``lora.json`` records it)."""
    import json

    from flax_transformer.training import lora_runs

    record = json.loads((run_dir / lora_runs.RECORD).read_text(encoding="utf-8"))
    base = Path(record["init"])
    if not base.is_dir():
        raise ValueError(f"{run_dir} was trained on {base}, which is not there any more: the adapter is certified "
                         "through peft on that base; put it back")
    return base


def port_peft(args, dst: Path) -> int:
    """``port RUN_DIR DIR --to peft``: a LoRA training run's adapter (and a classifier's head, as
    ``modules_to_save``) as ``adapter_config.json`` + ``adapter_model.safetensors``, with the
    certificate of its check in ``peft`` (``export.save_peft``) unless ``--no-certify``."""
    from flax_transformer.interop import files
    from flax_transformer.models import lora
    from flax_transformer.training import lora_runs, run_loading
    from flax_transformer.verification import export
    from flax_transformer.verification.certificate import peft as certificate_peft

    extra = [flag for flag, given in (("--family/--class/--config", args.family or args.cls or args.config),
                                      ("--dtype", args.dtype != "fp32"), ("--max-shard-size", args.max_shard_size),
                                      ("--merge", args.merge)) if given]
    if extra:
        raise ValueError(f"--to peft writes a run's adapter as it trained, in fp32; {extra[0]} does not apply "
                         "(--merge writes the folded model: --to hf --merge)")
    src = Path(args.src)
    if not (src / "run.json").is_file():
        raise ValueError(f"--to peft reads a LoRA training run directory (python -m train.classify/train.lm "
                         f"--lora-rank R); {src} is not one")
    files.check_target(dst, kind="dir", overwrite=args.overwrite)
    run = run_loading.load_run(src)
    if lora.config_of(run.model) is None:
        raise ValueError(f"{src} trained no LoRA adapter (train with --lora-rank R): nothing for --to peft")
    base = _base_of(src)
    options = lora_runs.peft_options(run.task, base)

    def write(path: Path, overwrite: bool = False):
        export.save_peft(run.model, path, base=base, overwrite=overwrite, certify=not args.no_certify, **options)

    def passes(path: Path) -> bool:  # measured where it was written, before it goes to DST
        report = certificate_peft.AdapterReport(dst)
        report.measured = certificate_peft.measure(run.model, path, base)
        if not certificate_peft.measured_passed(report.measured):
            report.failures.append("the adapter through peft does not compute the run's model")
        print(f"verify: {report.summary()}")
        return report.ok

    if args.verify and not port_verify.staged(dst, write, passes, overwrite=args.overwrite):
        return 1
    if not args.verify:
        write(dst, args.overwrite)
    print(f"wrote {dst} (PEFT LoRA adapter for {base}, {options['task_type']}) " +
          ("without a certificate (--no-certify)" if args.no_certify else f"and its certificate {dst / 'verification.json'}"))
    return 0


def port_torch_state(args, dst: Path) -> int:
    """``port RUN_DIR FILE.pt --to torch-state``: a training run's checkpoint as a torch training checkpoint."""
    if args.family or args.cls or args.config:
        raise ValueError("--to torch-state reads a run directory, which says its model: no --family/--class/--config")
    from flax_transformer.interop import files
    from flax_transformer.training.torch_state import run_export, to_torch

    files.check_target(dst, kind="file", overwrite=args.overwrite)
    model, optimizer, optim, step = run_export.restore_run(args.src)

    def passes(path: Path) -> bool:  # read back as torch does and as the import does, against the run's state
        problems = run_export.check_export(args.src, path, step=step)
        for problem in problems:
            print(f"  {problem}")
        print(f"verify: {dst} loads into torch's model, optimizer and scheduler, and imports back as the run's "
              f"parameters, Adam moments and counts at step {step} -> {'FAIL' if problems else 'pass'}")
        return not problems

    if args.verify:  # written aside, checked there, moved to DST only when it passes
        if not port_verify.staged(dst, lambda path: to_torch.save_torch_state(path, model, optimizer, optim),
                                  passes, overwrite=args.overwrite):
            return 1
    else:
        to_torch.save_torch_state(dst, model, optimizer, optim, overwrite=args.overwrite)
    print(f"wrote {dst} (torch-state: model, Adam/AdamW state, LambdaLR, step {step})")
    return 0
