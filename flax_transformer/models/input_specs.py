"""What a whole model reads (``InputSpec``), so that tools ask the model instead of switching on its class.

Pure Python (no JAX, no torch): both packages' models return one from ``input_spec()``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputSpec:
    """What a whole model reads, so that tools (verify, port, generate) ask the model instead of
    switching on its class name. Every top-level model of both packages has ``input_spec()``.

    vocab_size: the ids it reads lie in [0, vocab_size) (an encoder-decoder's source ids).
    max_length: the longest sequence it has positions for.
    target_vocab_size: an encoder-decoder's decoder ids (and logits); None for one sequence.
    generates: it gives next-token logits, so ``generate`` can drive it.
    """

    vocab_size: int
    max_length: int
    target_vocab_size: int | None = None
    generates: bool = False

    @property
    def encoder_decoder(self) -> bool:
        return self.target_vocab_size is not None

    @property
    def output_vocab_size(self) -> int:
        """The size of the vocabulary its logits range over (for a generating model)."""
        return self.vocab_size if self.target_vocab_size is None else self.target_vocab_size


def input_spec(model) -> InputSpec:
    """``model.input_spec()``, or a clear error for a module that is not a whole model."""
    method = getattr(model, "input_spec", None)
    if method is None:
        raise TypeError(f"{type(model).__name__} is not a whole model (it has no input_spec()): this tool takes "
                        "the models that read token ids, e.g. CTransformer, GPTTransformer, TransformerEncoder")
    return method()
