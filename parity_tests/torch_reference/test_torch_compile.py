"""torch_reference under ``torch.compile``: one graph per forward, the value checks kept (issue 21, item 4).

The input checks that read tensor values (ids in range, masks of 0/1) used ``int(t.max())`` and
``if t.all()``: a graph break in every compiled model, and a host-device sync per call on a GPU.
Under compile, and on CUDA, they are now ``torch._assert_async`` (see ``torch_reference._common``).

``fullgraph=True`` makes dynamo raise at the first graph break, so a model that compiles with it
has zero breaks. Graph breaks are decided by dynamo's tracing, before any backend sees the graph,
so ``backend="eager"`` (no code generation) proves their absence as well as inductor would and
keeps each compile well under a second. The failing-input tests use ``"aot_eager"``, which also
runs AOTAutograd's functionalization, the pass that could drop an assert with no outputs.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_reference._common as common
import torch_reference.classic as tc
import torch_reference.encoder as te
import torch_reference.former as tf
import torch_reference.gpt as tg
from flax_transformer.models.configs import EncoderConfig

VOCAB, SEQ = 20, 6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled frames are cached per code object, across model instances
    yield
    torch._dynamo.reset()


def _models():
    """name -> (model in eval mode, args builder(ids, mask)) for one model of each family."""
    torch.manual_seed(0)
    cfg = EncoderConfig.tiny(vocab_size=VOCAB, max_position_embeddings=SEQ)
    return {
        "former.CTransformer": (tf.CTransformer(8, 2, 1, SEQ, VOCAB, 2), lambda ids, mask: (ids, mask)),
        "encoder.TransformerEncoder": (te.TransformerEncoder(cfg), lambda ids, mask: (ids, mask)),
        "gpt.GPTTransformer": (tg.GPTTransformer(1, 8, 16, 2, VOCAB, SEQ), lambda ids, mask: (ids, mask)),
        "classic.Transformer": (tc.Transformer(VOCAB, VOCAB, 8, 2, 1, 16, max_len=SEQ),
                                lambda ids, mask: (ids, ids.flip(1), mask, mask)),
    }


MODELS = _models()
IDS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # int 0/1: the value check runs


@pytest.mark.parametrize("name", MODELS)
def test_compiles_to_one_graph_and_matches_eager(name):
    model, args = MODELS[name]
    model.eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # raises on a graph break
    for mask in (None, MASK):
        call = args(IDS, mask)
        torch.testing.assert_close(compiled(*call), model(*call), rtol=0, atol=1e-6)


def test_out_of_range_id_still_raises_when_compiled():
    model, args = MODELS["former.CTransformer"]
    compiled = torch.compile(model.eval(), backend="aot_eager", fullgraph=True)
    compiled(*args(IDS, None))  # compile on good ids first: the check must live in the graph
    for bad in (VOCAB, -1):
        ids = IDS.clone()
        ids[1, 2] = bad
        # the assert's own message: not nn.Embedding's "index out of range", which would also raise
        with pytest.raises(RuntimeError, match=rf"x must lie in \[0, {VOCAB}\)"):
            compiled(*args(ids, None))


def test_bad_mask_value_still_raises_when_compiled():
    model, args = MODELS["gpt.GPTTransformer"]
    compiled = torch.compile(model.eval(), backend="aot_eager", fullgraph=True)
    compiled(*args(IDS, MASK))
    with pytest.raises(RuntimeError, match=r"attention_mask must hold only 0 \(pad\) and 1 \(token\)"):
        compiled(*args(IDS, MASK * 2))


def test_eager_cpu_error_unchanged():
    """Eager on the CPU: the ValueError with the range found, before any computation."""
    model, args = MODELS["classic.Transformer"]
    ids = IDS.clone()
    ids[0, 0] = -3
    with pytest.raises(ValueError, match=rf"^src_ids must lie in \[0, {VOCAB}\); found values in \[-3, 12\]$"):
        model(*args(ids, None))
    with pytest.raises(ValueError, match=r"^src_attention_mask must hold only 0 \(pad\) and 1 \(token\)$"):
        model(*args(IDS, MASK * 2))


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", MODELS)
def test_device_path_reads_no_value_on_the_host(name, monkeypatch):
    """The CUDA path, run on the CPU: no ``aten._local_scalar_dense`` (what ``int(t)`` and
    ``bool(t)`` dispatch to, a sync on a GPU) in the forward, and a bad id still raises."""
    model, args = MODELS[name]
    model.eval()
    monkeypatch.setattr(common, "reads_values", lambda t: False, raising=False)  # as for CUDA
    with _RecordOps() as record:
        model(*args(IDS, MASK))
    assert torch.ops.aten._assert_async.msg in record.ops
    assert torch.ops.aten._local_scalar_dense.default not in record.ops
    ids = IDS.clone()
    ids[0, 0] = VOCAB
    with pytest.raises(RuntimeError, match=rf"must lie in \[0, {VOCAB}\)"):
        model(*args(ids, None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_does_not_synchronise():
    model, args = MODELS["former.CTransformer"]
    model = model.eval().cuda()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        model(*args(IDS.cuda(), MASK.cuda()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
