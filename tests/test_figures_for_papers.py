"""Figures fit for a paper: heatmaps that fill the figure, with a labelled colour bar,
values in their cells and the first layer's heads apart; titles that name the model; nothing
clipped; legends true to the data; the causal check's score, attention and readout changes beside
their predictions. Each test fails when its fix is undone."""

from __future__ import annotations

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.naming import model_name

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
pytest.importorskip("transformers")
from pathkernels.fixtures import load_fixture  # noqa: E402

POSITION = 20  # the fixtures' example: the 4th token of the second copy
KEY = POSITION - 15  # where the induction heads look


@pytest.fixture(scope="module")
def induction():
    model, inputs = load_fixture("attn_only_2l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs, query_key=True)
    return model, inputs, stack


def inside(figure, artists) -> bool:
    """Whether every artist's drawn extent lies within the figure (1 pixel of slack)."""
    figure.canvas.draw()
    bounds = figure.bbox
    renderer = figure.canvas.get_renderer()
    for artist in artists:
        if not artist.get_visible() or not artist.get_text():
            continue
        box = artist.get_window_extent(renderer)
        if box.x0 < bounds.x0 - 1 or box.y0 < bounds.y0 - 1 or box.x1 > bounds.x1 + 1 or box.y1 > bounds.y1 + 1:
            return False
    return True


def test_the_score_heatmap_fills_its_figure_labels_its_colour_bar_and_shows_the_heads_apart(induction):
    _, _, stack = induction
    looks = pk.score_decomposition(stack, 1, 0, query=POSITION)
    assert looks.paths is not None and looks.path_table.shape[:2] == (len(looks.paths), len(looks.paths))
    torch.testing.assert_close(looks.path_table.sum((0, 1)), looks.table.sum((0, 1)), rtol=1e-12, atol=1e-12)
    figure = looks.plot(KEY, other=0)
    ax, colour_bar = figure.axes
    assert colour_bar.get_ylabel() == f"score term, key {KEY} − key 0"
    figure.canvas.draw()
    area = ax.get_window_extent().width * ax.get_window_extent().height
    assert area / (figure.bbox.width * figure.bbox.height) >= 0.55  # 0.25 before
    rows = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    assert "L0H0 from embedding" in rows and "L0H3 from embedding" in rows  # the previous-token head apart
    cells = [t.get_text() for t in ax.texts]
    assert "7.44" in cells  # the query's embedding against the key's path through L0H0
    assert inside(figure, [*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label, ax.title])
    assert "attn_only_2l" in ax.get_title()


def test_titles_name_the_fixture_or_the_folder(induction, tmp_path):
    model, inputs, stack = induction
    assert stack.name == "attn_only_2l" and stack.source == "huggingface:gpt2"
    result = pk.path_attribution(stack, pk.logit(model, 3), positions=POSITION, top_k=3)
    assert result.plot(3).axes[0].get_title().startswith("attn_only_2l: ")
    pairs = pk.score_pairs(stack, 1, 0, query=POSITION, key=KEY, top_k=2)
    assert pairs.plot(2).axes[0].get_title().startswith("attn_only_2l: ")
    transformers = pytest.importorskip("transformers")
    fresh = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20))
    assert model_name(fresh) == "gpt2"  # no folder: the model type
    fresh.save_pretrained(tmp_path / "my-gpt2")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "my-gpt2")
    assert model_name(again) == "my-gpt2"
    assert model_name(object()) == ""


def test_bar_labels_stay_inside_the_figure_and_off_the_bars():
    model, inputs = load_fixture("gpt2_4l", batch=3)
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs)
    ids = inputs["input_ids"]
    readouts = [pk.logit(model, ids[b, KEY].item()) for b in range(3)]
    figure = pk.batch_attribution(stack, readouts, positions=[[POSITION]] * 3, top_k=3).plot(3)
    ax = figure.axes[0]
    assert inside(figure, [ax.xaxis.label, ax.title, *ax.get_yticklabels()])  # the x-label was clipped
    figure.canvas.draw()
    marks = [t for t in ax.texts if "largest" in t.get_text() or "smallest" in t.get_text()]
    assert len(marks) == 2
    frame = ax.get_window_extent()
    assert all(t.get_window_extent().x0 >= frame.x1 for t in marks)  # beside the axes, not over the bars
    assert inside(figure, marks)


def test_the_decomposition_legend_says_what_the_bias_paths_are():
    model, inputs = load_fixture("gpt2_4l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs)
    dec = pk.decompose(stack)
    figure = dec.plot()
    ax = figure.axes[0]
    assert "gpt2_4l" in ax.get_title()
    label = ax.get_legend().get_texts()[0].get_text().replace("\n", " ")
    ratios = dec.path_ratio()[dec.bias_paths]
    measured = ratios[ratios >= 1e-6]
    assert float(measured.max()) > 0.5  # not round-off: the paths through heads
    assert f"ratio {float(measured.min()):.2g}–{float(measured.max()):.2g}" in label
    assert f"{int((ratios < 1e-6).sum())} at round-off" in label
    assert inside(figure, [*ax.get_legend().get_texts(), ax.title, ax.xaxis.label])


def test_the_causal_check_shows_score_attention_and_readout_beside_their_predictions(induction):
    model, inputs, stack = induction
    paths = [[0, -1], [-1, -1]]
    check = pk.causal_check(
        model, stack, inputs, paths, ["embedding"] * 2, layer=1, head=0, query=POSITION, key=KEY,
        readout=pk.logit(model, 3),
    )  # fmt: skip
    figure = check.plot()
    panels = [ax for ax in figure.axes if ax.patches]
    assert [ax.get_xlabel() for ax in panels] == ["score change", "attention change", "change of logit[3]"]
    score, attention, readout = panels
    assert len(score.patches) == 4 and float(score.patches[0].get_width()) == pytest.approx(float(check.predicted[0]))
    assert float(score.patches[2].get_width()) == pytest.approx(float(check.score_change[0]))
    clean = check.clean["attention"]
    expected = clean * torch.exp(check.predicted[0]) / (1 - clean + clean * torch.exp(check.predicted[0])) - clean
    assert len(attention.patches) == 4 and float(attention.patches[0].get_width()) == pytest.approx(float(expected))
    assert float(attention.patches[2].get_width()) == pytest.approx(float(check.pattern_change[0]))
    assert len(readout.patches) == 2 and "no frozen prediction" in readout.get_title()
    assert "attn_only_2l" in figure.get_suptitle()
    assert inside(figure, [*score.get_yticklabels(), *(ax.xaxis.label for ax in panels)])


def test_the_searches_figures_name_the_model_too(induction):
    """TopPaths, TopScorePairs and score_attribution's result carry the stack's name into their
    titles, as every other result does."""
    import matplotlib.pyplot as plt

    model, _, stack = induction
    readout = pk.logit_diff(model, 3, 7)
    results = (
        pk.top_paths(stack, readout, top_k=3, position=POSITION),
        pk.score_top_paths(stack, 1, 0, top_k=3, query=POSITION, key=KEY),
        pk.top_score_pairs(stack, 1, 0, top_k=3, query=POSITION, key=KEY),
        pk.score_attribution(stack, 1, 0, query=POSITION, key=KEY),
    )
    for result in results:
        figure = result.plot()
        titles = [axis.get_title() for axis in figure.axes] + [figure.get_suptitle()]
        assert any(title.startswith("attn_only_2l: ") for title in titles), titles
        plt.close(figure)
