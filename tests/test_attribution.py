"""pk.path_attribution: each path's attribution to a readout of a captured model.

Completeness against the models' own logits (GPT-2 and a Llama in float64 and float32, BERT through a
probe direction), each path's attribution against its term written literally from the design's
matrices, the sums by length against the dynamic programming of stack.length_sums(), the top and
bottom paths against a sort of every path, and the streaming walk against the stored one.
"""

import itertools
import math

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.core.paths import count_attribution_paths
from pathkernels.reference import pre_norm_path_attribution_ref

transformers = pytest.importorskip("transformers")

from test_real_models import bert, gpt2, llama  # noqa: E402


def model_logits(model, **inputs):
    with torch.no_grad():
        return model.eval()(**inputs).logits


def test_a_gpt2_logit_difference_is_the_sum_of_its_path_attributions():
    model = gpt2()
    ids = torch.randint(0, 50, (2, 9))
    stack, _ = capture_huggingface_residual(model, input_ids=ids)
    readout = pk.logit_diff(model, 3, 7)
    result = pk.path_attribution(stack, readout, positions=[8, 4], batch=1)
    logits = model_logits(model, input_ids=ids)[1]
    expected = (logits[[8, 4], 3] - logits[[8, 4], 7])[:, None]
    torch.testing.assert_close(result.value, expected, rtol=1e-10, atol=1e-10)
    # Completeness over the stored paths, and every path enumerated once.
    assert result.attribution.shape == (count_attribution_paths(3, 4, 3), 2, 1)
    torch.testing.assert_close(result.attribution.sum(0) + result.constant, expected, rtol=1e-10, atol=1e-10)
    assert float(result.unenumerated.abs().max()) < 1e-10 * float(expected.abs().max())
    assert torch.equal(result.counts.sum(), torch.tensor(result.attribution.shape[0]))
    assert len({(tuple(p.tolist()), int(s)) for p, s in zip(result.paths, result.path_sources)}) == len(result.paths)


def test_the_sums_by_length_are_the_readout_of_the_length_sums():
    """by_length[k] = rᵀ S_k v with S_k from the dynamic programming (stack.length_sums())."""
    model = gpt2()
    ids = torch.randint(0, 50, (1, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    u = torch.randn(32, 2, dtype=torch.float64)
    result = pk.path_attribution(stack, u, positions=[6, 2], top_k=0)
    sums = stack.length_sums()[:, 0]  # [L+1, n, d]
    gamma, beta = capture.final_weight, capture.final_bias
    v = u * gamma[:, None]
    v = v - v.mean(0, keepdim=True)
    r = capture.final_scale[0, [6, 2]]
    expected = torch.einsum("knd,dr->knr", sums, v)[:, [6, 2]] * r[None, :, None]
    torch.testing.assert_close(result.by_length, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.constant, (beta @ u).expand(2, 2))


def literal_attributions(stack, capture, position, u):
    """Every pre-LN path's attribution from its matrices: rᵀ (A D)⋯ K (C Γ W_V W_O)⋯ v, with the
    sources written out here (the embedding, per layer the constant rows and the MLP's output)."""
    layers, heads, width = stack.num_layers, stack.num_heads, stack.d_model
    n = stack.attn.shape[-1]
    attn, w_v, w_o = stack.attn[0].double(), stack.w_v.double(), stack.w_o.double()
    centre = torch.eye(width, dtype=torch.float64) - 1.0 / width
    ones = torch.ones(n, 1, dtype=torch.float64)
    sources = [(0, "embedding", capture.embedding[0])]
    for layer in range(layers):
        rows = sum(
            ones @ ((capture.norm_bias[layer, 0] @ w_v[layer, h] + capture.value_bias[layer, h]) @ w_o[layer, h])[None]
            for h in range(heads)
        )
        sources.append((layer + 1, f"L{layer} attention bias", rows + capture.output_bias[layer]))
        sources.append((layer + 1, f"L{layer} MLP", capture.mlp_out[0, layer]))
    r = torch.zeros(n, dtype=torch.float64)
    r[position] = capture.final_scale[0, position]
    v = centre @ torch.diag(capture.final_weight) @ u
    maps = (attn, capture.norm_scale[0, :, 0], capture.norm_weight[:, 0], w_v, w_o)
    out = {}
    for first_layer, name, source in sources:
        for choice in itertools.product([-1, *range(heads)], repeat=layers - first_layer):
            path = (-1,) * first_layer + choice
            out[(path, name)] = float(pre_norm_path_attribution_ref(*maps, source, list(path), r, v))
    return out


def test_each_path_attribution_is_its_literal_term():
    layers, heads, width, n = 2, 2, 8, 5
    model = gpt2(layers, heads, width)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, n)))
    u = torch.randn(width, dtype=torch.float64)
    result = pk.path_attribution(stack, u, positions=3)
    expected = literal_attributions(stack, capture, 3, u)
    got = {
        (tuple(p.tolist()), result.source_names[int(s)]): float(a[0, 0])
        for p, s, a in zip(result.paths, result.path_sources, result.attribution)
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-11, abs_tol=1e-12), (key, got[key], value)


