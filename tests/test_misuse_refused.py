"""Misuse that looked right and gave a silently wrong number is now refused by
name or made right: each test fails with its fix undone. Every case is checked against what the
user meant, computed by calls that were already right (separate calls per element, the model's
own forward)."""

import numpy as np
import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

from test_real_models import gpt2  # noqa: E402


@pytest.fixture(scope="module")
def batch_of_four():
    model = gpt2().double().eval()
    ids = torch.randint(0, 50, (4, 12))
    stack, _ = capture_huggingface_residual(model, input_ids=ids)
    return model, stack


def test_a_flat_list_of_one_position_per_element_is_refused_as_ambiguous(batch_of_four):
    """``positions=[9, 11, 10, 6]`` on a batch of 4 read all four positions in every element (a
    result of 4 blocks, none the intended mean); now refused, naming both unambiguous forms."""
    model, stack = batch_of_four
    readout = pk.logit_diff(model, 3, 7)
    with pytest.raises(ValueError, match=r"batch_attribution: positions=\[9, 11, 10, 6\] has one int per element"):
        pk.batch_attribution(stack, readout, positions=[9, 11, 10, 6])
    with pytest.raises(ValueError, match=r"one int per element .* \[\[9\], \[11\], \[10\], \[6\]\]"):
        pk.batch_attribution(stack, readout, positions=np.array([9, 11, 10, 6]))


@pytest.mark.parametrize("form", ["lists", "numpy", "tensor"])
def test_one_position_per_element_is_the_mean_of_separate_calls(batch_of_four, form):
    model, stack = batch_of_four
    readout = pk.logit_diff(model, 3, 7)
    chosen = [9, 11, 10, 6]
    positions = {
        "lists": [[p] for p in chosen],
        "numpy": np.array(chosen)[:, None],
        "tensor": torch.tensor(chosen)[:, None],
    }[form]
    result = pk.batch_attribution(stack, readout, positions=positions, batch=np.arange(4))
    separate = [pk.path_attribution(stack, readout, batch=b, positions=p).value for b, p in enumerate(chosen)]
    torch.testing.assert_close(result.mean.value, torch.stack(separate).mean(0), rtol=1e-12, atol=1e-12)


def test_the_same_positions_in_every_element_are_still_read(batch_of_four):
    """A flat list whose length is not the batch's stays the positions of every element."""
    model, stack = batch_of_four
    readout = pk.logit_diff(model, 3, 7)
    result = pk.batch_attribution(stack, readout, positions=[5, 8, 11])
    for b in range(4):
        alone = pk.path_attribution(stack, readout, batch=b, positions=[5, 8, 11]).value
        torch.testing.assert_close(result.elements[b].value, alone, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def scored():
    model = gpt2().double().eval()
    ids = torch.randint(0, 50, (1, 12))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    return model, ids, stack


@pytest.mark.parametrize("key", [9, -1])
@pytest.mark.parametrize(
    "function", ["score_pairs", "score_attribution", "score_top_paths", "top_score_pairs", "score_decomposition"]
)
def test_a_key_the_mask_forbids_is_refused_unless_asked_for(scored, function, key):
    """A key after the query (``key=-1`` included: the last token, after query 5) got a score the
    model never uses; now refused in every score function, and decomposed with allow_masked=True
    (the sum still the model's q·k there)."""
    _, _, stack = scored
    call = getattr(pk, function)
    named = {"keys": key} if function == "score_decomposition" else {"key": key}
    forbidden = rf"pathkernels\.{function}: the mask forbids query 5 to attend keys? \[{key}\] \(a later token"
    with pytest.raises(ValueError, match=forbidden):
        call(stack, 1, 0, query=5, **named)
    result = call(stack, 1, 0, query=5, allow_masked=True, **named)
    assert result is not None


def test_an_allowed_key_is_decomposed_as_before(scored):
    _, _, stack = scored
    pairs = pk.score_pairs(stack, 1, 0, query=9, key=5)
    assert pairs.score == pytest.approx(pairs.model_score, rel=1e-10)


def test_the_causal_check_refuses_a_forbidden_key(scored):
    model, ids, stack = scored
    with pytest.raises(ValueError, match=r"pathkernels\.causal_check: the mask forbids query 5 to attend key \[9\]"):
        pk.causal_check(
            model, stack, {"input_ids": ids}, [[-1, -1, -1]], ["embedding"], side="key", layer=1, head=0, query=5, key=9
        )


@pytest.mark.parametrize("capture", [capture_huggingface_residual, pk.adapters.from_huggingface])
def test_a_keyword_neither_the_capture_nor_the_model_takes_is_refused(capture):
    """``split_embedding=True`` handed to a capture went to the model's forward, whose **kwargs
    ignored it: no split, no error. Now refused by name; the model's own inputs still pass."""
    model = gpt2().double().eval()
    ids = torch.randint(0, 50, (1, 6))
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) \['split_embedding'\]"):
        capture(model, input_ids=ids, split_embedding=True)
    capture(model, input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(6)[None])


