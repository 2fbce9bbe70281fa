"""Looking inside models: a parameter summary, and attention maps of a BERT on a sentence pair
or of a llama-family decoder on a text.

``summary(model)`` answers notebook 002's "what are the biggest layers?" and stands in
for notebook 000's torchsummary. ``attention_map(...)`` is notebook 001's bertviz
cell: the attention of a real BERT on "time flies like an arrow" / "fruit flies like
a banana", as a PNG heatmap grid (matplotlib) or an interactive HTML page.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from flax import nnx

from flax_transformer.interop import files, layer_kinds, porting

# ------------------------------------------------------------------- summary


def _shapes(model) -> dict[str, tuple[tuple[int, ...], str]]:
    """torch name -> (shape, dtype) of every parameter, a tied tensor once (by its first name); reads
    no values (works on unfilled models)."""
    if type(model).__module__.startswith("torch_reference"):
        again = {name for group in porting.tied_keys(model) for name in group[1:]}
        return {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in model.state_dict().items()
                if k not in again}
    plan, out = porting.plan_of(model), {}  # as porting places them: by table and by each module's type
    for path, param in plan.params.items():
        slot = plan.slots[path][0]
        out[slot.torch_key] = (layer_kinds.torch_shape(slot.rule, tuple(param.shape)), str(param.dtype))
    return out


def summary(model, *, top: int = 5) -> str:
    """A table of modules (torch names) with parameter shapes and counts, the totals, the largest layers."""
    shapes = _shapes(model)
    by_module = defaultdict(list)
    for key, (shape, dtype) in shapes.items():
        module, _, leaf = key.rpartition(".")
        by_module[module or "(root)"].append((leaf, shape, int(np.prod(shape)), dtype))
    rows = [(module, ", ".join(f"{leaf} {shape}" for leaf, shape, _, _ in leaves), sum(n for _, _, n, _ in leaves))
            for module, leaves in by_module.items()]
    total = sum(n for *_, n in rows)
    nbytes = sum(int(np.prod(shape)) * np.dtype(dtype if dtype != "bfloat16" else "float16").itemsize
                 for shape, dtype in shapes.values())
    width = max(len(r[0]) for r in rows)
    shape_width = max(len(r[1]) for r in rows)
    lines = [f"{type(model).__name__} ({type(model).__module__})",
             f"{'module':<{width}}  {'parameters':<{shape_width}}  {'count':>12}",
             f"{'-' * width}  {'-' * shape_width}  {'-' * 12}"]
    lines += [f"{m:<{width}}  {s:<{shape_width}}  {n:>12,}" for m, s, n in rows]
    lines += ["", f"total: {total:,} parameters in {len(shapes)} tensors, {nbytes / 2**20:.1f} MiB"]
    lines += [f"tied: {', '.join(group[1:])} is {group[0]} (counted once)" for group in _ties(model)]
    lines += [f"largest {min(top, len(rows))} modules:"]
    for m, _, n in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"  {m:<{width}}  {n:>12,}  ({100 * n / max(total, 1):.1f}%)")
    return "\n".join(lines)


def _ties(model) -> list[tuple[str, ...]]:
    """The model's tied tensors by torch name, first the name its parameter is listed under."""
    if type(model).__module__.startswith("torch_reference"):
        return porting.tied_keys(model)
    config = getattr(model, "config", None)
    if type(model).__name__ == "LlamaForCausalLM" and getattr(config, "tie_word_embeddings", False):
        return [("model.embed_tokens.weight", "lm_head.weight")]  # the head is the table itself: no lm_head
    return []


# ------------------------------------------------------------- attention maps


def bert_attentions(folder, text: str, text_b: str | None = None):
    """(tokens, attentions (layers, heads, t, t), index where sentence B starts) of an HF BERT folder.

    Tokenises with the folder's own ``tokenizer.json`` (HF ``tokenizers``), adding
    [CLS]/[SEP] and token types as BERT does.
    """
    tokens, weights, b_start, _ = attentions(folder, text, text_b, bert_only=True)
    return tokens, weights, b_start


def tokenizer_file(path) -> Path:
    """The ``tokenizer.json`` of a checkpoint: in its folder, or beside a checkpoint file."""
    path = Path(path)
    found = path / "tokenizer.json" if path.is_dir() else path.with_name("tokenizer.json")
    if not found.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json" + ("" if path.is_dir() else f" beside it ({found})"))
    return found