def test_the_top_and_bottom_paths_are_those_of_a_sort():
    model = gpt2().eval()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 9)))
    result = pk.path_attribution(stack, pk.logit_diff(model, 1, 2), top_k=7)
    ordered = torch.sort(result.attribution[:, 0, 0], descending=True)
    one = pk.path_attribution(stack, pk.logit_diff(model, 1, 2), top_k=1)  # the fold's smallest list
    assert one.top_values.shape[0] == 1 and float(one.top_values[0, 0, 0]) == float(ordered.values[0])
    assert float(one.bottom_values[0, 0, 0]) == float(ordered.values[-1])
    torch.testing.assert_close(result.top_values[:, 0, 0], ordered.values[:7], rtol=0, atol=0)
    torch.testing.assert_close(result.bottom_values[:, 0, 0], ordered.values.flip(0)[:7], rtol=0, atol=0)
    for rank in range(7):
        index = ordered.indices[rank]
        assert torch.equal(result.top_paths[rank, 0, 0], result.paths[index])
        assert int(result.top_sources[rank, 0, 0]) == int(result.path_sources[index])
    rows = result.table()
    assert [row["rank"] for row in rows] == list(range(1, 8))
    assert rows[0]["attribution"] == float(ordered.values[0])
    assert " from " in rows[0]["path"] or rows[0]["path"].endswith("(direct)")