def test_positions_taken_from_a_left_padded_mask_are_announced():
    """A left-padded GPT-2 batch without position_ids: the capture counts positions from each row's
    first real token, so its value differs from model(ids, mask); it says so at run time."""
    model = gpt2().double().eval()
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.warns(UserWarning, match=r"left-padded row\(s\) 1 get positions counted from their first real token"):
        capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("side", ["readout", "key"])
def test_the_causal_check_refuses_a_model_other_than_the_stacks(scored, side):
    """The readout side ran with another model's final norm (123 % off); now every side refuses a
    model whose weights are not the capture's, naming the first parameter that differs. The same
    weights in another dtype are the same model."""
    model, ids, stack = scored
    other = gpt2().double().eval()
    request = dict(side=side, readout=pk.logit_diff(model, 3, 7), position=9, layer=1, head=0, query=9, key=5)
    with pytest.raises(ValueError, match=r"causal_check: expected model to be the model the stack was captured from"):
        pk.causal_check(other, stack, {"input_ids": ids}, [[-1, -1, -1]], ["embedding"], **request)
    changed = gpt2().double().eval()
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed.transformer.ln_f.bias[0] += 0.5
    with pytest.raises(ValueError, match=r"transformer\.ln_f\.bias holds other values"):
        pk.causal_check(changed, stack, {"input_ids": ids}, [[-1, -1, -1]], ["embedding"], **request)
    same = gpt2().float().eval()
    same.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert pk.adapters.capture.fingerprint_mismatch(same, stack.residual_capture.model_fingerprint) is None


# --- errors that named nothing, now named -----------------------------------------------------


def test_numpy_and_torch_integers_and_arrays_are_taken_where_ints_and_lists_are(scored):
    _, _, stack = scored
    by_list = pk.score_decompositions(stack, 1, [0, 2], query=9, keys=[3, 5])
    by_numpy = pk.score_decompositions(stack, 1, np.array([0, 2]), query=np.int64(9), keys=np.array([3, 5]))
    by_torch = pk.score_decompositions(stack, 1, torch.tensor([0, 2]), query=9, keys=torch.tensor([3, 5]))
    for a, b, c in zip(by_list, by_numpy, by_torch):
        torch.testing.assert_close(a.table, b.table, rtol=0, atol=0)
        torch.testing.assert_close(a.table, c.table, rtol=0, atol=0)


@pytest.mark.parametrize(
    "keys, message",
    [
        (torch.tensor(2.0), r"score_decomposition: expected keys to be an int, got float 2\.0"),
        (np.array([1.5]), r"score_decomposition: expected keys to be an int, got float 1\.5"),
        ("3", r"score_decomposition: expected keys to be an int, got str '3'"),
    ],
)
def test_keys_that_are_not_positions_are_refused_by_name(scored, keys, message):
    _, _, stack = scored
    with pytest.raises(TypeError, match=message):
        pk.score_decomposition(stack, 1, 0, query=9, keys=keys)


def test_result_tables_refuse_a_key_or_a_side_they_do_not_hold(scored):
    pytest.importorskip("pandas")
    _, _, stack = scored
    decomposition = pk.score_decomposition(stack, 1, 0, query=9, keys=[3, 5])
    with pytest.raises(TypeError, match=r"ScoreDecomposition: expected key to be an int, got str 'a'"):
        decomposition.to_frame("a")
    with pytest.raises(TypeError, match=r"ScoreDecomposition: expected key to be an int, got float 3\.5"):
        decomposition.to_frame(3.5)
    assert decomposition.to_frame(np.int64(5))["value"].sum() == pytest.approx(float(decomposition.scores[1]))
    pairs = pk.score_pairs(stack, 1, 0, query=9, key=5)
    with pytest.raises(ValueError, match=r"ScorePairs.to_frame: expected which to be 'top' or 'bottom', got 'x'"):
        pairs.to_frame("x")


def test_text_for_a_model_without_a_tokenizer_says_so():
    """A model saved without tokenizer files (the fixtures) was read with a tokenizer that encodes
    nothing: "it is 0: []"; now the error says there is no tokenizer and what to pass."""
    from pathkernels.fixtures import load_fixture

    model, _ = load_fixture("attn_only_2l")
    with pytest.raises(ValueError, match=r"pathkernels\.logit: token is text, and GPT2LMHeadModel has no tokenizer"):
        pk.logit(model, " the")


# --- the causal check's two removals ------------------------------------------------------------


