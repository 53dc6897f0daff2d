"""Captures that do not hold their patterns (``patterns="recomputed"``): every layer's patterns are
recomputed in float64 from the captured queries and keys when an analysis reads them.

Each family the score side reads, built with random biases and norm gains and sharpened weights,
in float32 and float64, on a left-padded batch, and the trained fixtures: the recomputed patterns
are the model's own to its dtype's rounding, and every analysis gives the held capture's answer to
that rounding; what takes patterns whole is refused by name, and a recomputation that does not
rebuild the model's patterns is refused the first time it is read."""

import warnings

import pytest
import torch
from test_memory_budgets import frozen_need
from test_scores import FAMILIES, build, padded_ids

import pathkernels as pk
import pathkernels.core._memory as memory
from pathkernels.adapters import query_key as query_key_module
from pathkernels.adapters.capture import RecomputedPatterns
from pathkernels.adapters.query_key import QueryKeyCapture
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

# The recomputed patterns against the model's own, at real tokens: a float64 model's patterns are
# its float64 softmax of the same scores (measured equal, bit for bit, in every family here); a
# float32 model's carry its float32 scores' and softmax's rounding (measured up to 5.2e-7 over 12
# draws of GPT-2, Llama and Qwen2, weights ×5). The analyses' results then agree to that order.
AGREE = {torch.float64: 1e-12, torch.float32: 1e-5}


def assert_same_top(found, again) -> None:
    """Two top-path lists of the same search on the held and the recomputed capture: the values to
    :data:`AGREE` (float32) of the largest, and the paths wherever no near tie (within twice that)
    could swap two of them; the last, whose rival beyond the list is unseen, by value only."""
    scale = float(found.values.abs().max())
    torch.testing.assert_close(again.values, found.values, rtol=0, atol=AGREE[torch.float32] * scale)
    far = torch.tensor([float("inf")], dtype=found.values.dtype)
    gaps = found.values.diff().abs()
    apart = (torch.cat([gaps, far]) > 2 * AGREE[torch.float32] * scale) & (
        torch.cat([far, gaps]) > 2 * AGREE[torch.float32] * scale
    )
    apart[-1] = False
    assert torch.equal(found.paths[apart], again.paths[apart])
    assert bool(apart.any())


def model_of(name: str, dtype: torch.dtype):
    """:func:`test_scores.build`'s model, or ``"falcon-alibi"``: Falcon with ALiBi, whose position
    bias the recomputation adds to the scores."""
    if name == "falcon-alibi":
        from test_capture_self_check import falcon_with_alibi

        return falcon_with_alibi().to(dtype)
    return build(name, dtype)


