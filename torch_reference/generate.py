"""Autoregressive generation, the reference way: rerun the model on the whole prefix per token.

Same algorithm and arguments as ``flax_transformer.models.generate.generate`` (see there):
right-padded prompts, each row continues after its own prompt, ``eos_id`` sticks.
No cache, on purpose: this is the plain loop the notebook leaves as an exercise, and
the yardstick the cached JAX loop is checked and timed against.
"""

from __future__ import annotations

import numpy as np
import torch

from flax_transformer.models.arg_checks import check_length
from flax_transformer.models.generation_args import check_generate_args, check_padding_mask, is_greedy, prompt_lengths
from flax_transformer.models.input_specs import input_spec

from ._common import check_token_ids


def sample_logits(logits, generator, *, temperature, top_k, top_p, greedy):
    """Pick one token per row from (b, V) logits (as the JAX twin, with torch's RNG).

    As there: top-k cut, then ``(logits - row max) / temperature`` in float32, so a tiny
    temperature cannot overflow; below ``GREEDY_BELOW`` (~1.2e-38) it is greedy decoding.
    """
    if is_greedy(greedy, temperature):
        return logits.argmax(dim=-1)
    logits = logits.float()
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_p is not None and top_p < 1.0:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        cutoff = sorted_logits.masked_fill(before >= top_p, float("inf")).min(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def _forward(model, buffer, src_ids, src_attention_mask):
    if model.input_spec().encoder_decoder:
        return model(src_ids, buffer, src_attention_mask)
    return model(buffer)


@torch.no_grad()
def generate(model, input_ids, max_new_tokens: int, *, attention_mask=None, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False, eos_id: int | None = None,
             generator: torch.Generator | None = None, seed: int = 0, src_ids=None, src_attention_mask=None,
             return_logits: bool = False):
    """Continue each right-padded prompt (b, p) by ``max_new_tokens`` tokens.

    Returns (b, max_new_tokens) int64 new tokens, and the (b, max_new_tokens, vocab)
    logits they were chosen from if asked (b = 0 gives these shapes empty). Runs in eval
    mode; restores the mode after.
    """
    name = type(model).__name__
    spec = input_spec(model)
    if not spec.generates:
        raise TypeError(f"generate drives models that give next-token logits (gpt.GPTTransformer, gpt.GPT2LMHeadModel, "
                        f"former.GTransformer, classic.Transformer), not {name}")
    vocab = spec.output_vocab_size
    check_token_ids(input_ids, vocab)
    check_generate_args(max_new_tokens, temperature, top_k, top_p, greedy, eos_id, vocab, seed)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    lengths = prompt_lengths(input_ids.cpu().numpy(), None if attention_mask is None else attention_mask.cpu().numpy())
    limit = spec.max_length
    b, p = input_ids.shape
    total = p + max_new_tokens
    if total > limit:
        raise ValueError(f"prompt length {p} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"the model's position table ({limit})")
    if spec.encoder_decoder:
        if src_ids is None:
            raise ValueError("classic.Transformer generation needs src_ids (the source sequence)")
        check_token_ids(src_ids, spec.vocab_size, name="src_ids")
        if src_ids.shape[0] != b:
            raise ValueError(f"src_ids has batch {src_ids.shape[0]} but input_ids {b}")
        check_length(src_ids.shape[1], spec.max_length)
        if src_attention_mask is not None:
            if not isinstance(src_attention_mask, torch.Tensor):
                raise TypeError(f"src_attention_mask must be a torch.Tensor, got {type(src_attention_mask).__name__}")
            check_padding_mask(src_attention_mask.cpu().numpy(), src_ids.shape, "src_attention_mask")
    elif src_ids is not None or src_attention_mask is not None:
        raise ValueError(f"src_ids and src_attention_mask are only for classic.Transformer, not {name}")
    if max_new_tokens == 0 or b == 0:  # nothing to generate: empty, as the models give
        empty = torch.zeros(b, max_new_tokens, dtype=torch.long, device=input_ids.device)
        return (empty, torch.zeros(b, max_new_tokens, vocab)) if return_logits else empty
    greedy = is_greedy(greedy, temperature)
    generator = generator or torch.Generator(device=input_ids.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        lengths_t = torch.as_tensor(lengths, device=input_ids.device)
        buffer = torch.zeros(b, total, dtype=torch.long, device=input_ids.device)
        buffer[:, :p] = input_ids
        logits_out = torch.zeros(b, max_new_tokens, vocab)
        done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        last = lengths_t + max_new_tokens - 1
        for s in range(int(lengths.min()) - 1, total - 1):
            if bool(torch.all(done | (s >= last))):
                break
            logits = _forward(model, buffer[:, : s + 1], src_ids, src_attention_mask)[:, s]
            sampled = sample_logits(logits, generator, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
            generating = (s + 1) >= lengths_t
            if eos_id is not None:
                sampled = torch.where(done, torch.full_like(sampled, eos_id), sampled)
                done = done | (generating & (sampled == eos_id))
            buffer[:, s + 1] = torch.where(generating, sampled, buffer[:, s + 1])
            for i in np.nonzero(generating.cpu().numpy())[0]:
                slot = s + 1 - int(lengths[i])
                if slot < max_new_tokens:
                    logits_out[i, slot] = logits[i].float().cpu()
        idx = lengths_t[:, None] + torch.arange(max_new_tokens, device=input_ids.device)[None]
        new = buffer.gather(1, idx)
        if eos_id is not None:
            is_eos = new == eos_id
            first = is_eos.int().argmax(dim=1)
            after = (is_eos.cumsum(dim=1) > 0) & (torch.arange(max_new_tokens, device=new.device)[None] > first[:, None])
            new = new.masked_fill(after, eos_id)
    finally:
        model.train(was_training)
    return (new, logits_out) if return_logits else new