def test_a_small_budget_streams_the_same_answer():
    """A budget too small to keep every path: chunks of a few nodes, no stored attributions, the
    same sums (to rounding: another order) and the same top paths."""
    model = gpt2()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 9)))
    readout = pk.logit_diff(model, 4, 5)
    whole = pk.path_attribution(stack, readout, top_k=5)
    streamed = pk.path_attribution(stack, readout, top_k=5, memory_budget=20_000)
    assert whole.attribution is not None and streamed.attribution is None
    torch.testing.assert_close(streamed.by_source_length, whole.by_source_length, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(streamed.top_values, whole.top_values, rtol=0, atol=0)
    assert torch.equal(streamed.top_paths, whole.top_paths)


def test_max_length_leaves_the_longer_paths_to_unenumerated():
    model = gpt2()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 9)))
    readout = pk.logit_diff(model, 4, 5)
    whole = pk.path_attribution(stack, readout)
    short = pk.path_attribution(stack, readout, max_length=1)
    assert short.counts.sum() == count_attribution_paths(3, 4, 1)
    torch.testing.assert_close(short.by_length[:2], whole.by_length[:2], rtol=1e-12, atol=1e-14)
    assert bool((short.by_length[2:] == 0).all())
    torch.testing.assert_close(short.unenumerated, whole.by_length[2:].sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_llama_logit_difference_is_the_sum_of_its_path_attributions(dtype):
    """GQA, rotary, RMSNorm, a float32 softmax: complete to 1e-10 in float64 against the capture's
    forward pass, whose logits are the model's own to float32's rounding; in float32 to 1e-4."""
    model = llama(dtype=dtype)
    ids = torch.randint(0, 50, (1, 9))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    readout = pk.logit_diff(model, 3, 11)
    result = pk.path_attribution(stack, readout, positions=[8, 5])
    complete = result.by_source_length.sum((0, 1)) + result.constant
    logits = model_logits(model, input_ids=ids)[0].double()
    own = (logits[[8, 5], 3] - logits[[8, 5], 11])[:, None]
    if dtype == torch.float64:
        torch.testing.assert_close(complete, result.value, rtol=1e-10, atol=1e-10)
        assert float((result.value - own).abs().max()) <= 1e-5 * float(logits.abs().max())
    else:  # the float32 stream is a sum of its paths to float32's rounding, relative to the logits'
        # scale (the difference of two logits can be near 0: relative to it, 0.66 of the bound was seen)
        assert float((complete - own).abs().max()) <= 1e-4 * float(logits.abs().max())
    if dtype == torch.float64:  # exactly the capture's stream through the frozen final norm
        norm = capture.residual[0] * capture.final_scale[0, :, None] * capture.final_weight
        direct = norm[[8, 5]] @ readout.directions[0]
        torch.testing.assert_close(result.value[:, 0], direct + readout.bias, rtol=1e-12, atol=1e-12)


def test_a_bert_probe_is_the_sum_of_its_path_attributions():
    """Post-LN, no final norm: a probe direction u reads the last hidden state, u · h_t."""
    model = bert()
    ids = torch.randint(0, 50, (1, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    u = torch.randn(32, dtype=torch.float64)
    result = pk.path_attribution(stack, u, positions=[0, 6])
    expected = (capture.residual[0, [0, 6]] @ u)[:, None]
    torch.testing.assert_close(result.value, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.by_source_length.sum((0, 1)), expected, rtol=1e-10, atol=1e-10)


def test_a_padded_sequence_reads_as_it_does_alone():
    model = gpt2()
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    alone, _ = capture_huggingface_residual(model, input_ids=ids[1:, :6])
    readout = pk.logit_diff(model, 0, 9)
    padded = pk.path_attribution(stack, readout, batch=1)
    single = pk.path_attribution(alone, readout)
    assert padded.positions.tolist() == [5]  # the last real token
    torch.testing.assert_close(padded.value, single.value, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded.by_source_length, single.by_source_length, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_attribution: expected positions of real tokens"):
        pk.path_attribution(stack, readout, batch=1, positions=7)


def test_bad_arguments_are_refused_by_name():
    model = gpt2()
    ids = torch.randint(0, 50, (1, 5))
    stack, _ = capture_huggingface_residual(model, input_ids=ids)
    plain = pk.adapters.from_huggingface(model, input_ids=ids)
    readout = pk.logit_diff(model, 0, 1)
    cases = [
        ((plain, readout), {}, r"expected a stack with a residual_capture"),
        ((stack, torch.randn(7)), {}, r"expected readout to be a Readout .* d = 32, got \[7\]"),
        ((stack, readout), {"max_length": 4}, r"expected max_length in \[0, 3\], got 4"),
        ((stack, readout), {"batch": 1}, r"expected batch in \[0, 1\), got 1"),
        ((stack, readout), {"top_k": -1}, r"expected top_k >= 0"),
        ((stack, readout), {"positions": 5}, r"expected positions of real tokens"),
        ((stack, readout), {"positions": []}, r"expected at least one position in positions, got an empty list"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=r"^pathkernels\.path_attribution: " + message):
            pk.path_attribution(*args, **kwargs)
    with pytest.raises(ValueError, match=r"^pathkernels\.logit_diff: expected b to be a token id in \[0, 50\)"):
        pk.logit_diff(model, 0, 50)
    with pytest.raises(ValueError, match=r"^pathkernels\.logit: expected a GPT-2 or Llama-family model, .* 'bert'"):
        pk.logit(transformers.BertForMaskedLM(bert().config), 0)  # its MLM head transforms first


def test_a_tree_restricts_the_paths_to_its_head_choices():
    """tree=: the attributions of its head choices, from every source below each one's lowest head,
    are those of the full enumeration; the other paths' share is unenumerated."""
    model = gpt2()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 8)))
    readout = pk.logit_diff(model, 4, 5)
    every = pk.path_attribution(stack, readout, top_k=3)
    chosen = pk.PathTree.from_paths(torch.tensor([[-1, -1, -1], [0, -1, 2], [-1, 3, -1], [1, 1, 1]]), num_heads=4)
    some = pk.path_attribution(stack, readout, tree=chosen, top_k=3)
    rows = {tuple(row) for row in chosen.paths().tolist()}
    inside = torch.tensor([tuple(row) in rows for row in every.paths.tolist()])
    assert int(some.counts.sum()) == int(inside.sum()) == some.paths.shape[0]
    expected = {
        (tuple(p.tolist()), int(s)): v for p, s, v in zip(every.paths, every.path_sources, every.attribution[:, 0, 0])
    }
    for path, source, value in zip(some.paths, some.path_sources, some.attribution[:, 0, 0]):
        assert float(value) == pytest.approx(float(expected[tuple(path.tolist()), int(source)]), rel=1e-12, abs=1e-15)
    outside = every.attribution[~inside, 0, 0].sum()
    torch.testing.assert_close(some.unenumerated[0, 0], outside, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_attribution: the tree has 2 layers"):
        pk.path_attribution(stack, readout, tree=pk.PathTree.complete(2, 4, skip=True))


def test_the_result_methods_refuse_arguments_outside_it_by_name():
    """PathAttribution.plot(k=-1) drew all but the last path ([:k]); a position or readout beyond
    the result raised a raw IndexError, a negative one read from the end."""
    pytest.importorskip("matplotlib")
    model = gpt2()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    result = pk.path_attribution(stack, pk.logit_diff(model, 1, 2), top_k=3)
    for k, error, message in (
        (-1, ValueError, r"expected top_k >= 1, got -1"),
        (0, ValueError, r"expected top_k >= 1, got 0"),
        (2.0, TypeError, r"expected top_k to be an int, got float 2\.0"),
    ):
        with pytest.raises(error, match=r"^pathkernels\.PathAttribution\.plot: " + message):
            result.plot(k)
    for method in ("table", "plot", "to_frame"):
        for name in ("position", "readout"):
            for value, error in ((1, ValueError), (-1, ValueError), (0.0, TypeError)):
                with pytest.raises(error, match=rf"^pathkernels\.PathAttribution\.{method}: expected {name} "):
                    getattr(result, method)(**{name: value})
    with pytest.raises(ValueError, match=r"^pathkernels\.PathAttribution\.table: expected which='top' or 'bottom'"):
        result.table(which="middle")
    assert len(result.table()) == 3 and result.plot(1) is not None


# --- tokens as text -------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of words ``t0 … t{V-2}`` and ``[UNK]``, split on whitespace."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_tokens_may_be_given_as_text_through_the_models_tokenizer(tmp_path):
    """``logit``/``logit_diff``/``to_single_token`` take one token's text: through ``tokenizer=``,
    a TransformerLens model's own, or the tokenizer saved beside a Hugging Face model's weights;
    the readout is the one of its id. Text of two tokens, or none, and a model without a tokenizer
    are refused by name."""
    transformers = pytest.importorskip("transformers")
    model = gpt2()
    tokenizer = word_tokenizer(model.config.vocab_size)
    assert pk.to_single_token(model, "t5", tokenizer=tokenizer) == 5
    by_text = pk.logit_diff(model, "t5", " t7", tokenizer=tokenizer)
    by_id = pk.logit_diff(model, 5, 7)
    torch.testing.assert_close(by_text.directions, by_id.directions, rtol=0, atol=0)
    assert by_text.labels == by_id.labels and pk.logit(model, "t9", tokenizer=tokenizer).labels == ("logit[9]",)
    with pytest.raises(
        ValueError, match=r"pathkernels.logit_diff: a is text, and GPT2LMHeadModel has no tokenizer .* pass tokenizer="
    ):
        pk.logit_diff(model, "t5", 7)
    with pytest.raises(
        ValueError, match=r"expected b='t5 t6' to be one token of the model's tokenizer; it is 2: \[5, 6\]"
    ):
        pk.logit_diff(model, 1, "t5 t6", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"text='' is no token of the model's tokenizer \(it encodes to nothing\)"):
        pk.to_single_token(model, "", tokenizer=tokenizer)
    with pytest.raises(TypeError, match=r"pathkernels.to_single_token: expected text to be a str, got int"):
        pk.to_single_token(model, 5, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)  # its tokenizer lies beside it
    assert pk.to_single_token(saved, "t11") == 11
    torch.testing.assert_close(pk.logit(saved, "t3").directions, pk.logit(model, 3).directions)
    pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    hooked = tl_model()
    hooked.tokenizer = tokenizer
    assert pk.logit_diff(hooked, "t2", "t4").labels == pk.logit_diff(hooked, 2, 4).labels


# --- per-head totals, shares and the results' faces ----------------------------------------------


def literal_head_totals(result, heads: int) -> torch.Tensor:
    """``[L, H, L, P, R]`` from every kept path, written out: each path's attribution added at each
    of its heads, at the head's place in the path counted from its source (the lowest layer)."""
    layers = result.paths.shape[1]
    totals = torch.zeros(layers, heads, layers, *result.attribution.shape[1:], dtype=torch.float64)
    for path, value in zip(result.paths.tolist(), result.attribution):
        place = 0
        for layer, head in enumerate(path):
            if head >= 0:
                totals[layer, head, place] += value
                place += 1
    return totals


def test_head_totals_and_shares_are_those_of_every_path():
    """``by_head`` is each path's attribution added at each head it takes, by place (a literal
    loop over every kept path), streamed or not and with a tree; ``absolute`` is the sum of their
    absolute values and each row's ``share`` its attribution over it, for a negative readout too;
    ``head_table`` lists the totals largest first."""
    pytest.importorskip("pandas")
    model = gpt2().eval()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 8)))
    readout = pk.logit_diff(model, 4, 5)
    result = pk.path_attribution(stack, readout, positions=[3, 7], top_k=4)
    heads = stack.num_heads
    expected = literal_head_totals(result, heads)
    torch.testing.assert_close(result.by_head, expected, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(result.through_head, expected.sum(2), rtol=1e-12, atol=1e-13)
    absolute = result.attribution.abs().sum(0)
    torch.testing.assert_close(result.absolute, absolute, rtol=1e-12, atol=0)
    streamed = pk.path_attribution(stack, readout, positions=[3, 7], top_k=4, memory_budget=20_000)
    torch.testing.assert_close(streamed.by_head, result.by_head, rtol=1e-12, atol=1e-13)
    for position in (0, 1):
        rows = result.table(position=position)
        assert [row["share"] for row in rows] == pytest.approx(
            [row["attribution"] / float(absolute[position, 0]) for row in rows], rel=1e-12
        )
        table = result.head_table(position=position)
        assert len(table) == stack.num_layers * heads
        assert table["total"].abs().tolist() == sorted(table["total"].abs().tolist(), reverse=True)
        first = table.iloc[0]
        layer, head = int(first["head"][1]), int(first["head"].split("H")[1])
        assert first["total"] == pytest.approx(float(expected[layer, head, :, position, 0].sum()), rel=1e-12)
        assert first["as head 1"] == pytest.approx(float(expected[layer, head, 0, position, 0]), rel=1e-12, abs=1e-14)
    negative = pk.path_attribution(stack, pk.logit_diff(model, 5, 4), top_k=3)
    assert float(negative.absolute[0, 0]) == pytest.approx(float(result.absolute[1, 0]), rel=1e-12)
    assert [row["share"] for row in negative.table()] == pytest.approx(
        [row["attribution"] / float(result.absolute[1, 0]) for row in negative.table()], rel=1e-10
    )
    tree = pk.PathTree.from_paths(torch.tensor([[0, -1, 2], [1, 2, -1], [-1, -1, 3]]), num_heads=heads)
    restricted = pk.path_attribution(stack, readout, tree=tree, top_k=2)
    torch.testing.assert_close(restricted.by_head, literal_head_totals(restricted, heads), rtol=1e-12, atol=1e-13)


def test_every_result_prints_in_one_short_line_and_frames_every_cell(tmp_path):
    """``repr`` of the capture, its score side, a readout, an attribution and top paths: one line
    of shapes and a headline, no tensor's contents. ``to_frame`` holds every position and readout;
    ``plot(k)`` beyond the paths kept is refused; TopPaths frames and plots."""
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    model = gpt2().eval()
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 8)), query_key=True)
    readout = pk.Readout.of(torch.randn(stack.d_model, 2), stack.d_model)
    result = pk.path_attribution(stack, readout, positions=[2, 7], top_k=3)
    top = pk.top_paths(stack, pk.logit_diff(model, 4, 5), top_k=4)
    for thing, name in (
        (capture, "ResidualStreamCapture(pre-norm layernorm, B = 1, L = 3, n = 8, d = 32"),
        (capture.query_key, "QueryKeyCapture(B = 1, L = 3, H = 4, n = 8"),
        (readout, "Readout(u0, u1; d = 32"),
        (result, "PathAttribution(2 position(s) × 2 readout(s), "),
        (top, "TopPaths(the 4 largest paths of logit[4] − logit[5] at token 7: "),
    ):
        text = repr(thing)
        assert text.startswith(name) and "\n" not in text and len(text) < 700 and "tensor(" not in text, text
    frame = result.to_frame()
    assert list(frame.columns[:3]) == ["position", "readout", "rank"] and len(frame) == 2 * 2 * 3
    assert sorted(set(zip(frame["position"], frame["readout"]))) == [(2, "u0"), (2, "u1"), (7, "u0"), (7, "u1")]
    one = result.to_frame(position=1, readout=0)
    assert one["attribution"].tolist() == [row["attribution"] for row in result.table(position=1, readout=0)]
    with pytest.raises(ValueError, match=r"PathAttribution.plot: expected top_k <= 3, the paths this result kept"):
        result.plot(10)
    assert len(result.plot().axes[0].patches) == 6  # the 3 largest and the 3 smallest
    assert top.to_frame()["attribution"].tolist() == top.values.tolist()
    figure = top.plot(path=tmp_path / "top.png")
    assert len(figure.axes[0].patches) == 4 and "certified" in figure.axes[0].get_title()
    with pytest.raises(ValueError, match=r"TopPaths.plot: expected top_k <= 4"):
        top.plot(5)


