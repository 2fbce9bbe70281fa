"""Sequence to sequence in JAX: ``python -m train.seq2seq [--preset tiny|small|base]``

Notebook 003's encoder-decoder learns to reverse digit strings; prints exact-match
accuracy on held-out strings. Flag parsing only; the run is
``flax_transformer.training.seq2seq.train_and_evaluate``.
"""

import sys

from flax_transformer.cli.train_flags import common_parser, make_config, mesh_of, run_main
from flax_transformer.training import seq2seq


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0], seq2seq.PRESETS, prog="python -m train.seq2seq")
    parser.add_argument("--max-digits", type=int, default=None, help="longest source string")
    args = parser.parse_args(argv)
    config = make_config(args, seq2seq.Seq2SeqConfig, seq2seq.PRESETS, "seq2seq")

    def run():
        metrics = seq2seq.train_and_evaluate(config, args.out, resume=args.resume, progress=not args.no_progress,
                                             export_torch=args.export_torch, overwrite=args.overwrite,
                                             mesh=mesh_of(args), init_from_torch=args.init_from_torch,
                                             export_torch_state=args.export_torch_state)
        if metrics["interrupted"]:
            return True
        print(f"exact match {metrics['exact_match']:.4f} on {config.eval_size} held-out strings "
              f"(token accuracy {metrics['val_token_accuracy']:.4f}, {metrics['step']} steps)  run: {args.out}")
        return False
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
