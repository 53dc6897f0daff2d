"""The causal check of a path (pathkernels.analysis.causal, pathkernels.adapters.ablation).

- With the norm the removal touches held at its clean scale, the measured change of the head's
  score is minus the path's share of it, to 1e-12 relative: the hooks remove exactly the term, from
  exactly that head's query or key input (grouped-query keys included), in one batched pass.
- Unfrozen, the final-norm check equals the model's own final norm applied to the stream less the
  term, computed here from its formula.
- On attn_only_2l, the previous-token head's path removed from an induction head's key input
  takes its attention off the copy target and lowers the predicted token's logit (numbers stated
  in docs/DESIGN.md).
"""

import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

from test_model_families import family_model  # noqa: E402
from test_scores import build  # noqa: E402

PATHS = [[-1, -1, -1], [0, -1, -1], [-1, 1, -1], [2, 3, -1], [-1, -1, -1], [-1, 0, -1]]
SOURCES = ["embedding", "embedding", "embedding", "embedding", "L0 MLP", "L0 attention bias"]


def model_of(name: str):
    if name in ("gpt2", "llama", "qwen3"):
        return build(name)
    model = family_model(name)
    return model


@pytest.mark.parametrize("side", ["query", "key"])
@pytest.mark.parametrize(
    "name", ["gpt2", "llama", "opt", "gpt_neox", "phi", "gemma2", "olmo", "gptj", "falcon", "falcon-grouped"]
)
def test_held_norms_make_the_change_the_paths_share_exactly(name, side):
    """Every path below the top layer, removed from head 1's query or key input (a key head of a
    grouped-query model serves its group): the measured score change is ``−`` the path's share to
    1e-12 of the score's scale, all paths in one forward pass, and the clean row reproduces the
    model's own score."""
    model = model_of(name)
    layers = model.config.num_hidden_layers
    paths = [p[:layers] for p in PATHS] if layers < 3 else PATHS
    paths = [p[: layers - 1] + [-1] for p in paths]  # nothing at the top layer
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    top = layers - 1
    result = pk.causal_check(
        model, stack, {"input_ids": ids}, paths, SOURCES, side=side, layer=top, head=1, query=5, key=2, frozen=True
    )
    pairs = pk.score_pairs(stack, top, 1, query=5, key=2)
    scale = abs(pairs.model_score) + float(result.predicted.abs().max())
    assert abs(result.clean["score"] - pairs.model_score) < 1e-12 * scale
    assert result.pattern_change is None and result.readout_change is None  # held: the score alone
    torch.testing.assert_close(result.score_change, result.predicted, rtol=0, atol=1e-12 * scale)
    one_side = pk.score_attribution(stack, top, 1, query=5, key=2, side=side)
    shares = {
        one_side.describe(p, s): float(v)
        for p, s, v in zip(one_side.paths, one_side.path_sources, one_side.attribution[:, 0, 0])
    }
    for path, predicted in zip(result.paths, result.predicted.tolist()):
        assert abs(predicted + shares[path]) < 1e-12 * scale, path


def test_a_padded_sequence_is_checked_alone():
    """The second sequence of a left-padded batch, its inputs cut to that row by the check: the held
    change is still the share, exactly, and only the capture warns about the padded row's positions."""
    model = build("llama")
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    with pytest.warns(UserWarning, match="left-padded row"):  # the capture says how it places them
        stack, _ = capture_huggingface_residual(model, **inputs, query_key=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check's own rows are no user's: nothing to warn about
        result = pk.causal_check(
            model, stack, inputs, PATHS, SOURCES, layer=2, head=3, query=5, key=3, frozen=True, batch=1
        )
    scale = float(result.predicted.abs().max()) + abs(result.clean["score"])
    torch.testing.assert_close(result.score_change, result.predicted, rtol=0, atol=1e-12 * scale)


def test_query_key_norms_are_recomputed_or_refused_when_held():
    model = model_of("qwen3")
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    paths, sources = [[0, -1], [-1, -1]], ["embedding", "embedding"]
    with pytest.raises(ValueError, match=r"^pathkernels\.causal_check: frozen=True holds the layer's input norm only"):
        pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, layer=1, head=0, key=2, frozen=True)
    result = pk.causal_check(model, stack, {"input_ids": ids}, paths, sources, layer=1, head=0, key=2)
    assert result.score_change.shape == (2,) and bool(torch.isfinite(result.pattern_change).all())


