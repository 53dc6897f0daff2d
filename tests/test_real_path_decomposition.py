"""pk.decompose of a captured model: the model's own paths, each a source and the heads
it passes, their terms built from the bottom up. The terms sum to the captured stream; each term,
read out, is the path's attribution that the top-down readout trie computes independently; the
residual ratios are those of the terms; padded sequences read as they do alone."""

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

from test_real_models import bert, gpt2, llama  # noqa: E402

FAMILIES = {"gpt2": gpt2, "bert": bert, "llama": llama}


def frozen(stack, batch=0):
    from pathkernels.analysis.readout_trie import frozen_model

    real = torch.ones(stack.attn.shape[-1], dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch]
    return frozen_model(stack, stack.residual_capture, batch, real), real


@pytest.mark.parametrize("family", FAMILIES)
def test_the_terms_sum_to_the_stream_and_read_out_as_the_attributions(family):
    from pathkernels.analysis.real_paths import _every_term

    model_hf = FAMILIES[family]()
    stack, capture = capture_huggingface_residual(model_hf, input_ids=torch.randint(0, 50, (1, 7)))
    model, _ = frozen(stack)
    terms, choices, sources = [], [], []
    for chunk_terms, chunk_choices, source in _every_term(model, stack.num_layers, chunk=5):
        terms.append(chunk_terms)
        choices.append(chunk_choices)
        sources += [source] * chunk_terms.shape[0]
    terms, choices, sources = torch.cat(terms), torch.cat(choices), torch.tensor(sources)
    stream = capture.residual[0]
    torch.testing.assert_close(terms.sum(0), stream, rtol=0, atol=1e-10 * stream.abs().max())
    # Read out through the frozen final norm: r = e_t / σ_t, v = C Γ u (post-norm: r = e_t, v = u).
    readout = torch.randn(stack.d_model, dtype=torch.float64)
    attribution = pk.path_attribution(stack, readout, positions=4)
    setup_rho, setup_phi = _readout_vectors(stack, readout, 4)
    read = torch.einsum("t,mtd,d->m", setup_rho, terms, setup_phi)
    by_path = {
        (tuple(path.tolist()), int(source)): float(value)
        for path, source, value in zip(attribution.paths, attribution.path_sources, attribution.attribution[:, 0, 0])
    }
    assert len(by_path) == terms.shape[0]
    keys = [(tuple(path.tolist()), int(source)) for path, source in zip(choices, sources)]
    expected = torch.tensor([by_path[key] for key in keys], dtype=torch.float64)
    torch.testing.assert_close(read, expected, rtol=0, atol=1e-10 * expected.abs().max())


