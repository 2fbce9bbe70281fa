"""``bisect_picture``: the HTML page and PNG of a ``BisectReport``, their writes, and the CLI's
``--html``/``--png`` flags.

One small report (``test_bisect``'s two-block classifier with a transposed key kernel in the
second block, gradients too, eager) is drawn several ways; the page's structure is read with
``html.parser``: every module once, the first divergent one marked, NaN drawn as NaN.
``mistral_window`` is the pair of the docs' example picture (``docs/verification.md``).
"""

import dataclasses
import re
from collections import Counter
from html.parser import HTMLParser

import pytest

from flax_transformer.interop import files
from flax_transformer.verification import bisect, bisect_picture, bisect_report
from parity_tests.verification.test_bisect import IDS, PAIR, _former

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BUG = "tblocks.1.mhattention.tokeys"


@pytest.fixture(scope="module")
def report():
    torch_model, flax_model = _former()
    kernel = flax_model.tblocks[1].mhattention.tokeys.kernel
    kernel.set_value(kernel[...].T)
    return bisect.bisect(torch_model, flax_model, (IDS,), grads=True, use_jit=False)


class _Elements(HTMLParser):
    """Every start tag's (name, attributes) and whether a script or a network address appears."""

    def __init__(self, page: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def with_attr(self, name: str) -> list[dict]:
        return [a for _, a in self.tags if name in a]


def test_page_has_every_module_once_and_marks_the_first_divergent(report):
    page = report.to_html()
    found = _Elements(page)
    modules = Counter(a["data-module"] for a in found.with_attr("data-module"))
    assert modules == Counter(r.path for r in report.rows), modules  # "" is the model's own row
    assert set(modules.values()) == {1}
    first = [a for a in found.with_attr("data-first-divergent") if "data-module" in a]
    assert report.first_divergent == BUG and [a["data-module"] for a in first] == [BUG]
    assert first[0]["id"] == "first-divergent" and first[0]["data-status"] == "introduced"
    # one gradient row per parameter, the first wrong one marked
    params = [a["data-param"] for a in found.with_attr("data-param")]
    assert params == [g.name for g in report.grad_rows] and len(params) == 30
    assert [a["data-param"] for a in found.with_attr("data-first-divergent") if "data-param" in a] == [f"{BUG}.weight"]
    # the error per position of the first divergent call; the verdict on top
    assert [a["data-positions"] for a in found.with_attr("data-positions")] == [BUG]
    assert report.summary().splitlines()[0].replace("(", "") in page.replace("(", "")
    # self-contained: no script, no stylesheet or image fetched, no address at all
    assert not [t for t, a in found.tags if t in ("script", "link", "img", "iframe")]
    assert "http" not in page and "src=" not in page and "//" not in page


@pytest.fixture(scope="module")
def broken(report):
    """The report with NaN/inf in JAX at two rows and exact zeros at a third."""
    rows = list(report.rows)
    at = {r.path: i for i, r in enumerate(rows)}
    rows[at["toprobs"]] = dataclasses.replace(rows[at["toprobs"]], jax_err=float("inf"), nonfinite_jax=3)
    rows[at[""]] = dataclasses.replace(rows[at[""]], jax_err=float("nan"))
    rows[at["do"]] = dataclasses.replace(rows[at["do"]], jax_err=0.0, torch_err=0.0)
    return dataclasses.replace(report, rows=rows)


def test_nan_and_zero_are_drawn_in_their_bands_never_as_agreement(broken):
    drawn = {a["data-module"]: a for a in _Elements(broken.to_html()).with_attr("data-module")}
    assert drawn["toprobs"]["data-jax"] == drawn[""]["data-jax"] == "nonfinite"
    assert drawn["do"]["data-jax"] == "zero" and drawn["tblocks.0.norm1"]["data-jax"] == "value"
    assert drawn["token_embedding"]["data-jax"] == "none"  # covered: not compared, no dot
    axis = bisect_picture._LogAxis([1e-7, 1.0], x0=100.0)  # neither lands on the axis, where it would read as a number
    for value, band in ((float("nan"), "nonfinite"), (float("inf"), "nonfinite"), (0.0, "zero")):
        x, where = axis.x(value)
        assert where == band and not 100.0 <= x <= 100.0 + axis.width
    assert 100.0 <= axis.x(1e-3)[0] <= 100.0 + axis.width


def test_png_is_a_png_of_a_plausible_size(broken, tmp_path):
    import matplotlib.image

    report = broken  # NaN and zeros drawn too, not a crash
    data = report.to_png(tmp_path / "b.png")
    assert data[:8] == PNG_MAGIC and (tmp_path / "b.png").read_bytes() == data
    pixels = matplotlib.image.imread(tmp_path / "b.png")
    height, width = pixels.shape[:2]
    assert width >= 800 and height >= 20 * (len(report.rows) + len(report.grad_rows)), pixels.shape
    assert pixels[..., :3].std() > 0.05  # something is drawn


def test_writes_refuse_an_existing_file_and_leave_it_whole(report, tmp_path, monkeypatch):
    page = tmp_path / "b.html"
    assert report.to_html(page) == page.read_text(encoding="utf-8")
    page.write_text("old")
    with pytest.raises(files.OutputExists):
        report.to_html(page)
    with pytest.raises(files.OutputExists):
        report.to_png(page)
    assert page.read_text() == "old"
    with pytest.raises(files.OutputFolderMissing):
        report.to_html(tmp_path / "no" / "b.html")

    def fail(_):
        raise RuntimeError("drawing failed")

    for draw in ("to_html", "to_png"):  # the target is refused before the (slow) drawing
        monkeypatch.setattr(bisect_picture, draw, fail)
    with pytest.raises(files.OutputExists):
        report.to_html(page)
    with pytest.raises(files.OutputExists):
        report.to_png(page)
    # a drawing that fails after the check leaves the old file as it was
    with pytest.raises(RuntimeError):
        report.to_html(page, overwrite=True)
    assert page.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["b.html"]
    monkeypatch.undo()
    report.to_html(page, overwrite=True)
    assert "data-first-divergent" in page.read_text(encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.html"]  # no temporary left beside it


def _one_line_error(capsys, argv, *needles):
    from flax_transformer.cli.commands import main

    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and not captured.out, captured
    assert all(n in err for n in needles), err


def test_cli_refuses_bad_html_and_png_flags_before_any_work(tmp_path, capsys):
    # the pair does not exist: had the flags not been refused first, the message would be about it
    pair = ["verify", "--pair", "no_such_module_here:make"]
    _one_line_error(capsys, [*pair, "--html", str(tmp_path / "a.html")], "--bisect")
    _one_line_error(capsys, [*pair, "--png", str(tmp_path / "a.png")], "--bisect")
    _one_line_error(capsys, [*pair, "--bisect", "--html", str(tmp_path / "a.png")], ".html")
    _one_line_error(capsys, [*pair, "--bisect", "--png", str(tmp_path / "a.html")], ".png")
    _one_line_error(capsys, [*pair, "--bisect", "--png", str(tmp_path / "no" / "a.png")], "does not exist")
    (tmp_path / "old.html").write_text("old")
    _one_line_error(capsys, [*pair, "--bisect", "--html", str(tmp_path / "old.html")], "exists", "--overwrite")
    _one_line_error(capsys, ["verify", "--checkpoint", str(tmp_path / "m.safetensors"), "--html",
                             str(tmp_path / "a.html")], "--bisect")
    _one_line_error(capsys, ["verify", "--checkpoint", str(tmp_path / "m.safetensors"), "--pair", "m:f", "--png",
                             str(tmp_path / "a.png")], "--png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.html"]  # nothing written
    assert (tmp_path / "old.html").read_text() == "old"


def test_cli_writes_both_pictures(tmp_path, capsys):
    from flax_transformer.cli.commands import main

    (tmp_path / "pair.py").write_text(PAIR)
    out_html, out_png = tmp_path / "b.html", tmp_path / "b.png"
    assert main(["verify", "--pair", f"{tmp_path}/pair.py:make", "--bisect", "--no-jit", "--html", str(out_html),
                 "--png", str(out_png)]) == 1  # the planted bias: a failed report, drawn
    out = capsys.readouterr().out
    assert f"wrote {out_html}" in out and f"wrote {out_png}" in out
    found = _Elements(out_html.read_text(encoding="utf-8"))
    assert [a["data-module"] for a in found.with_attr("data-first-divergent")] == ["toprobs"]
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def mistral_window():
    """The docs' example (``verify --pair parity_tests.verification.test_bisect_picture:mistral_window``): a
    three-layer Mistral-style model whose Flax port lets the second layer's queries see one key
    more than their window of 4 (``test_llama_bisect``'s bug, in one layer)."""
    from parity_tests.verification import test_llama_bisect as llama

    _, torch_model, flax_model = llama._pair(**llama.MISTRAL, num_hidden_layers=3)
    flax_model.model.layers[1].self_attn.sliding_window = llama.WINDOW + 1
    return torch_model, flax_model, (llama.IDS,)



def test_inherited_rows_are_drawn_failing_and_hollow_introduced_filled(report):
    """An inherited error is still an error (red), hollow to say it came in; an introduced one red and filled."""
    page = report.to_html()
    rows = re.findall(r'<g[^>]*data-module="([^"]*)"[^>]*data-status="([^"]*)".*?</g>', page, re.S)
    circles = {m.group(1): m.group(0) for m in re.finditer(r'<g[^>]*data-module="([^"]*)"[^>]*>.*?</g>', page, re.S)}
    statuses = dict(rows)
    inherited = [p for p, s in statuses.items() if s == "inherited"]
    introduced = [p for p, s in statuses.items() if s == "introduced"]
    assert inherited and introduced, statuses
    for path in inherited:
        assert re.search(r'<circle[^>]*fill="white" stroke="#c0262d"', circles[path]), circles[path]
    for path in introduced:
        assert re.search(r'<circle[^>]*fill="#c0262d" stroke="#c0262d"', circles[path]), circles[path]


def test_the_models_own_row_is_highlighted_and_a_skipped_gradient_has_no_dot():
    """Two cases no real report above has (survivors of a blind mutation probe): the error in the
    whole model's own row (``first_divergent`` is ``<model>``, its row path ""), and a gradient
    that was not compared (its JAX error NaN: no dot, not a NaN)."""
    rows = [bisect_report.ModuleRow("linear", "Linear", 1e-8, 1e-8, 1.0, status="ok"),
            bisect_report.ModuleRow("", "Model", 1e-8, 0.5, 1.0, 1e-8, 0.5, status="introduced")]
    grads = [bisect_report.GradRow("linear.weight", 0.0, float("nan"), 0.0, "skipped: no Flax parameter of this name")]
    made = bisect_report.BisectReport(rows, None, grads).settle()
    assert made.first_divergent == bisect_report.MODEL
    page = _Elements(made.to_html())
    marked = page.with_attr("data-first-divergent")
    assert [a["data-module"] for a in marked] == [""], marked
    drawn = {a["data-param"]: a for a in page.with_attr("data-param")}
    assert drawn["linear.weight"]["data-jax"] == "none"
