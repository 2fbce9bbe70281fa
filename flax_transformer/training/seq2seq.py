"""Sequence to sequence (notebook 003's encoder-decoder) on a generated task: reverse a digit string.

Source: 1..``max_digits`` random digits, padded. Target: ``<bos>`` reversed digits
``<eos>``. Training is teacher-forced (the decoder reads the target shifted right);
evaluation decodes greedily with the key/value cache and counts a sequence as right only
if every digit and the ``<eos>`` are (exact match). Training examples are drawn fresh
from ``default_rng([seed, step])``; the evaluation set from a different stream.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.training.config_bounds import check_config
from flax_transformer.training.distributed import check_batch_size
from flax_transformer.training.loop import batch_evaluator, fit
from flax_transformer.training.optim import OptimConfig, compute_dtype, from_task
from flax_transformer.training.preflight import check_memory, check_output, step_bytes
from flax_transformer.training.run_config import RunConfig, replace
from flax_transformer.training.rundir import is_main_process, open_run, prepare_run_dir
from flax_transformer.training.step import cross_entropy
from flax_transformer.training.torch_state import to_torch
from flax_transformer.verification import export

PAD, BOS, EOS, DIGIT0 = 0, 1, 2, 3
VOCAB = DIGIT0 + 10


@dataclass(frozen=True)
class Seq2SeqConfig:
    """One digit-reversal run."""

    min_digits: int = 1
    max_digits: int = 12
    d_model: int = 128
    heads: int = 4
    n_blocks: int = 2
    d_ff: int = 512
    dropout: float = 0.0
    eval_size: int = 1000
    run: RunConfig = RunConfig(batch_size=64, steps=3000, eval_every=500)
    optim: OptimConfig = OptimConfig(optimizer="adamw", lr=1e-3, warmup_steps=100, decay="cosine", weight_decay=0.01)

    def __post_init__(self):
        check_config(self)  # types and bounds of every field
        if self.run.steps is None:
            raise ValueError("--steps must be given")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")

    @classmethod
    def tiny(cls, **changes):
        """Seconds on 2 CPU cores, for tests."""
        return replace(cls(), **(dict(max_digits=5, d_model=32, heads=2, n_blocks=1, d_ff=64, batch_size=32,
                                       steps=80, lr=3e-3, warmup_steps=10, eval_size=128, eval_every=40,
                                       checkpoint_every=40) | changes))

    @classmethod
    def small(cls, **changes):
        return replace(cls(), **changes)

    @classmethod
    def base(cls, **changes):
        return replace(cls(), **(dict(max_digits=32, d_model=256, heads=8, n_blocks=4, d_ff=1024, batch_size=128,
                                       steps=5000) | changes))


PRESETS = {"tiny": Seq2SeqConfig.tiny, "small": Seq2SeqConfig.small, "base": Seq2SeqConfig.base}


def make_batch(config: Seq2SeqConfig, rng: np.random.Generator, size: int) -> dict[str, np.ndarray]:
    """``size`` examples: src (b, L), src_mask, tgt_in / tgt_out (b, L + 1), L = max_digits."""
    length = config.max_digits
    lengths = rng.integers(config.min_digits, config.max_digits + 1, size=size)
    digits = rng.integers(0, 10, size=(size, length)) + DIGIT0
    keep = np.arange(length)[None] < lengths[:, None]  # (b, L) True = digit
    src = np.where(keep, digits, PAD).astype(np.int32)
    reversed_ = np.full((size, length), PAD, dtype=np.int32)
    for row, n in enumerate(lengths):
        reversed_[row, :n] = src[row, :n][::-1]
    tgt_out = np.concatenate([reversed_, np.full((size, 1), PAD, np.int32)], axis=1)  # (b, L + 1)
    tgt_out[np.arange(size), lengths] = EOS
    tgt_in = np.concatenate([np.full((size, 1), BOS, np.int32), tgt_out[:, :-1]], axis=1)
    tgt_in[tgt_in == EOS] = PAD  # the decoder never reads <eos>
    return {"src": src, "src_mask": keep, "tgt_in": tgt_in, "tgt_out": tgt_out}


class Examples:
    """Fresh examples for every step, a pure function of (seed, step)."""

    def __init__(self, config: Seq2SeqConfig):
        self.config = config

    def batch(self, step: int):
        return make_batch(self.config, np.random.default_rng([self.config.run.seed, step]), self.config.run.batch_size)

    def count_tokens(self, batch) -> int:
        return int(batch["src_mask"].sum() + (batch["tgt_in"] != PAD).sum())

    def position(self, step: int) -> dict:
        return {"step": step, "examples_seen": step * self.config.run.batch_size}


def build_model(config: Seq2SeqConfig):
    from flax_transformer.models.attention import set_attention
    from flax_transformer.models.classic import Transformer

    model = Transformer(VOCAB, VOCAB, config.d_model, config.heads, config.n_blocks, config.d_ff, config.dropout,
                        max_len=config.max_digits + 2, rngs=nnx.Rngs(params=config.run.seed, dropout=config.run.seed + 1),
                        dtype=compute_dtype(config.run.dtype))
    set_attention(model, config.run.attention)
    return model


def loss_fn(model, batch):
    logits = model(batch["src"], batch["tgt_in"], batch["src_mask"], batch["tgt_in"] != PAD)
    real = batch["tgt_out"] != PAD
    loss = cross_entropy(logits, batch["tgt_out"], real)
    accuracy = ((logits.argmax(-1) == batch["tgt_out"]) * real).sum() / jnp.maximum(real.sum(), 1)
    return loss, {"token_accuracy": accuracy, "count": real.sum().astype(jnp.float32)}


def exact_match(config: Seq2SeqConfig, model, examples: dict) -> float:
    """Fraction of sources whose greedy decoding is exactly the reversed digits then ``<eos>``."""
    from flax_transformer.models.generate import generate

    size = len(examples["src"])
    prompt = np.full((size, 1), BOS, np.int32)
    out = generate(model, prompt, config.max_digits + 1, greedy=True, eos_id=EOS, src_ids=examples["src"],
                   src_attention_mask=examples["src_mask"])
    return exact_match_of(np.asarray(out), examples["tgt_out"])


def exact_match_of(generated, target) -> float:
    """Fraction of rows where ``generated`` (b, L + 1) equals ``target`` on its digits and ``<eos>``
    (after ``<eos>``, where the target is padding, generate repeats ``<eos>``: not compared)."""
    real = target != PAD
    return float(np.all((generated == target) | ~real, axis=1).mean())


def train_and_evaluate(config: Seq2SeqConfig, run_dir, *, data_dir=None, resume: bool = False, progress: bool = True,
                       export_torch=None, overwrite: bool = False, mesh=None, init_from_torch=None,
                       export_torch_state=None) -> dict:
    """Train on fresh examples, report exact match on ``eval_size`` held-out ones.

    Everything that can be checked is checked before the run directory is made: the
    configuration, ``export_torch`` (an existing file is replaced only with ``overwrite``),
    the batch against the mesh, and whether a step fits in memory."""
    run_dir = Path(run_dir)
    run_config = {"task": "seq2seq", **dataclasses.asdict(config)}
    prepare_run_dir(run_dir, run_config, resume=resume)
    check_output(export_torch, kind="file", overwrite=overwrite, flag="--export-torch")
    to_torch.check_entry_flags(config, init_from_torch=init_from_torch, export_torch_state=export_torch_state,
                                  overwrite=overwrite, resume=resume)
    check_batch_size(config.run.batch_size, mesh)
    check_memory(step_bytes(batch=config.run.batch_size, length=config.max_digits + 2,
                            width=max(config.d_model, config.d_ff // 4), heads=config.heads,
                            layers=2 * config.n_blocks, attention_layers=3 * config.n_blocks, vocab=VOCAB,
                            attention=config.run.attention, devices=mesh.size if mesh is not None else 1),
                 "--max-digits or --batch-size")
    held_out = make_batch(config, np.random.default_rng([config.run.seed, 10**9]), config.eval_size)
    model = build_model(config)
    with open_run(run_dir, run_config, resume=resume):  # no data to load: the task generates its own
        print(f"seq2seq: reverse {config.min_digits}..{config.max_digits} digits, {config.run.steps} steps of "
              f"{config.run.batch_size}", file=sys.stderr)
        # held-out loss/token accuracy during training, exact match (a decode) at the end
        eval_batches = [{k: v[i:i + config.run.batch_size] for k, v in held_out.items()}
                        for i in range(0, config.eval_size, config.run.batch_size)]
        evaluate = batch_evaluator(loss_fn, lambda: eval_batches)
        result = fit(model, from_task(config, config.run.steps), loss_fn, Examples(config), run_dir=run_dir, steps=config.run.steps,
                     run_config=run_config, evaluate=evaluate, eval_every=config.run.eval_every,
                     checkpoint_every=config.run.checkpoint_every, keep=config.run.keep, resume=resume, progress=progress,
                     mesh=mesh, description="seq2seq-reverse", init_from_torch=init_from_torch)
        metrics = {"step": result.step, "interrupted": result.interrupted,
                   **{f"val_{k}": v for k, v in result.metrics.items() if k != "count"}}
        if not result.interrupted:
            metrics["exact_match"] = exact_match(config, result.model, held_out)
        if export_torch is not None and is_main_process():
            export.save_safetensors(result.model, export_torch, overwrite=overwrite)
            print(f"Exported {export_torch}: the trained weights under torch_reference's names (safetensors), checked "
                  "in torch, with their certificate beside them", file=sys.stderr)
        if export_torch_state is not None and not result.interrupted and is_main_process():
            to_torch.export_checkpoint(run_dir, export_torch_state, build_model(config),
                                          from_task(config, config.run.steps), overwrite=overwrite)
            print(f"Exported {export_torch_state}: a torch training checkpoint at step {result.step} (model, Adam moments,"
                  " LambdaLR, step) that a plain torch loop or --init-from-torch continues", file=sys.stderr)
    return metrics
