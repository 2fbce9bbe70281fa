"""Issue 25's hand-over check: a LoRA classify run's predictions in JAX against its PEFT export's in torch.

    python bench/lora_agreement.py RUN_DIR PEFT_DIR [--data-dir DIR] [--batch 32]

Reads the run (``classify.load_run``: the init folder's base, LoRA, the checkpoint), its test split
(the same seeded sample the run was tested on, ``classify.load_splits``), and the PEFT folder onto
transformers' ``AutoModelForSequenceClassification`` of the run's init folder with
``peft.PeftModel.from_pretrained``. Both classify every test review: the JAX side tokenised with the
run's own ``tokenizer.json``, the torch side with ``AutoTokenizer`` of the init folder (the ids are
compared too). Prints the number of reviews whose labels agree, the largest logit difference, and
each side's accuracy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("peft_dir", type=Path)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)

    import jax
    import torch
    import transformers
    from flax import nnx
    from peft import PeftModel
    from tqdm import tqdm

    from flax_transformer.training import classify, hf_init

    jax.config.update("jax_default_matmul_precision", "highest")
    model, tokenizer, config = classify.load_run(args.run_dir)
    folder = hf_init.classifier_folder(config)
    _, _, test = classify.load_splits(config, args.data_dir)
    texts, labels = [t for t, _ in test], np.array([label for _, label in test])
    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=config.num_classes)
    theirs = PeftModel.from_pretrained(base, str(args.peft_dir)).eval()
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    forward = nnx.jit(lambda m, ids, mask: m(ids, mask))
    ours_logits, torch_logits, same_ids = [], [], 0
    started = time.perf_counter()
    for i in tqdm(range(0, len(texts), args.batch), desc="classifying", unit="batch"):
        chunk = texts[i:i + args.batch]
        batch = auto(chunk, padding="max_length", truncation=True, max_length=config.max_length, return_tensors="pt")
        ours_ids = [e.ids for e in tokenizer.encode_batch(chunk)]
        same_ids += sum(batch["input_ids"][j, :len(e)].tolist() == e for j, e in enumerate(ours_ids))
        with torch.no_grad():
            torch_logits.append(theirs(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits.numpy())
        ours_logits.append(np.asarray(forward(model, batch["input_ids"].numpy(), batch["attention_mask"].numpy().astype(bool))))
    ours, want = np.concatenate(ours_logits), np.concatenate(torch_logits)
    agree = int((ours.argmax(-1) == want.argmax(-1)).sum())
    print(f"{len(texts)} test reviews ({time.perf_counter() - started:.0f} s): labels agree on {agree}, "
          f"max abs logit difference {np.abs(ours - want).max():.2e}, same token ids on {same_ids}; accuracy JAX "
          f"{(ours.argmax(-1) == labels).mean():.4f}, torch+peft {(want.argmax(-1) == labels).mean():.4f}")
    return 0 if agree == len(texts) else 1


if __name__ == "__main__":
    sys.exit(main())