def attentions(path, text: str, text_b: str | None = None, *, load=None, bert_only: bool = False):
    """(tokens, attentions (layers, heads, t, t), index where sentence B starts, query heads per
    key/value head) of a checkpoint's model on a text, tokenised with its ``tokenizer.json``.

    A BERT (``TransformerEncoder``) reads a sentence or a pair, with [CLS]/[SEP] and token types; a
    llama-family decoder (``LlamaForCausalLM``) reads one text, with its tokenizer's own special
    tokens (a BOS), and attends causally: one map per query head, its key/value head shared by
    ``groups`` consecutive query heads. ``load(path)`` gives the Flax model (default:
    ``hf.from_pretrained``; the CLI passes one that also reads run directories and other checkpoints).
    """
    from tokenizers import Tokenizer

    from flax_transformer.interop import hf
    from flax_transformer.models.input_specs import input_spec

    tokenizer = Tokenizer.from_file(str(tokenizer_file(path)))
    tokenizer.no_padding()  # a tokenizer.json may pad to a fixed length (MiniLM's pads to 128)
    tokenizer.no_truncation()  # and cut at its own length (MiniLM's at 128): a longer text is refused below instead
    model = (load or hf.from_pretrained)(path)
    kind = type(model).__name__
    if kind != "TransformerEncoder" and (bert_only or kind != "LlamaForCausalLM"):
        raise ValueError(f"{path} is not a BERT checkpoint" if bert_only else
                         f"{path} holds a {kind}: attention maps are drawn for a BERT (TransformerEncoder) or a "
                         "llama-family decoder (LlamaForCausalLM)")
    if kind == "LlamaForCausalLM" and text_b is not None:
        raise ValueError("a decoder reads one text: --text-b is for a BERT's sentence pair")
    encoding = tokenizer.encode(text, text_b) if text_b is not None else tokenizer.encode(text)
    longest = input_spec(model).max_length
    if len(encoding.ids) > longest:
        raise ValueError(f"the text is {len(encoding.ids)} tokens (special tokens included); the model reads at most {longest}")
    if len(encoding.ids) == 0:
        raise ValueError("the text is no token at all")
    ids = np.array([encoding.ids])
    if kind == "LlamaForCausalLM":
        maps = _decoder_attentions(model, ids)
        groups, b_start = model.config.num_key_value_groups, len(encoding.tokens)
    else:
        types = np.array([encoding.type_ids])
        _, maps = model(ids, None, types, return_attentions=True)
        groups = 1
        b_start = int(np.argmax(types[0])) if types[0].any() else len(encoding.tokens)
    weights = np.stack([np.asarray(a[0]) for a in maps])  # (layers, heads, t, t)
    return encoding.tokens, weights, b_start, groups


@nnx.jit
def _decoder_attentions(model, ids):
    """A decoder's attention weights, one compiled call (eager ops would each compile on their own)."""
    return model(ids, return_attentions=True)[1]


def save_attention_png(tokens, weights, layer: int, head: int | None, path, *, b_start: int | None = None,
                       groups: int = 1, overwrite: bool = False) -> Path:
    """Heatmaps of layer ``layer``: one head (``head``) or a grid of all heads (``head=None``); with
    ``groups`` > 1 (grouped-query attention) each title names the query head's key/value head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = range(weights.shape[1]) if head is None else [head]
    cols = min(4, len(heads))
    rows = -(-len(heads) // cols)
    size = 0.32 * len(tokens) + 1.5
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size), squeeze=False)
    for ax in axes.flat[len(heads):]:
        ax.axis("off")
    for ax, h in zip(axes.flat, heads):
        ax.imshow(weights[layer, h], cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=7)
        ax.set_title(f"layer {layer}, head {h}" + (f" (kv {h // groups})" if groups > 1 else ""), fontsize=9)
        ax.set_xlabel("attended to (keys)", fontsize=7)
        if b_start is not None and b_start < len(tokens):
            for line in (ax.axvline, ax.axhline):
                line(b_start - 0.5, color="white", linewidth=0.8)
    fig.tight_layout()
    try:
        return files.write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite=overwrite)
    finally:
        plt.close(fig)


_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>attention</title>
<style>body{font-family:sans-serif;margin:2em}svg text{font-size:13px;cursor:pointer}
.sel{font-weight:bold}</style></head><body>
<h3>%(title)s</h3><p>Layer <select id="layer"></select> head <select id="head"></select>
&nbsp; hover a token to see what it attends to.</p><svg id="view" width="560" height="%(height)d"></svg>
<script>
const tokens = %(tokens)s, weights = %(weights)s, bStart = %(b_start)d, groups = %(groups)d;
const L = document.getElementById("layer"), H = document.getElementById("head"), svg = document.getElementById("view");
weights.forEach((_, i) => L.add(new Option(i, i)));
weights[0].forEach((_, i) => H.add(new Option(groups > 1 ? i + " (kv " + Math.floor(i / groups) + ")" : i, i)));
L.value = %(layer)d; H.value = %(head)d;
function draw(focus) {
  const w = weights[L.value][H.value], y = i => 30 + 20 * i; svg.innerHTML = "";
  tokens.forEach((t, i) => {
    for (const [x, anchor] of [[150, "end"], [410, "start"]]) {
      const el = document.createElementNS("http://www.w3.org/2000/svg", "text");
      el.setAttribute("x", x); el.setAttribute("y", y(i)); el.setAttribute("text-anchor", anchor);
      el.setAttribute("fill", i >= bStart ? "#b05" : "#035"); el.textContent = t;
      if (anchor === "end") el.onmouseover = () => draw(i);
      if (i === focus && anchor === "end") el.setAttribute("class", "sel"); svg.appendChild(el);
    }
  });
  tokens.forEach((_, i) => tokens.forEach((_, j) => {
    if (focus !== undefined && i !== focus) return;
    const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
    line.setAttribute("x1", 160); line.setAttribute("y1", y(i) - 4); line.setAttribute("x2", 400);
    line.setAttribute("y2", y(j) - 4); line.setAttribute("stroke", "#36c");
    line.setAttribute("stroke-opacity", w[i][j]); line.setAttribute("stroke-width", 2); svg.appendChild(line);
  }));
}
L.onchange = H.onchange = () => draw(); draw();
</script></body></html>"""


def save_attention_html(tokens, weights, layer: int, head: int, path, *, b_start: int, title: str, groups: int = 1,
                        overwrite: bool = False) -> Path:
    """A self-contained page: pick layer and head, hover a token to see its attention (with ``groups``
    > 1, each query head's key/value head is named beside it)."""
    page = _HTML % dict(title=html.escape(title), tokens=json.dumps(tokens).replace("</", "<\\/"),
                        weights=json.dumps(np.round(weights, 4).tolist()), b_start=b_start, layer=layer, head=head,
                        height=40 + 20 * len(tokens), groups=groups)
    return files.write_text(path, page, overwrite=overwrite)