def _readout_vectors(stack, direction, position):
    from pathkernels.analysis.attribution import read_out

    setup = read_out(stack, direction, position, 0, None, "test")
    return setup.rho[0, 0], setup.phi[0, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ratios_are_those_of_the_terms(family):
    from pathkernels.analysis.real_paths import _canonical_order, _every_term
    from pathkernels.reference import composite_norm_ref, residual_norm_ref

    model_hf = FAMILIES[family]()
    stack, _ = capture_huggingface_residual(model_hf, input_ids=torch.randint(0, 50, (1, 6)))
    decomposition = pk.decompose(stack, max_length=2, memory_budget=1 << 16)
    model, _ = frozen(stack)
    parts = list(_every_term(model, 2, chunk=1000))
    terms = torch.cat([p[0] for p in parts])
    choices = torch.cat([p[1] for p in parts])
    sources = torch.cat([torch.full((p[0].shape[0],), p[2]) for p in parts])
    order = _canonical_order(choices, sources)
    assert torch.equal(decomposition.paths, choices[order]) and torch.equal(decomposition.sources, sources[order])
    torch.testing.assert_close(decomposition.results.residual[0], residual_norm_ref(terms[order]), rtol=1e-12, atol=0)
    torch.testing.assert_close(decomposition.results.norm[0], composite_norm_ref(terms[order]), rtol=1e-12, atol=0)
    assert decomposition.method == "exact" and bool((decomposition.lengths <= 2).all())
    assert decomposition.path_counts == torch.bincount(decomposition.lengths, minlength=4).tolist()
    every = pk.path_attribution(stack, torch.randn(32, dtype=torch.float64), max_length=2)
    assert sum(decomposition.path_counts) == int(every.counts.sum())
    frame = decomposition.to_frame()
    assert len(frame) == len(decomposition.paths) and frame["path"][0] == "embedding (direct)"
    assert decomposition.by_source()["paths"].sum() == len(frame)
    assert list(decomposition.by_length()["path_count"]) == [c for c in decomposition.path_counts if c]


def test_a_padded_sequence_decomposes_as_it_does_alone():
    model = gpt2()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    padded, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    alone, _ = capture_huggingface_residual(model, input_ids=ids[1:, 3:])
    both, single = pk.decompose(padded, max_length=2), pk.decompose(alone, max_length=2)
    assert torch.equal(both.paths, single.paths) and torch.equal(both.sources, single.sources)
    torch.testing.assert_close(both.results.ratio[1], single.results.ratio[0], rtol=1e-9, atol=1e-12)


def test_options_of_attention_networks_are_refused_by_name():
    stack, _ = capture_huggingface_residual(gpt2(), input_ids=torch.randint(0, 50, (1, 5)))
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: a stack with a residual_capture .* tree"):
        pk.decompose(stack, tree=pk.PathTree.complete(3, 4, skip=True))
    with pytest.raises(ValueError, match=r"skip do not apply"):
        pk.decompose(stack, skip=False)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: expected max_length >= 0, got -1"):
        pk.decompose(stack, max_length=-1)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: uniform sampling draws from all paths"):
        pk.decompose(stack, num_samples=5, max_length=1)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: no paths of length 7"):
        pk.decompose(stack, samples_per_length={7: 3})
    # The attention products stay one call away.
    assert pk.decompose(stack.attn).results.residual.shape[0] == 1


# --- samples ---------------------------------------------------------------------------------------


def test_a_term_built_alone_is_the_term_of_the_trie():
    from pathkernels.analysis.real_paths import _every_term, terms_of

    for family in ("gpt2", "bert"):
        stack, _ = capture_huggingface_residual(FAMILIES[family](), input_ids=torch.randint(0, 50, (1, 6)))
        model, _ = frozen(stack)
        parts = list(_every_term(model, stack.num_layers, chunk=7))
        terms = torch.cat([p[0] for p in parts])
        choices = torch.cat([p[1] for p in parts])
        sources = torch.cat([torch.full((p[0].shape[0],), p[2]) for p in parts])
        shuffle = torch.randperm(sources.numel())
        alone = terms_of(model, choices[shuffle], sources[shuffle])
        torch.testing.assert_close(alone, terms[shuffle], rtol=1e-12, atol=1e-12 * terms.abs().max())


def test_draws_are_uniform_over_the_paths():
    """50,000 draws with replacement over the 187 paths of a 3-layer, 4-head model (and over the 80
    of length 2): every path's frequency within six standard deviations of its expectation, and
    Pearson's χ² over all of them within six of its own."""
    from pathkernels.analysis.real_paths import _draw

    stack, _ = capture_huggingface_residual(gpt2(), input_ids=torch.randint(0, 50, (1, 5)))
    model, _ = frozen(stack)
    exact = pk.decompose(stack)
    for lengths, population in ((list(range(4)), len(exact.paths)), ([2], int((exact.lengths == 2).sum()))):
        draws = 50_000
        choices, sources = _draw(model, draws, lengths, torch.Generator().manual_seed(1))
        rows = torch.cat([sources[:, None], choices], 1)
        unique, frequency = torch.unique(rows, dim=0, return_counts=True)
        assert unique.shape[0] == population
        expected = draws / population
        spread = (expected * (1 - 1 / population)) ** 0.5
        assert bool(((frequency - expected).abs() < 6 * spread).all()), (frequency.min(), frequency.max())
        chi2, dof = float(((frequency - expected) ** 2 / expected).sum()), population - 1  # jointly: Pearson's χ²
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)


def test_samples_measure_their_paths_as_the_exact_decomposition_does():
    stack, _ = capture_huggingface_residual(llama(), input_ids=torch.randint(0, 50, (2, 6)))
    exact = pk.decompose(stack)
    ratio_of = {
        (int(source), tuple(path.tolist())): exact.results.ratio[:, i]
        for i, (source, path) in enumerate(zip(exact.sources, exact.paths))
    }
    uniform = pk.decompose(stack, num_samples=40, generator=torch.Generator().manual_seed(0))
    assert uniform.method == "uniform" and len(uniform.paths) == 40
    keys = [(int(source), tuple(path.tolist())) for source, path in zip(uniform.sources, uniform.paths)]
    assert len(set(keys)) == 40  # without replacement
    expected = torch.stack([ratio_of[key] for key in keys], dim=1)
    torch.testing.assert_close(uniform.results.ratio, expected, rtol=1e-10, atol=1e-14)
    # Weights (Horvitz–Thompson): each of 40 paths drawn uniformly stands for N / 40 paths; a path of a
    # stratum of n_k drawn stands for count_k / n_k.
    assert torch.equal(uniform.weights, torch.full((40,), sum(exact.path_counts) / 40, dtype=torch.float64))
    # Stratified: a stratum with no more paths than asked for is whole, and its mean is exact.
    stratified = pk.decompose(stack, samples_per_length={0: 100, 2: 10}, generator=torch.Generator().manual_seed(0))
    table = stratified.by_length().set_index("length")
    assert bool(table.loc[0, "exact"]) and not bool(table.loc[2, "exact"])
    assert table.loc[0, "evaluated"] == exact.path_counts[0] and table.loc[2, "evaluated"] == 10
    exact_table = exact.by_length().set_index("length")
    assert table.loc[0, "mean"] == pytest.approx(exact_table.loc[0, "mean"], rel=1e-10)
    assert stratified.path_counts[1] == 0 and stratified.path_counts[2] == exact.path_counts[2]
    expected = torch.where(stratified.lengths == 0, 1.0, exact.path_counts[2] / 10).double()
    assert torch.equal(stratified.weights, expected)
    # Asking for every path gives the exact decomposition.
    assert pk.decompose(stack, num_samples=10**6).method == "exact"


