"""Language modelling in JAX: ``python -m train.lm [--preset tiny|small|base] [--model former|llama] [--level word]``

    python -m train.lm --preset small --out runs/shakespeare     # char-level GPT on Tiny Shakespeare
    python -m train.lm --model llama --out runs/llama            # a Llama-style decoder of about its size
    python -m train.lm --text my.txt --level word --out runs/words

Prints the validation loss and a sample at the end. Flag parsing only; the run is
``flax_transformer.training.lm.train_and_evaluate``.
"""

import sys

from flax_transformer.cli.train_flags import common_parser, make_config, mesh_of, run_main
from flax_transformer.training import lm


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0], lm.PRESETS, prog="python -m train.lm")
    parser.add_argument("--model", choices=list(lm.MODELS), default=None,
                        help="gpt.GPTTransformer (default), former.GTransformer or llama.LlamaForCausalLM (its "
                             "presets sized to the gpt preset's parameter count)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="--model llama: key/value heads, dividing the heads (default: the preset's, heads / 2)")
    parser.add_argument("--level", choices=["char", "word"], default=None,
                        help="tokens: characters (default) or words (notebook 002's tokenizer, the 10,000 most frequent)")
    parser.add_argument("--text", default=None, help="a text file (default: tinyshakespeare/input.txt)")
    parser.add_argument("--prompt", default=None, help="the start of the sample printed at the end")
    args = parser.parse_args(argv)
    config = make_config(args, lm.LMConfig, lm.presets(args.model), "lm")

    def run():
        metrics = lm.train_and_evaluate(config, args.out, data_dir=args.data_dir, resume=args.resume,
                                        progress=not args.no_progress, export_torch=args.export_torch,
                                        overwrite=args.overwrite,
                                        mesh=mesh_of(args), init_from_torch=args.init_from_torch,
                                        export_torch_state=args.export_torch_state)
        if metrics["interrupted"]:
            return True
        print(f"validation loss {metrics['val_loss']:.4f} nats/token ({metrics['val_bits_per_token']:.3f} bits), "
              f"{metrics['step']} steps  run: {args.out}\n--- sample ---\n{metrics['sample']}")
        return False
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