# --- a batch of prompts ------------------------------------------------------------------------------


def test_a_batch_mean_is_the_mean_of_its_elements_path_by_path():
    """Three prompts of a right-padded batch, each with its own readout at its own last real token:
    every element is its own path_attribution; the mean's value is the mean of the model's own
    logit differences, its sums, totals and constant the means of the elements', and its top and
    bottom paths those of the path-by-path mean of the elements' attributions, written out."""
    model = gpt2().eval()
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 8:] = 0
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    pairs = [(1, 2), (4, 7), (3, 0)]
    readouts = [pk.logit_diff(model, a, b) for a, b in pairs]
    result = pk.batch_attribution(stack, readouts, top_k=4)
    logits = model(input_ids=ids, attention_mask=mask).logits.detach().double()
    last = [8, 5, 7]
    own = [float(logits[b, last[b], a] - logits[b, last[b], c]) for b, (a, c) in enumerate(pairs)]
    alone = [pk.path_attribution(stack, readouts[b], batch=b, top_k=4) for b in range(3)]
    for element, single in zip(result.elements, alone):
        torch.testing.assert_close(element.attribution, single.attribution, rtol=0, atol=0)
    mean = result.mean
    assert mean.positions.tolist() == [[8], [5], [7]] and mean.batch is None
    assert mean.labels == ("each element's own logit difference",)
    assert float(mean.value[0, 0]) == pytest.approx(sum(own) / 3, rel=1e-6)
    for name in ("by_source_length", "constant", "by_head", "value"):
        expected = torch.stack([getattr(r, name) for r in alone]).mean(0)
        torch.testing.assert_close(getattr(mean, name), expected, rtol=1e-14, atol=1e-15)
    by_path = torch.stack([r.attribution for r in alone]).mean(0)[:, 0, 0]
    ordered = torch.sort(by_path, descending=True)
    torch.testing.assert_close(mean.top_values[:, 0, 0], ordered.values[:4], rtol=0, atol=0)
    torch.testing.assert_close(mean.bottom_values[:, 0, 0], ordered.values.flip(0)[:4], rtol=0, atol=0)
    assert torch.equal(mean.top_paths[:, 0, 0], alone[0].paths[ordered.indices[:4]])
    torch.testing.assert_close(mean.absolute[0, 0], by_path.abs().sum(), rtol=1e-14, atol=0)
    row = mean.to_frame().iloc[0]
    assert row["position"] == "each element's own token (8, 5, 7)" and row["share"] == pytest.approx(
        float(ordered.values[0] / by_path.abs().sum()), rel=1e-12
    )
    assert repr(result).startswith("BatchAttribution(3 elements; mean: PathAttribution(the mean of 3 elements")
    assert len(mean.plot(2).axes[0].patches) == 4
    same = pk.batch_attribution(stack, pk.logit_diff(model, 1, 2), batch=[0, 2], positions=[[3, 4], [6, 7]], top_k=2)
    assert same.mean.labels == ("logit[1] − logit[2]",) and same.mean.positions.tolist() == [[3, 4], [6, 7]]
    torch.testing.assert_close(
        same.mean.value, (same.elements[0].value + same.elements[1].value) / 2, rtol=1e-15, atol=1e-15
    )
    tree = pk.PathTree.from_paths(torch.tensor([[0, -1, 2], [1, 2, -1]]), num_heads=stack.num_heads)
    restricted = pk.batch_attribution(stack, readouts, tree=tree, top_k=2)
    alone = [pk.path_attribution(stack, readouts[b], batch=b, tree=tree, top_k=2) for b in range(3)]
    for name in ("by_source_length", "by_head"):
        expected = torch.stack([getattr(r, name) for r in alone]).mean(0)
        torch.testing.assert_close(getattr(restricted.mean, name), expected, rtol=1e-14, atol=1e-15)