def both_captures(model, **inputs):
    """The capture holding the patterns and the one recomputing them, of the same inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a left-padded row's positions, as generate gives them
        held = capture_huggingface_residual(model, query_key=True, **inputs)
        recomputed = capture_huggingface_residual(model, query_key=True, patterns="recomputed", **inputs)
    return held, recomputed


def real_pairs(mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, 1, n, n]`` bool: the pairs of real tokens of each sequence."""
    real = mask.bool()
    return (real[:, :, None] & real[:, None, :])[:, None, None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", [*FAMILIES, "falcon-alibi"])
def test_the_recomputed_patterns_are_the_models_own_and_its_paths_sum_to_it(name, dtype):
    """Every layer, head and real pair of a left-padded batch: the patterns recomputed from the
    queries and keys equal the ones the model computed to its dtype's rounding, the padded
    queries' rows are 0, the capture holds no ``L·H·n²`` float tensor, and its self-check (the
    sum of its paths against the model's own stream and logits) passes as the held capture's."""
    model = model_of(name, dtype)
    ids, mask = padded_ids()
    (stack, capture), (lean, lean_capture) = both_captures(model, input_ids=ids, attention_mask=mask)
    assert isinstance(lean.attn, RecomputedPatterns) and not lean.holds_patterns and stack.holds_patterns
    assert lean.attn.shape == stack.attn.shape and lean.computed_in == dtype == stack.computed_in
    held = capture.patterns(stack.attn)
    recomputed = lean_capture.patterns(lean.attn)
    assert recomputed.dtype == torch.float64 and recomputed.shape == held.shape
    pairs = real_pairs(mask)
    error = float(((recomputed - held).abs() * pairs).max())
    assert error < AGREE[dtype], error
    assert float(recomputed[1, :, :, :2].abs().max()) == 0  # the padded queries' rows
    torch.testing.assert_close(recomputed.sum(-1)[:, :, :, 2:], torch.ones_like(recomputed[:, :, :, 2:, 0]))
    tokens = stack.num_tokens
    held_by_the_score_side = {  # (ALiBi's position bias, a term of each score, is held as the model adds it)
        name: t for name, t in vars(lean_capture.query_key).items() if name != "position_bias"
    }
    floats = [t for t in held_by_the_score_side.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    floats += [t for t in vars(lean_capture).values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert not any(t.dim() >= 2 and t.shape[-2:] == (tokens, tokens) and t.shape[:3] == held.shape[:3] for t in floats)
    assert lean_capture.check.stream_error <= lean_capture.check.tolerance
    assert lean_capture.check.stream_error == pytest.approx(capture.check.stream_error, abs=AGREE[dtype])


@pytest.mark.parametrize("name", ["llama", "gemma2-sliding-biased", "falcon-alibi"])
def test_a_layer_recomputed_a_block_of_rows_at_a_time_is_the_one_in_one_block(monkeypatch, name):
    """Rows recomputed two at a time (seven tokens: the last block is one row) are those of one
    block, bit for bit: the scores, the position bias (Falcon's ALiBi), the soft cap and the
    sliding window (Gemma-2) and the mask are each a block's own rows."""
    model = model_of(name, torch.float32)
    ids, mask = padded_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean, capture = capture_huggingface_residual(
            model, input_ids=ids, attention_mask=mask, query_key=True, patterns="recomputed"
        )
    whole = capture.patterns(lean.attn)
    heads, tokens = lean.num_heads, lean.num_tokens
    monkeypatch.setattr(query_key_module, "_ATTENTION_BLOCK_BYTES", 8 * heads * tokens * 2)
    assert torch.equal(capture.patterns(lean.attn), whole)


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2-sliding-biased", "falcon-alibi"])
def test_every_analysis_of_a_recomputing_capture_is_the_held_ones(name):
    """The certified top paths, the path attribution, the paths' residual norms (``pk.decompose``)
    and every head's score decomposition of the top layer, on both sequences of a padded batch:
    the recomputing capture gives the held one's paths and values (float32 patterns against their
    float64 recomputation: :data:`AGREE` of the scale)."""
    model = model_of(name, torch.float32)
    ids, mask = padded_ids()
    (stack, _), (lean, _) = both_captures(model, input_ids=ids, attention_mask=mask)
    readout = torch.randn(stack.d_model, dtype=torch.float64)
    layer = stack.num_layers - 1
    split, again = pk.decompose(stack, max_length=2), pk.decompose(lean, max_length=2)
    assert torch.equal(split.paths, again.paths) and torch.equal(split.sources, again.sources)
    norms = split.results.norm.double()
    torch.testing.assert_close(
        again.results.norm.double(), norms, rtol=0, atol=AGREE[torch.float32] * float(norms.max())
    )
    for batch in (0, 1):
        found, again = pk.top_paths(stack, readout, 8, batch=batch), pk.top_paths(lean, readout, 8, batch=batch)
        assert found.certified and again.certified
        assert_same_top(found, again)
        whole = pk.path_attribution(stack, readout, batch=batch)
        other = pk.path_attribution(lean, readout, batch=batch)
        by_length = whole.by_source_length
        torch.testing.assert_close(
            other.by_source_length, by_length, rtol=0, atol=AGREE[torch.float32] * float(by_length.abs().max())
        )
        for one, two in zip(
            pk.score_decompositions(stack, layer, batch=batch), pk.score_decompositions(lean, layer, batch=batch)
        ):
            assert one.groups == two.groups and torch.equal(one.keys, two.keys)
            scale = float(one.table.abs().max())
            torch.testing.assert_close(two.table, one.table, rtol=0, atol=AGREE[torch.float32] * scale)


@pytest.mark.parametrize("fixture", ["gpt2_4l", "llama_2l"])
def test_a_trained_models_sharp_patterns_are_recomputed_to_its_rounding(fixture):
    """The trained fixtures, whose heads attend sharply: the recomputed patterns are the model's
    to float32's rounding, and the top readout paths of the example's last token are the held
    capture's."""
    from pathkernels.fixtures import load_fixture

    model, inputs = load_fixture(fixture)
    (stack, capture), (lean, lean_capture) = both_captures(model, **inputs)
    held, recomputed = capture.patterns(stack.attn), lean_capture.patterns(lean.attn)
    assert float(held.max()) > 0.9  # sharp: some head puts nearly all its weight on one key
    assert float((recomputed - held).abs().max()) < AGREE[torch.float32]
    readout = pk.logit(model, int(inputs["input_ids"][0, -1]))
    found, again = pk.top_paths(stack, readout, 10), pk.top_paths(lean, readout, 10)
    assert_same_top(found, again)


def test_a_recomputation_that_does_not_rebuild_the_models_patterns_is_refused_when_read(monkeypatch):
    """Gemma-2 with a soft cap of 1 on its scores: a recomputation without the cap differs from
    the model's patterns, which the capture's probe of each layer (its self-check reads every
    layer) refuses by name; without the self-check, the first analysis that reads the layer
    refuses it."""
    model = build("gemma2-sliding-biased", torch.float32)
    for block in model.model.layers:  # the cap each attention module reads as it runs
        block.self_attn.attn_logit_softcapping = 1.0
    ids, mask = padded_ids()
    original = QueryKeyCapture.attention

    def uncapped(self, batch, layer, out=None):
        cap = self.soft_cap.clone()
        self.soft_cap.zero_()
        try:
            return original(self, batch, layer, out)
        finally:
            self.soft_cap.copy_(cap)

    monkeypatch.setattr(QueryKeyCapture, "attention", uncapped)
    refused = r"layer 0's patterns of batch element 0, recomputed from the captured queries and keys, differ from the"
    with pytest.raises(ValueError, match=refused), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, query_key=True, patterns="recomputed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean, _ = capture_huggingface_residual(
            model, input_ids=ids, attention_mask=mask, query_key=True, patterns="recomputed", check=False
        )
    with pytest.raises(ValueError, match=r"patterns='held'"):
        pk.top_paths(lean, torch.randn(lean.d_model, dtype=torch.float64), 3)
    monkeypatch.setattr(QueryKeyCapture, "attention", original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, query_key=True, patterns="recomputed")


def test_what_takes_the_patterns_whole_is_refused_and_bad_arguments_are_named():
    """The engine's functions that take a stack's patterns whole (``pk.rollout``,
    ``pk.path_residuals``) refuse a recomputing one by name; ``patterns`` is checked, and needs ``query_key=True``."""
    model = build("gpt2", torch.float32)
    ids = torch.randint(1, 50, (1, 6))
    lean, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True, patterns="recomputed")
    whole = r"this stack does not hold its patterns \(captured with patterns='recomputed'\)"
    with pytest.raises(ValueError, match=r"^pathkernels\.rollout: " + whole):
        pk.rollout(lean)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_residuals: " + whole):
        lean.path_residuals(pk.PathTree.complete(lean.num_layers, lean.num_heads))
    assert "patterns recomputed when read" in repr(lean)
    moved = lean.to("cpu")
    assert not moved.holds_patterns and moved.attn.shape == lean.attn.shape
    torch.testing.assert_close(moved.path_sum(), lean.path_sum(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"capture_huggingface_residual: expected patterns to be 'held' or 'rec"):
        capture_huggingface_residual(model, input_ids=ids, query_key=True, patterns="lazy")
    with pytest.raises(ValueError, match=r"patterns='recomputed' recomputes them .* pass query_key=True"):
        capture_huggingface_residual(model, input_ids=ids, patterns="recomputed")


@pytest.mark.parametrize("batch", [0, 1])
def test_the_frozen_model_of_recomputed_patterns_counts_them_in_float64(monkeypatch, batch):
    """The frozen model recomputes one sequence's patterns in float64 (every token's, then the
    real tokens' of a padded sequence), counted in what it needs: at that need it runs, a byte
    below it is refused."""
    from pathkernels.analysis.readout_trie import frozen_model

    model = build("llama", torch.float32)
    ids, mask = padded_ids()
    (stack, capture), (lean, lean_capture) = both_captures(model, input_ids=ids, attention_mask=mask)
    real = mask[batch].bool()
    frozen = frozen_model(lean, lean_capture, batch, real)
    held = capture.patterns(stack.attn, batch)[..., real, :][..., real]
    for layer in range(lean.num_layers):
        sublayer = frozen.sublayers[2 * layer]
        assert sublayer.attn.dtype == torch.float64
        assert float((sublayer.attn - held[layer]).abs().max()) < AGREE[torch.float32]
    tokens, everyone = int(real.sum()), lean.num_tokens
    need = frozen_need(lean, tokens, 8)
    if tokens < everyone:
        need += 8 * lean.num_layers * lean.num_heads * everyone**2
    readout = torch.randn(lean.d_model, dtype=torch.float64)
    monkeypatch.setattr(memory, "available_memory", lambda device, need=need: need)
    pk.path_attribution(lean, readout, batch=batch)
    monkeypatch.setattr(memory, "available_memory", lambda device, need=need: need - 1)
    with pytest.raises(MemoryError, match=r"the frozen model of batch element"):
        pk.path_attribution(lean, readout, batch=batch)