@pytest.mark.parametrize("sampling", [{"num_samples": 5}, {"samples_per_length": {1: 2, 3: 3}}])
def test_sampled_estimates_of_a_model_are_unbiased_over_many_seeds(sampling):
    """The 187 paths of a 3-layer, 4-head model, 5 of them drawn, 400 seeds: the mean of the
    Horvitz–Thompson estimates of Σ ratio (over the strata asked for) lies within 5 standard errors
    of the exact sum."""
    stack, _ = capture_huggingface_residual(gpt2(), input_ids=torch.randint(0, 50, (1, 5)))
    every = pk.decompose(stack)
    strata = sampling.get("samples_per_length", {k: None for k in range(4)})
    in_set = torch.isin(every.lengths, torch.tensor(list(strata)))
    exact = float(every.path_ratio().nan_to_num(nan=0.0)[in_set].sum())
    estimates = torch.tensor(
        [
            pk.decompose(stack, generator=torch.Generator().manual_seed(seed), **sampling).estimate()
            for seed in range(400)
        ]
    )
    z = (estimates.mean() - exact) / (estimates.std() / 20)
    assert abs(float(z)) < 5


def test_results_beyond_the_budget_are_refused_before_any_work():
    stack, _ = capture_huggingface_residual(gpt2(), input_ids=torch.randint(0, 50, (1, 5)))
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: the results of 187 paths would take .* more than"):
        pk.decompose(stack, max_result_bytes=1000)
    with pytest.raises(ValueError, match=r"the results of 30 paths"):
        pk.decompose(stack, num_samples=30, max_result_bytes=1000)
    assert len(pk.decompose(stack, num_samples=30, max_result_bytes=10_000).paths) == 30


def test_a_captured_models_plot_keeps_its_bias_paths_out_of_the_band():
    """A trained GPT-2's decomposition: its attention-bias paths (the direct ones' rows equal at
    every token: ratio round-off) are drawn apart, in grey at the axis' edge where below it, and left out of the
    median and the 10–90 % band, which then spans the paths that carry the stream (not 1e-15); the
    title names the model."""
    pytest.importorskip("matplotlib")
    from pathkernels.fixtures import load_fixture

    model, inputs = load_fixture("gpt2_4l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs)
    dec = pk.decompose(stack)
    ax = dec.plot().axes[0]
    assert "huggingface:gpt2" in ax.get_title() and "L = 4, H = 4" in ax.get_title()
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[0].startswith("attention-bias paths")
    band = ax.collections[-1].get_paths()[0].vertices[:, 1]
    ratios = dec.path_ratio()
    bias = torch.tensor([dec.source_names[int(s)].endswith("attention bias") for s in dec.sources])
    assert float(ratios[bias].min()) < 1e-12  # the round-off the band leaves out
    assert band.min() > 0.1 and ax.get_ylim()[0] > 1e-3


def test_heads_that_share_a_value_map_read_it_once_and_sum_as_each_heads_own_branch():
    """A grouped-query model's query heads that share a key-value head share its value map
    (``Sublayer.value_group``: 2 for 4 heads over 2, 4 over 1, 1 over 4 and for GPT-2), and
    ``branch_sum`` reads it once: every node's sum is ``Σ_h T_h Y G_h`` written per head, with
    ``G_h = F_out[h]ᵀ F_in[h]ᵀ`` (1e-12 of its scale), for several nodes at once."""
    from pathkernels.analysis.readout_trie import frozen_model
    from pathkernels.analysis.real_paths import branch_sum

    cases = [(llama(heads=4, kv_heads=2), 2), (llama(heads=4, kv_heads=1), 4), (llama(heads=4, kv_heads=4), 1)]
    for model, group in [*cases, (gpt2(), 1)]:
        model = model.double().eval()
        stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 7)))
        frozen = frozen_model(stack, capture, 0, torch.ones(7, dtype=torch.bool))
        terms = torch.randn(3, 7, stack.d_model, dtype=torch.float64)
        for sublayer in (s for s in frozen.sublayers if s.attn is not None):
            assert sublayer.value_group == group
            feature_in, feature_out = sublayer.feature_factors
            expected = sum(
                sublayer.token_maps[h] @ terms @ (feature_out[h].T @ feature_in[h].T) for h in range(len(feature_in))
            )
            got = branch_sum(sublayer, terms)
            assert float((got - expected).abs().max()) < 1e-12 * float(expected.abs().max())