def test_a_batch_refuses_what_does_not_line_up_by_name():
    model = gpt2().eval()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (2, 6)))
    readout = pk.logit_diff(model, 1, 2)
    where = r"^pathkernels\.batch_attribution: "
    with pytest.raises(ValueError, match=where + r"expected one readout, or a list of 2 \(one per element\), got 3"):
        pk.batch_attribution(stack, [readout] * 3)
    with pytest.raises(
        ValueError,
        match=where + r"expected positions as None, one int or list for every element, or a list of 2 lists",
    ):
        pk.batch_attribution(stack, readout, positions=[[1], [2], [3]])
    with pytest.raises(ValueError, match=where + r"expected every element to read the same number of positions"):
        pk.batch_attribution(stack, readout, positions=[[1], [2, 3]])
    with pytest.raises(ValueError, match=where + r"expected batch to be a non-empty list"):
        pk.batch_attribution(stack, readout, batch=[])
    for empty in ([], [[], []]):
        with pytest.raises(ValueError, match=where + r"expected at least one position in positions"):
            pk.batch_attribution(stack, readout, positions=empty)
    with pytest.raises(ValueError, match=where + r"expected batch in \[0, 1\], got 2"):
        pk.batch_attribution(stack, readout, batch=[0, 2])
    # A budget too small to keep any path's attribution: the elements walk in step, streamed, and
    # the mean's top paths and sums are those of the whole budget's.
    streamed = pk.batch_attribution(stack, readout, memory_budget=20_000, top_k=3)
    whole = pk.batch_attribution(stack, readout, top_k=3)
    assert streamed.mean.attribution is None and whole.mean.attribution is not None
    torch.testing.assert_close(streamed.mean.by_source_length, whole.mean.by_source_length, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(streamed.mean.top_values, whole.mean.top_values, rtol=0, atol=0)
    assert torch.equal(streamed.mean.top_paths, whole.mean.top_paths)
    torch.testing.assert_close(streamed.mean.absolute, whole.mean.absolute, rtol=1e-12, atol=0)


# --- token and position embeddings apart ----------------------------------------------------------


def _with_embedding(stack, embedding):
    """A copy of a captured ``stack`` whose stream starts with ``embedding`` instead."""
    import copy
    import dataclasses

    other = copy.copy(stack)
    other.residual_capture = dataclasses.replace(stack.residual_capture, embedding=embedding, token_embedding=None)
    return other


@pytest.mark.parametrize("family", ["gpt2", "opt"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_embedding_splits_into_its_token_and_position_parts(dtype, family):
    """``split_embedding=True`` on a left-padded GPT-2 (or OPT) batch: every path from the embedding
    splits into a token part and a position part, each equal to the attribution of the same path
    on a copy whose stream starts with that part alone (``W_E[ids]``, and the rest), written from
    the model's weights; the other sources, the value and the unenumerated rest are unchanged."""
    if family == "opt":
        from test_model_families import family_model

        model = family_model("opt", dtype).eval()
        embedding_weight = model.model.decoder.embed_tokens.weight
    else:
        model = gpt2().to(dtype).eval()
        embedding_weight = model.transformer.wte.weight
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    readout = pk.logit_diff(model, 4, 5)
    for batch in (0, 1):
        whole = pk.path_attribution(stack, readout, batch=batch, top_k=3)
        split = pk.path_attribution(stack, readout, batch=batch, top_k=3, split_embedding=True)
        assert split.source_names == ["token embedding", *whole.source_names[1:], "position embedding"]
        token = embedding_weight.detach().double()[ids] * mask[..., None]
        alone = pk.path_attribution(_with_embedding(stack, token), readout, batch=batch, top_k=3)
        rest = pk.path_attribution(_with_embedding(stack, capture.embedding - token), readout, batch=batch, top_k=3)
        scale = float(whole.absolute.max())
        torch.testing.assert_close(split.by_source_length[0], alone.by_source_length[0], rtol=0, atol=1e-12 * scale)
        torch.testing.assert_close(split.by_source_length[-1], rest.by_source_length[0], rtol=0, atol=1e-12 * scale)
        torch.testing.assert_close(
            split.by_source_length[0] + split.by_source_length[-1],
            whole.by_source_length[0],
            rtol=0,
            atol=1e-12 * scale,
        )
        torch.testing.assert_close(split.by_source_length[1:-1], whole.by_source_length[1:], rtol=0, atol=0)
        torch.testing.assert_close(split.value, whole.value, rtol=0, atol=0)
        torch.testing.assert_close(split.unenumerated, whole.unenumerated, rtol=0, atol=1e-12 * scale)
        from_token = split.path_sources == 0
        assert torch.equal(split.paths[from_token], alone.paths[alone.path_sources == 0])
        torch.testing.assert_close(
            split.attribution[from_token], alone.attribution[alone.path_sources == 0], rtol=0, atol=1e-12 * scale
        )


def test_a_model_without_position_embeddings_apart_refuses_the_split():
    model = llama().eval()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    with pytest.raises(ValueError, match=r"^pathkernels\.path_attribution: split_embedding=True needs a model whose"):
        pk.path_attribution(stack, pk.logit_diff(model, 1, 2), split_embedding=True)
    with pytest.raises(TypeError, match=r"^pathkernels\.path_attribution: expected split_embedding to be"):
        pk.path_attribution(stack, pk.logit_diff(model, 1, 2), split_embedding="yes")


def test_walks_that_go_out_of_step_are_refused(monkeypatch):
    """The mean folds chunk by chunk: an element's walk one chunk short or out of order would pair
    the wrong paths, so it is refused, never averaged (a guard against a bug in the walk's order)."""
    from pathkernels.analysis import readout_trie

    model = gpt2().eval()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (2, 6)))
    original = readout_trie.Walker.emissions
    calls = []

    def shortened(self, *args):
        calls.append(1)
        walk = original(self, *args)
        if len(calls) == 2:  # the second element's walk loses its last chunk
            return iter(list(walk)[:-1])
        return walk

    monkeypatch.setattr(readout_trie.Walker, "emissions", shortened)
    with pytest.raises(RuntimeError, match=r"the elements' walks went out of step"):
        pk.batch_attribution(stack, pk.logit_diff(model, 1, 2), memory_budget=20_000)
