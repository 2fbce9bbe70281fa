"""Bucketed seq2seq generation keeps each row's own source mask.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import jax.numpy as jnp
import numpy as np
import torch

from flax_transformer.interop import porting
from flax_transformer.verification import verify


def test_bucketed_seq2seq_generation_keeps_each_rows_source_mask():
    """Guards ``generate(bucket=True)`` carrying ``src_attention_mask`` into the padded batch row for row
    (batch 3 runs as a bucket of 4): each row, its source right-padded by a different amount, gets the
    tokens and logits of that row generated alone from its unpadded source (torch_reference's loop,
    no cache: no compilation), and of torch_reference's masked batch."""
    import torch_reference.classic as tc
    from flax_transformer.models.generate import bucket_shape, generate
    from torch_reference.generate import generate as torch_generate

    torch.manual_seed(0)
    torch_model = tc.Transformer(30, 40, 16, 4, 1, 32, max_len=24, dropout=0.0).eval()
    verify.perturb_torch(torch_model, 0)
    model = porting.torch_to_flax(torch_model)
    lengths = [7, 4, 2]
    src = np.random.default_rng(0).integers(1, 30, (3, 7))
    src_mask = (np.arange(7)[None] < np.array(lengths)[:, None]).astype(np.int64)
    src[src_mask == 0] = 0
    prompt = np.ones((3, 1), np.int64)
    assert bucket_shape(3, 1, 8, 24)[0] == 4
    tokens, logits = generate(model, jnp.asarray(prompt), 8, greedy=True, src_ids=jnp.asarray(src),
                              src_attention_mask=jnp.asarray(src_mask), return_logits=True)
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    for i, n in enumerate(lengths):
        alone, alone_logits = torch_generate(torch_model, torch.from_numpy(prompt[i:i + 1]), 8, greedy=True,
                                             src_ids=torch.from_numpy(src[i:i + 1, :n]), return_logits=True)
        np.testing.assert_array_equal(tokens[i], alone.numpy()[0], err_msg=f"row {i}")
        np.testing.assert_allclose(logits[i], alone_logits.numpy()[0], atol=1e-5, rtol=0, err_msg=f"row {i}")
    want, want_logits = torch_generate(torch_model, torch.from_numpy(prompt), 8, greedy=True,
                                       src_ids=torch.from_numpy(src), src_attention_mask=torch.from_numpy(src_mask),
                                       return_logits=True)
    np.testing.assert_array_equal(tokens, want.numpy())
    np.testing.assert_allclose(logits, want_logits.numpy(), atol=1e-5, rtol=0)
    # the masks matter here: row 1's source with its padding unmasked gives other logits
    unmasked = torch_generate(torch_model, torch.from_numpy(prompt[1:2]), 8, greedy=True,
                              src_ids=torch.from_numpy(src[1:2]), return_logits=True)[1]
    assert np.abs(unmasked.numpy()[0, 0] - logits[1, 0]).max() > 1e-2