def test_a_key_path_removed_at_the_key_alone_moves_that_score_alone(scored):
    """``at="one"`` takes the term out of the head's key input at the scored key only: no other key's
    score moves, so the attention there is exactly the softmax of the clean row with that one score
    moved (``a e^δ / (1 − a + a e^δ)``, δ the measured change). ``at="every"`` (the default) takes it
    out at every key: the other scores move too and the attention differs. The frozen predictions
    are the same."""
    model, ids, stack = scored
    paths, sources = [[-1, -1, -1], [0, -1, -1], [2, -1, -1]], ["embedding", "embedding", "embedding"]
    request = dict(side="key", layer=2, head=1, query=10, key=6)
    one = pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, at="one", **request)
    every = pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, **request)
    assert every.at == "every" and "at every token" in repr(every) and "at token 6 only" in repr(one)
    torch.testing.assert_close(one.predicted, every.predicted, rtol=0, atol=0)
    clean = torch.tensor(one.clean["attention"], dtype=torch.float64)
    moved = clean * one.score_change.double().exp()
    torch.testing.assert_close(one.pattern_change.double(), moved / (1 - clean + moved) - clean, rtol=1e-9, atol=1e-12)
    moved = clean * every.score_change.double().exp()
    assert (every.pattern_change.double() - (moved / (1 - clean + moved) - clean)).abs().max() > 1e-6
    frozen = pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, at="one", frozen=True, **request)
    torch.testing.assert_close(frozen.score_change, frozen.predicted, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"causal_check: expected at to be one of \('every', 'one'\), got 'all'"):
        pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, at="all", **request)


# --- one vocabulary ---------------------------------------------------------------------------


def test_top_k_is_the_one_name_and_k_still_works_with_a_warning(scored):
    model, _, stack = scored
    readout = pk.logit_diff(model, 3, 7)
    new = pk.top_paths(stack, readout, top_k=3, position=9)
    with pytest.warns(FutureWarning, match=r"top_paths: k= is now called top_k="):
        old = pk.top_paths(stack, readout, k=3, position=9)
    torch.testing.assert_close(new.values, old.values, rtol=0, atol=0)
    assert pk.top_paths(stack, readout, 3, position=9).values.shape[0] == 3  # positional as before
    with pytest.raises(TypeError, match=r"top_paths: got both k= and top_k="):
        pk.top_paths(stack, readout, k=3, top_k=3)
    with pytest.warns(FutureWarning, match=r"top_score_pairs: k= is now called top_k="):
        pk.top_score_pairs(stack, 1, 0, query=9, key=5, k=2)
    with pytest.warns(FutureWarning, match=r"score_top_paths: k= is now called top_k="):
        pk.score_top_paths(stack, 1, 0, query=9, key=5, k=2)


def test_a_share_is_of_the_absolute_sum_and_a_fraction_of_the_score(scored):
    """Attribution tables' ``share`` is value / Σ|values| (a layer-0 pair showed a "share" of 12.34
    where score tables divided by the score); score tables now call theirs ``fraction``, which sums
    to 1."""
    pd = pytest.importorskip("pandas")
    model, _, stack = scored
    frame = pk.score_decomposition(stack, 2, 1, query=9, keys=5).to_frame()
    assert "share" not in frame and frame["fraction"].sum() == pytest.approx(1.0, rel=1e-10)
    pairs = pk.score_pairs(stack, 1, 0, query=9, key=5, top_k=1000)
    assert pd.DataFrame(pairs.top)["fraction"].sum() == pytest.approx(1.0, rel=1e-10)
    attribution = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), positions=9, top_k=1000)
    shares = attribution.to_frame()["share"]
    assert shares.abs().sum() == pytest.approx(1.0, rel=1e-10)
    heads = attribution.head_table()
    assert isinstance(heads, pd.DataFrame) and list(heads.columns[:3]) == ["head", "total", "share"]


def test_a_negative_head_is_refused_in_every_place_of_a_list(scored):
    """``score_decompositions(stack, layer, [0, -1])``: a head index from the end would silently read
    the last head; every entry is held to [0, H)."""
    _, _, stack = scored
    for heads in ([0, -1], [-1, 0], np.array([1, -2])):
        with pytest.raises(ValueError, match=r"score_decompositions: expected head in \[0, 3\], got -"):
            pk.score_decompositions(stack, 1, heads, query=9)


def test_the_weights_fingerprint_is_each_parameters_sums_in_float64(monkeypatch):
    """Σw and Σw² of every parameter, taken block by block (the block shrunk here so that a weight
    spans several), equal the literal float64 sums."""
    from pathkernels.adapters import capture

    monkeypatch.setattr(capture, "_FINGERPRINT_BLOCK", 7)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.LayerNorm(6)).float()
    prints = capture.weights_fingerprint(model)
    for name, parameter in model.named_parameters():
        values = parameter.detach().double()
        shape, total, squares = prints[name]
        assert shape == tuple(parameter.shape)
        assert total == pytest.approx(float(values.sum()), rel=1e-12, abs=1e-12)
        assert squares == pytest.approx(float(values.square().sum()), rel=1e-12)
