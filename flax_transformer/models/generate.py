"""Autoregressive generation for ``gpt.GPTTransformer``, ``gpt.GPT2LMHeadModel``,
``llama.LlamaForCausalLM``, ``former.GTransformer`` and the ``classic.Transformer`` decoder, as
one compiled program. A decoder plugs in with ``input_spec().generates``, ``init_cache(batch,
length)`` and ``decode_step(tokens, index, cache) -> (logits, cache)``, and, if its cache forgets
(a sliding layer's ring), ``cache_rewind()``: how far back a step may start from the furthest
position written.

How prompts of different lengths share a batch: prompts are right-padded and the
loop walks positions 0, 1, 2, ... for all rows at once. At position p a row whose
prompt is longer than p keeps its prompt token; any other row takes the sampled
token. So every row's sequence is contiguous (no padding inside it), all rows write
the key/value cache at the same index, and each row's result equals what it would
get alone. The loop is a ``lax.while_loop`` over a static-shape cache; it stops early
once every row has produced ``eos_id``.

Compilation: the loop is compiled for each (batch, prompt length) it sees, so ``generate``
first pads both up to a bucket (``bucket_shape``: powers of two, prompts at least 16 long,
then steps of 64 rows and 128 tokens). Extra columns hold pad id 0 after every prompt, extra
rows repeat row 0 and count as done; neither changes the loop's bounds (shortest and longest
prompt), and no query ever reads a position past its own, so each row's tokens are those it
gets unpadded. ``count_compiles`` counts compilations.

The same algorithm, without a cache, is ``torch_reference.generate.generate``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_transformer.models.arg_checks import check_flag, check_length
from flax_transformer.models.generation_args import check_generate_args, check_padding_mask, is_greedy, prompt_lengths
from flax_transformer.models.input_checks import check_token_ids, is_concrete
from flax_transformer.models.input_specs import InputSpec, input_spec


def sample_logits(logits, key, *, temperature: float, top_k: int | None, top_p: float | None, greedy: bool):
    """Pick one token per row from (b, V) logits.

    ``greedy`` takes the argmax. Otherwise logits are cut to the ``top_k`` largest,
    divided by ``temperature`` (in float32, after subtracting each row's maximum, so a
    small temperature cannot overflow: the largest logit stays 0, the others go to
    -inf), cut to the smallest set whose probability reaches ``top_p`` (nucleus), and
    sampled. A temperature below float32's smallest normal number (``GREEDY_BELOW``,
    about 1.2e-38) is greedy decoding, the limit it tends to.
    """
    if is_greedy(greedy, temperature):
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (b, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if top_p is not None and top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


MIN_PROMPT_BUCKET = 16  # shorter prompts share one program: their prefill costs about the same
# Past these sizes buckets grow by a constant step instead of doubling, so that padding wastes
# at most one step: a batch of 520 runs 576 rows, not 1024.
BATCH_STEP, PROMPT_STEP = 64, 128
# the seeds generate takes: jax.random.key keeps 32 bits of a seed (JAX's default int32), so a
# negative or larger seed would give the key of another one (2**32 that of 0), and 2**63 overflows
MAX_SEED = 2**32 - 1


def check_seed(seed, flag: str = "seed") -> None:
    """``ValueError`` naming ``flag`` unless ``seed`` is an integer in [0, ``MAX_SEED``]."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{flag} must be an integer in [0, {MAX_SEED}] (2**32 - 1: a random key keeps 32 bits of "
                         f"its seed), got {seed!r}")