def test_the_final_norm_is_recomputed_for_a_value_path():
    """side="readout": the change of a logit difference with each path's term taken out of the
    stream entering GPT-2's final LayerNorm, which the check recomputes; here from its formula."""
    model = build("gpt2")
    ids = torch.randint(0, 50, (1, 6))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    readout = pk.logit_diff(model, 3, 7)
    result = pk.causal_check(model, stack, {"input_ids": ids}, PATHS, SOURCES, side="readout", readout=readout)
    terms = pk.path_terms(stack, PATHS, SOURCES)[:, -1]  # [M, d] at the last token
    norm = model.transformer.ln_f

    def layer_norm(x):
        x = x - x.mean(-1, keepdim=True)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double() + norm.bias.double()

    direction = readout.directions[0]
    residual = capture.residual[0, -1]
    expected = (layer_norm(residual - terms) - layer_norm(residual)) @ direction
    torch.testing.assert_close(result.readout_change, expected, rtol=1e-10, atol=1e-12)
    attribution = pk.path_attribution(stack, readout)
    assert abs(result.clean["readout"] - float(attribution.value)) < 1e-10
    # Positions count from the end when negative, as in path_attribution.
    last = pk.causal_check(
        model, stack, {"input_ids": ids}, PATHS, SOURCES, side="readout", readout=readout, position=-1
    )
    assert torch.equal(last.readout_change, result.readout_change) and last.position == 5
    with pytest.raises(ValueError, match=r"frozen=True with side='readout' is each path's attribution itself"):
        pk.causal_check(model, stack, {"input_ids": ids}, PATHS, SOURCES, side="readout", readout=readout, frozen=True)


def test_removing_the_previous_token_path_takes_the_induction_heads_off_the_copy():
    """attn_only_2l at token 20, key 5 (the token after the first copy), the logit of the token that
    followed it: ``L0H0 from embedding`` removed from each layer-1 head's key input takes that head's
    attention on key 5 from 0.73–0.98 to below 0.03 and lowers the logit by 2.4–6.5 (L1H0: 0.977 to
    0.027, −5.50), while each other one-head path moves the attention by at most 0.28."""
    from pathkernels.fixtures import load_fixture

    model, inputs = load_fixture("attn_only_2l")
    stack, _ = capture_huggingface_residual(model, **inputs, query_key=True)
    target = int(inputs["input_ids"][0, 5])
    paths, sources = [[0, -1], [1, -1], [2, -1], [3, -1]], ["embedding"] * 4
    for head in range(4):
        result = pk.causal_check(
            model, stack, inputs, paths, sources, layer=1, head=head, query=20, key=5, readout=pk.logit(model, target)
        )
        attention_after = result.clean["attention"] + result.pattern_change
        assert result.clean["attention"] > 0.7 and float(attention_after[0]) < 0.03, result.to_frame()
        assert float(result.readout_change[0]) < -2.3, result.to_frame()
        assert float(result.pattern_change[1:].abs().max()) < 0.3
        assert float(result.score_change[0]) < -6.5 and float(result.predicted[0]) < -6.5
    assert abs(float(result.clean["readout"]) - 8.977184759839107) < 1e-9


def test_arguments_are_refused_by_name():
    model = build("gpt2")
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    inputs = {"input_ids": ids}
    for kwargs, match in (
        ({"side": "value"}, r"expected side to be one of"),
        ({"layer": 1, "head": 0}, r"a score path needs layer, head and key"),
        ({"layer": 1, "head": 0, "key": 2}, r"expected paths of the stream entering layer 1"),
        ({"layer": 2, "head": 0, "key": 2, "frozen": "yes"}, r"expected frozen to be"),
    ):
        with pytest.raises((ValueError, TypeError), match=r"^pathkernels\.causal_check: " + match):
            pk.causal_check(model, stack, inputs, [[-1, 1, -1]], ["embedding"], **kwargs)
    with pytest.raises(TypeError, match=r"expected inputs to be the dict of model inputs"):
        pk.causal_check(model, stack, ids, [[-1, -1, -1]], ["embedding"], layer=2, head=0, key=1)


def test_a_model_or_inputs_other_than_the_stacks_are_refused():
    """Other inputs of the same length, another model of the same shape, or inputs of another
    length: the measured changes would belong to another forward pass than the predicted ones
    (they were returned: predicted 0.00199, measured 0.00036, with frozen=True), or a raw error."""
    model = build("gpt2")
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    path = ([[-1, -1, -1]], ["embedding"])
    options = {"layer": 2, "head": 0, "key": 1, "frozen": True}
    check = pk.causal_check(model, stack, {"input_ids": ids}, *path, **options)
    torch.testing.assert_close(check.score_change, check.predicted, rtol=1e-12, atol=1e-15)
    other_ids = (ids + 1) % 50
    other_model = build("gpt2")
    with torch.no_grad():
        for parameter in other_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    where = r"^pathkernels\.causal_check: "
    with pytest.raises(ValueError, match=where + r"the model on these inputs scores query 5 against key 1 at"):
        pk.causal_check(model, stack, {"input_ids": other_ids}, *path, **options)
    with pytest.raises(ValueError, match=where + r"expected model to be the model the stack was captured from"):
        pk.causal_check(other_model, stack, {"input_ids": ids}, *path, **options)
    with pytest.raises(ValueError, match=where + r"expected inputs of the stack's 1 sequence\(s\) of 6 tokens"):
        pk.causal_check(model, stack, {"input_ids": ids[:, :5]}, *path, **options)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_transformer_lens_model_is_refused_by_name():
    transformer_lens = pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    del transformer_lens
    model = tl_model()
    stack, _ = pk.adapters.capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 5)), query_key=True)
    with pytest.raises(TypeError, match=r"^pathkernels\.causal_check: expected model to be the Hugging Face model"):
        pk.causal_check(model, stack, {}, [[-1, -1, -1]], ["embedding"], layer=2, head=0, key=1)
