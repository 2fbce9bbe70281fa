"""The linear probe of ``train.classify --model hf --freeze-encoder``: the classifier's head alone, trained on the
encoder's pooled features, computed once and cached in the run directory."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.interop import files
from flax_transformer.training.batching import Bucketed
from flax_transformer.training.rundir import is_main_process


class Probe(nnx.Module):
    """The classifier's head alone (dropout and the linear layer, after DistilBERT's or RoBERTa's
    ``pre_classifier``) on pooled features: what ``--freeze-encoder`` trains. Its parameter paths
    are the full model's (``classifier.*``, ``pre_classifier.*``), and it starts from the full
    model's head, so ``attach`` puts the trained head back."""

    def __init__(self, model, *, seed: int = 0):
        from flax_transformer.models.layers import Linear

        hidden, classes = model.classifier.kernel.shape
        self.classifier_head = model.classifier_head
        self.dropout = nnx.Dropout(model.dropout.rate, rngs=nnx.Rngs(dropout=seed + 1))
        self.classifier = Linear(hidden, classes, rngs=nnx.Rngs(seed), dtype=model.classifier.dtype)
        if model.classifier_head != "linear":
            self.pre_classifier = Linear(hidden, hidden, rngs=nnx.Rngs(seed), dtype=model.classifier.dtype)
        # copies: training donates the head's arrays, which must not be the full model's
        for name in self._layers():
            nnx.update(getattr(self, name), jax.tree.map(jnp.copy, nnx.state(getattr(model, name), nnx.Param)))

    def _layers(self) -> tuple[str, ...]:
        return ("classifier",) if self.classifier_head == "linear" else ("pre_classifier", "classifier")

    def __call__(self, features):
        """(b, hidden) float features -> (b, classes) float32 logits, as the full model's head computes them."""
        from flax_transformer.models.encoder import TransformerForSequenceClassification

        return TransformerForSequenceClassification.classify(self, features)

    def attach(self, model):
        """Copy this head's parameters into ``model``'s head; returns ``model``."""
        for name in self._layers():
            nnx.update(getattr(model, name), jax.tree.map(jnp.copy, nnx.state(getattr(self, name), nnx.Param)))
        return model


def pooled_features(model, batches: Bucketed, *, progress: bool = True, desc: str = "features") -> np.ndarray:
    """The classifier's input vectors (``model.features``) of every sequence of ``batches``, in the
    sequences' order: (n, hidden) float32. One program compiles per bucket."""
    from tqdm.auto import tqdm

    run = nnx.jit(lambda m, ids, mask: m.features(ids, mask).astype(jnp.float32))
    out = None
    model.eval()
    for members, batch in tqdm(batches.with_members(), total=batches.steps_per_epoch, desc=desc, unit="batch",
                               disable=not progress, dynamic_ncols=True, mininterval=0.5):
        values = np.asarray(run(model, batch["ids"], batch["mask"]))
        if out is None:
            out = np.zeros((len(batches.sequences), values.shape[1]), np.float32)
        out[members] = values[:len(members)]
    return out


def cached_features(run_dir: Path, split: str, compute) -> np.ndarray:
    """``features/<split>.npy`` in the run directory, computed (and written atomically) the first time."""
    path = Path(run_dir) / "features" / f"{split}.npy"
    if path.is_file():
        return np.load(path, allow_pickle=False)
    path.parent.mkdir(exist_ok=True)
    features = compute()

    def write(tmp):
        with open(tmp, "wb") as f:
            np.save(f, features, allow_pickle=False)
    if is_main_process():  # with several processes, process 0 alone writes the run's files
        files.write_file(path, write, overwrite=True)
    return features
