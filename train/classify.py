"""IMDB sentiment in JAX: ``python -m train.classify [--preset tiny|small|base] [--model encoder] ...``

    python -m train.classify --preset small --out runs/imdb            # train, print test accuracy
    python -m train.classify --out runs/imdb --resume                  # continue after Ctrl-C
    python -m train.classify --predict "I enjoyed the readings" --checkpoint runs/imdb

Flag parsing only; the run is ``flax_transformer.training.classify.train_and_evaluate``.
"""

import sys

from flax_transformer.training import classify
from flax_transformer.training.cli import common_parser, make_config, run_main
from flax_transformer.training.loop import parse_mesh


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0], classify.PRESETS)
    parser.add_argument("--model", choices=["former", "encoder"], default=None,
                        help="former.CTransformer (default) or encoder.TransformerForSequenceClassification")
    parser.add_argument("--dataset", choices=["imdb", "rt-polarity"], default=None)
    parser.add_argument("--predict", metavar="TEXT", action="append",
                        help="classify TEXT with the run in --checkpoint (repeatable) and exit")
    parser.add_argument("--checkpoint", metavar="RUN_DIR", help="the run directory --predict reads")
    args = parser.parse_args(argv)
    if args.predict:
        if not args.checkpoint:
            parser.error("--predict needs --checkpoint RUN_DIR")

        def predict():
            for text, (label, prob) in zip(args.predict, classify.predict(args.checkpoint, args.predict)):
                print(f"{label}\t{prob:.4f}\t{text}")
        return run_main(predict)
    config = make_config(args, classify.ClassifyConfig, classify.PRESETS, "classify")

    def run():
        metrics = classify.train_and_evaluate(config, args.out, data_dir=args.data_dir, resume=args.resume,
                                              progress=not args.no_progress, export_torch=args.export_torch,
                                              mesh=parse_mesh(args.mesh))
        if metrics["interrupted"]:
            return True
        print(f"test accuracy {metrics['test_accuracy']:.4f}  test loss {metrics['test_loss']:.4f}  "
              f"(val accuracy {metrics.get('val_accuracy', float('nan')):.4f}, {metrics['step']} steps)  run: {args.out}")
        return False
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