# jax records this event once per XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT);
# test_generate_hf checks that a fresh program still counts, so a renamed event fails there.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _round_up(n: int, step: int) -> int:
    """``n`` up to a power of two while that stays within ``step``, else to a multiple of ``step``."""
    if n <= step:
        return 1 << max(int(n) - 1, 0).bit_length()
    return -(-n // step) * step


def bucket_shape(batch: int, length: int, max_new_tokens: int, max_length: int) -> tuple[int, int]:
    """The (batch, prompt length) ``generate`` compiles for a (batch, length) prompt.

    Both round up to a power of two (prompts to at least ``MIN_PROMPT_BUCKET``), beyond
    ``BATCH_STEP`` rows and ``PROMPT_STEP`` tokens to a multiple of those; the length no further
    than the position table allows with ``max_new_tokens`` after it. Batches 1-8 and prompts
    1-100 then compile 4 x 4 programs, not 800.
    """
    room = max_length - max_new_tokens  # >= length: generate checks the table first
    padded = max(length, min(max(_round_up(length, PROMPT_STEP), MIN_PROMPT_BUCKET), room))
    return _round_up(batch, BATCH_STEP), padded


class CompileCount:
    """How many XLA compilations happened inside a ``count_compiles`` block (``.n``)."""

    def __init__(self):
        self.n = 0


@contextlib.contextmanager
def count_compiles():
    """Count every XLA compilation (of any function, in any thread) while the block runs.

    ``with count_compiles() as c: generate(...)``, then ``c.n``: 0 when every program the
    block ran was already compiled.
    """
    count = CompileCount()

    def listener(event, duration, **kwargs):
        if event == _COMPILE_EVENT:
            count.n += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _spec(model) -> InputSpec:
    spec = input_spec(model)
    if not spec.generates:
        raise TypeError(f"generate drives models that give next-token logits (gpt.GPTTransformer, gpt.GPT2LMHeadModel, "
                        f"llama.LlamaForCausalLM, former.GTransformer, classic.Transformer), "
                        f"not {type(model).__name__}")
    return spec


def generate(model, input_ids, max_new_tokens: int, *, attention_mask=None, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False, eos_id: int | None = None,
             rng=None, seed: int = 0, src_ids=None, src_attention_mask=None, use_cache: bool = True,
             return_logits: bool = False, bucket: bool = True):
    """Continue each prompt by ``max_new_tokens`` tokens.

    Args:
        model: a flax ``gpt.GPTTransformer``, ``gpt.GPT2LMHeadModel``, ``llama.LlamaForCausalLM``,
            ``former.GTransformer`` or ``classic.Transformer`` (for which ``input_ids`` are the
            decoder's prompt, e.g. a start token, and ``src_ids`` the source). Dropout is off
            during generation.
        input_ids: (b, p) prompt ids, right-padded; ``attention_mask`` (b, p), 1 = token.
        temperature, top_k, top_p, greedy: how to pick tokens (see ``sample_logits``; a
            temperature below ~1.2e-38 is greedy).
        eos_id: a row that produces it keeps producing it (stops early when all rows have).
        rng / seed: a ``jax.random`` key, or an int seed in [0, 2**32 - 1] when ``rng`` is None.
        use_cache: decode with a key/value cache (True) or rerun the whole prefix each step.
        return_logits: also return the logits each new token was chosen from.
        bucket: pad the batch and prompt length up to ``bucket_shape`` so that nearby shapes
            share one compiled program (same tokens; False compiles for the exact shape).

    Returns:
        (b, max_new_tokens) int32 new tokens, and (b, max_new_tokens, vocab) float32 logits
        if asked (log-probabilities for ``GTransformer``, whose output they are). A batch of
        0 prompts gives these shapes with b = 0, as the models' own calls do.
    """
    spec = _spec(model)
    vocab = spec.output_vocab_size
    check_token_ids(input_ids, vocab)
    if not is_concrete(input_ids):
        raise TypeError("generate compiles its own loop: call it with concrete arrays, not inside jit")
    check_generate_args(max_new_tokens, temperature, top_k, top_p, greedy, eos_id, vocab, seed)
    if rng is None:
        check_seed(seed)
    bucket = check_flag("bucket", bucket)
    lengths = prompt_lengths(input_ids, attention_mask)
    total = input_ids.shape[1] + max_new_tokens
    if total > spec.max_length:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"the model's position table ({spec.max_length})")
    if spec.encoder_decoder:
        if src_ids is None:
            raise ValueError("classic.Transformer generation needs src_ids (the source sequence)")
        check_token_ids(src_ids, spec.vocab_size, name="src_ids")
        if src_ids.shape[0] != input_ids.shape[0]:
            raise ValueError(f"src_ids has batch {src_ids.shape[0]} but input_ids {input_ids.shape[0]}")
        check_length(src_ids.shape[1], spec.max_length)
        if src_attention_mask is not None:
            check_padding_mask(src_attention_mask, src_ids.shape, "src_attention_mask")
    elif src_ids is not None or src_attention_mask is not None:
        raise ValueError(f"src_ids and src_attention_mask are only for classic.Transformer, not {type(model).__name__}")
    if max_new_tokens == 0 or input_ids.shape[0] == 0:  # nothing to generate: empty, as the models give
        empty = jnp.zeros((input_ids.shape[0], max_new_tokens), jnp.int32)
        if return_logits:
            return empty, jnp.zeros((input_ids.shape[0], max_new_tokens, vocab), jnp.float32)
        return empty
    key = rng if rng is not None else jax.random.key(seed)
    b = input_ids.shape[0]
    ids = np.asarray(input_ids).astype(np.int32)  # (b, p)
    if bucket:
        rows, width = bucket_shape(b, ids.shape[1], max_new_tokens, spec.max_length)
        if not (is_greedy(greedy, temperature) or jax.config.jax_threefry_partitionable):
            rows = b  # this PRNG draws a (rows, V) sample's first b rows unlike a (b, V) one's: keep b
        ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])))  # pad id 0 after every prompt: never read
        # extra rows repeat row 0, so the shortest and longest prompt (the loop's bounds) stay put
        take = np.concatenate([np.arange(b), np.zeros(rows - b, int)])
        ids, lengths = ids[take], lengths[take]
        if src_ids is not None:
            src_ids = np.asarray(src_ids)[take]
        if src_attention_mask is not None:
            src_attention_mask = np.asarray(src_attention_mask)[take]
    deterministic = [m.deterministic for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Dropout)]
    model.eval()
    try:
        # jax.device_put, not jnp.asarray: the latter compiles a copy for every new shape
        tokens, logits = _generate(
            model, jax.device_put(ids), jax.device_put(lengths), jax.device_put(np.int32(b)), key,
            None if src_ids is None else jax.device_put(np.asarray(src_ids).astype(np.int32)),
            None if src_attention_mask is None else jax.device_put(np.asarray(src_attention_mask)),
            max_new_tokens=int(max_new_tokens), temperature=float(temperature),
            top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
            greedy=is_greedy(greedy, temperature), eos_id=None if eos_id is None else int(eos_id),
            use_cache=bool(use_cache),
            return_logits=return_logits)
    finally:  # restore each dropout's mode
        dropouts = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Dropout)]
        for dropout, det in zip(dropouts, deterministic):
            dropout.deterministic = det
    if tokens.shape[0] != b:  # drop the extra rows on the host: slicing in JAX would compile per batch size
        tokens, logits = (jax.device_put(np.asarray(x)[:b]) for x in (tokens, logits))
    return (tokens, logits) if return_logits else tokens


