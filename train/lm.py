"""Language modelling in JAX: ``python -m train.lm [--preset tiny|small|base] [--model former|llama|hf] [--level word]``

    python -m train.lm --preset small --out runs/shakespeare     # char-level GPT on Tiny Shakespeare
    python -m train.lm --model llama --out runs/llama            # a Llama-style decoder of about its size
    python -m train.lm --model llama --experts 4 --out runs/moe  # the same, each MLP a mixture of 4 experts (2 per token)
    python -m train.lm --text my.txt --level word --out runs/words

    # fine-tune a pretrained HuggingFace causal LM folder with its own tokenizer, export it back
    python -m train.lm --model hf --init path/to/llama --out runs/ft --export-hf runs/ft-hf
    python -m train.lm --model hf --init path/to/llama --lora-rank 8 --out runs/lora --export-peft runs/lora-peft

Prints the validation loss and a sample at the end. Flag parsing only; the run is
``flax_transformer.training.lm.train_and_evaluate``.
"""

import sys
from pathlib import Path

from flax_transformer.cli.train_flags import (
    add_lora_flags,
    common_parser,
    lora_paths,
    make_config,
    mesh_of,
    run_main,
    usage_error,
)
from flax_transformer.training import hf_init, lm


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0], lm.PRESETS, prog="python -m train.lm")
    parser.add_argument("--model", choices=list(lm.MODELS), default=None,
                        help="gpt.GPTTransformer (default), former.GTransformer, llama.LlamaForCausalLM (its "
                             "presets sized to the gpt preset's parameter count), or hf: the pretrained causal LM "
                             "folder --init, fine-tuned with its own tokenizer")
    parser.add_argument("--init", default=None, metavar="FOLDER",
                        help="--model hf: the HuggingFace causal LM folder to fine-tune (Llama, Mistral, Qwen2/3, "
                             "Gemma, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-2; config.json, weights, tokenizer.json)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per training window (default: the preset's; --model hf: at most the model's "
                             "positions)")
    parser.add_argument("--export-hf", type=Path, default=None, metavar="DIR",
                        help="--model hf: also write the fine-tuned model as a HuggingFace folder (with the init "
                             "folder's tokenizer), checked in transformers' AutoModelForCausalLM")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="--model llama: key/value heads, dividing the heads (default: the preset's, heads / 2)")
    parser.add_argument("--experts", type=int, default=None, metavar="E",
                        help="--model llama: a mixture of E experts in every layer (default: a dense MLP)")
    parser.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                        help="--model llama --experts E: the experts each token uses (default 2), each the preset's d_ff / K "
                             "wide, so that a token uses as many feed-forward weights as the dense model's")
    parser.add_argument("--level", choices=["char", "word"], default=None,
                        help="tokens: characters (default) or words (notebook 002's tokenizer, the 10,000 most frequent)")
    parser.add_argument("--text", default=None, help="a text file (default: tinyshakespeare/input.txt)")
    parser.add_argument("--prompt", default=None, help="the start of the sample printed at the end")
    add_lora_flags(parser, task="lm")
    args = parser.parse_args(argv)
    lora_paths(args)
    if args.init is not None:  # recorded in run.json: a resume or load_run from elsewhere finds the same folder
        args.init = str(Path(args.init).absolute())
    config = make_config(args, lm.LMConfig, lm.presets(args.model), "lm")
    if config.model == "hf":
        for name in ("level", "kv_heads"):
            if getattr(args, name) is not None:
                raise usage_error(f"--{name.replace('_', '-')} does not apply to --model hf: the tokenizer and the "
                                  "model's sizes are its --init folder's")
    from_run_json = args.resume and args.preset is None

    def run():
        nonlocal config
        if config.model == "hf" and args.context is None and not from_run_json:
            config = hf_init.default_context(config)  # reads the folder's config.json: errors are one line
        metrics = lm.train_and_evaluate(config, args.out, data_dir=args.data_dir, resume=args.resume,
                                        progress=not args.no_progress, export_torch=args.export_torch,
                                        overwrite=args.overwrite,
                                        mesh=mesh_of(args), init_from_torch=args.init_from_torch,
                                        export_torch_state=args.export_torch_state, export_hf=args.export_hf,
                                        export_peft=args.export_peft)
        if metrics["interrupted"]:
            return True
        print(f"validation loss {metrics['val_loss']:.4f} nats/token ({metrics['val_bits_per_token']:.3f} bits), "
              f"{metrics['step']} steps  run: {args.out}\n--- sample ---\n{metrics['sample']}")
        return False
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