def prefill_in_chunks(model, buffer, shared, chunk: int, cache):
    """``decode_step`` over positions [0, ``shared``) of ``buffer`` (b, >= chunk) in chunks of ``chunk``
    positions, the last one ending at ``shared`` (going back over part of the one before), or, when
    ``shared`` < ``chunk``, one chunk from 0: no step starts more than ``chunk`` positions before the
    furthest one written, and none after ``shared`` + ``chunk``. Returns the cache."""
    def body(i, cache):
        at = jnp.maximum(jnp.minimum(i * chunk, shared - chunk), 0)
        return model.decode_step(jax.lax.dynamic_slice_in_dim(buffer, at, chunk, axis=1), at, cache)[1]

    return jax.lax.fori_loop(0, (shared + chunk - 1) // chunk, body, cache)


@partial(nnx.jit, static_argnames=("max_new_tokens", "temperature", "top_k", "top_p", "greedy", "eos_id",
                                   "use_cache", "return_logits"))
def _generate(model, input_ids, lengths, n_rows, key, src_ids, src_attention_mask, *, max_new_tokens, temperature,
              top_k, top_p, greedy, eos_id, use_cache, return_logits):
    b, p = input_ids.shape
    total = p + max_new_tokens
    spec = _spec(model)
    seq2seq = spec.encoder_decoder
    buffer = jnp.zeros((b, total), jnp.int32).at[:, :p].set(input_ids)  # (b, total)

    if seq2seq:
        enc_out = model.encode(src_ids, src_attention_mask)
        cross = model.cross_cache(enc_out) if use_cache else None

    def next_logits(buffer, s, cache):
        """Logits (b, V) for position s + 1, from position s (cached) or the whole buffer."""
        if use_cache:
            token = jax.lax.dynamic_slice_in_dim(buffer, s, 1, axis=1)  # (b, 1)
            if seq2seq:
                out, cache = model.decode_step(token, s, cache, cross, src_attention_mask)
            else:
                out, cache = model.decode_step(token, s, cache)
            return out[:, 0], cache
        out = model.decode(buffer, enc_out, src_attention_mask) if seq2seq else model(buffer)
        return jax.lax.dynamic_index_in_dim(out, s, axis=1, keepdims=False), cache

    cache = model.init_cache(b, total) if use_cache else None
    vocab = spec.output_vocab_size
    all_logits = jnp.zeros((b, max_new_tokens if return_logits else 0, vocab), jnp.float32)
    # rows from n_rows on only fill a batch bucket: done from the start, so that when sampling
    # (their draws differ from row 0's) they cannot keep the loop running after the real rows end
    done = jnp.arange(b) >= n_rows
    last = lengths + max_new_tokens - 1  # the last position each row fills

    def cond(carry):
        s, _, _, _, done, _ = carry
        return (s < total - 1) & ~jnp.all(done | (s >= last))

    def body(carry):
        s, buffer, cache, key, done, all_logits = carry
        logits, cache = next_logits(buffer, s, cache)
        key, sub = jax.random.split(key)
        sampled = sample_logits(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
        position = s + 1
        generating = position >= lengths  # (b,): past this row's prompt
        if eos_id is not None:
            sampled = jnp.where(done, eos_id, sampled)
            done = done | (generating & (sampled == eos_id))
        current = jax.lax.dynamic_index_in_dim(buffer, position, axis=1, keepdims=False)
        token = jnp.where(generating, sampled.astype(jnp.int32), current)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, token, position, axis=1)
        if return_logits:
            slot = position - lengths  # which new token this is, per row
            hit = generating[:, None] & (jnp.arange(max_new_tokens)[None] == slot[:, None])  # (b, max_new)
            all_logits = jnp.where(hit[:, :, None], logits[:, None, :], all_logits)
        return s + 1, buffer, cache, key, done, all_logits

    start = jnp.min(lengths) - 1  # the first position whose successor is generated
    if use_cache:
        # prefill: the prompt positions every row shares, in one pass
        rewind = model.cache_rewind() if hasattr(model, "cache_rewind") else None
        if seq2seq:
            _, cache = model.decode_step(buffer[:, :p], 0, cache, cross, src_attention_mask)
        elif rewind is None or p <= rewind:
            _, cache = model.decode_step(buffer[:, :p], 0, cache)
        else:  # the loop goes back to start: prefill no further than start + rewind
            cache = prefill_in_chunks(model, buffer, start + 1, rewind, cache)
        # Positions < start hold every row's prompt. Beyond, a shorter row's prefill saw
        # padding; harmless: the step at s rewrites position s before any query sees it.
    carry = (start, buffer, cache, key, done, all_logits)
    _, buffer, _, _, done, all_logits = jax.lax.while_loop(cond, body, carry)
    # each row's new tokens start right after its prompt
    idx = lengths[:, None] + jnp.arange(max_new_tokens)[None]  # (b, max_new)
    new = jnp.take_along_axis(buffer, idx, axis=1)
    if eos_id is not None:  # rows stopped early keep eos after it
        seen = jnp.cumsum(new == eos_id, axis=1) > 0
        first = jnp.argmax(new == eos_id, axis=1)
        new = jnp.where(seen & (jnp.arange(max_new_tokens)[None] > first[:, None]), eos_id, new)
    return new, all_logits
