"""Inputs that used to give a wrong number without a word: each is now a clear error naming the
public function and the argument.

- flags given as strings (``"no"`` is truthy) or numbers;
- several positions to ``top_paths``, which reads one (it read the first);
- negative token ids through TransformerLens, which wrap around to the end of the vocabulary;
- a ``Readout`` with a NaN bias (a NaN value) or a bias of another size (a broadcast error);
- meta index lists beside real operands (the op returned uninitialised memory).
"""

import pytest
import torch

import pathkernels as pk
from pathkernels.analysis.attribution import Readout
from pathkernels.testing import random_attention


def network():
    torch.manual_seed(0)
    attn = random_attention(1, 2, 2, 4, 4, dtype=torch.float64)
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    return attn, x


def flag_calls():
    attn, x = network()
    tree = pk.PathTree.complete(2, 2)
    return {
        "pathkernels.path_residuals: expected progress": lambda v: pk.path_residuals(attn, tree, progress=v),
        "pathkernels.path_residuals: expected materialize": lambda v: pk.path_residuals(attn, tree, materialize=v),
        "pathkernels.path_residuals: expected fast": lambda v: pk.path_residuals(attn, tree, fast=v),
        "pathkernels.path_residuals: expected all_ranks": lambda v: pk.path_residuals(attn, tree, all_ranks=v),
        "pathkernels.path_statistics: expected progress": lambda v: pk.path_statistics(attn, tree, progress=v),
        "pathkernels.path_statistics: expected all_ranks": lambda v: pk.path_statistics(attn, tree, all_ranks=v),
        "pathkernels.decompose: expected progress": lambda v: pk.decompose(attn, progress=v),
        "pathkernels.rollout: expected residual": lambda v: pk.rollout(attn, residual=v),
        "pathkernels.matrix_norms: expected residual": lambda v: pk.matrix_norms(x, residual=v),
        "pathkernels.residual_norm: expected return_norm": lambda v: pk.residual_norm(x, return_norm=v),
        "pathkernels.metrics.rank1_residual: expected relative": lambda v: pk.metrics.rank1_residual(x, relative=v),
    }


@pytest.mark.parametrize("value", ["no", 0, None])
@pytest.mark.parametrize("name", list(flag_calls()))
def test_flags_are_true_or_false(name, value):
    with pytest.raises(TypeError, match="^" + name.replace(".", r"\.") + " to be True or False"):
        flag_calls()[name](value)


def captured_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    ).double()
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    return model, stack


def test_the_searches_flags_and_top_paths_one_position():
    model, stack = captured_gpt2()
    readout = pk.logit_diff(model, 1, 2)
    for name in ("largest", "record", "progress"):
        with pytest.raises(TypeError, match=rf"^pathkernels\.top_paths: expected {name} to be True or False"):
            pk.top_paths(stack, readout, 3, **{name: "no"})
    with pytest.raises(TypeError, match=r"^pathkernels\.path_attribution: expected progress to be True or False"):
        pk.path_attribution(stack, readout, progress="yes")
    with pytest.raises(TypeError, match=r"^pathkernels\.top_paths: expected position to be one token position"):
        pk.top_paths(stack, readout, 3, position=[1, 2])
    with pytest.raises(TypeError, match=r"^pathkernels\.AttentionStack\.length_sums: expected biases"):
        stack.length_sums(biases="no")
    one = pk.top_paths(stack, readout, 3, position=4)
    assert one.position == 4


def test_a_readout_with_a_non_finite_or_mismatched_bias_is_refused():
    model, stack = captured_gpt2()
    direction = torch.randn(1, 16, dtype=torch.float64)
    damaged = {
        r"expected finite readout bias": Readout(direction, torch.tensor([float("nan")]), ("u",)),
        r"expected finite readout directions": Readout(direction * float("inf"), torch.zeros(1), ("u",)),
        r"expected the readout's bias to hold one value per direction \(1\), got \[2\]": Readout(
            direction, torch.zeros(2), ("u",)
        ),
        r"expected one readout label per direction \(1\)": Readout(direction, torch.zeros(1), ("u", "v")),
        r"expected the readout's directions to be real numbers": Readout(
            direction.to(torch.complex128), torch.zeros(1), ("u",)
        ),
    }
    for message, readout in damaged.items():
        with pytest.raises((ValueError, TypeError), match=r"^pathkernels\.path_attribution: " + message):
            pk.path_attribution(stack, readout)


def test_negative_token_ids_are_refused_through_transformer_lens():
    transformer_lens = pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    model = tl_model()
    vocab = model.cfg.d_vocab
    for call, where in (
        (pk.adapters.from_transformer_lens, "from_transformer_lens"),
        (pk.adapters.capture_transformer_lens_residual, "capture_transformer_lens_residual"),
    ):
        with pytest.raises(ValueError, match=rf"{where}: expected token ids in \[0, {vocab}\) .*from -2 to 1"):
            call(model, [[1, -2]])
        with pytest.raises(ValueError, match=rf"{where}: expected token ids in \[0, {vocab}\) .*to {vocab}"):
            call(model, torch.tensor([[1, vocab]]))
        with pytest.raises(TypeError, match=rf"{where}: expected integer token ids, got torch.float32"):
            call(model, torch.ones(1, 3))
        if type(model).__name__ == "HookedTransformer":  # its causal mask and positions end at n_ctx = 16
            call(model, torch.ones(1, 16, dtype=torch.long))
            with pytest.raises(ValueError, match=rf"{where}: 17 tokens, but the model's context is n_ctx = 16$"):
                call(model, torch.ones(1, 17, dtype=torch.long))
    assert transformer_lens is not None


def test_meta_index_lists_beside_real_operands_are_refused():
    """The CPU operands with meta parents and heads dispatched to the fake kernel, which returned
    uninitialised CPU memory as if it were the leaves' norms."""
    attn = torch.zeros(1, 1, 1, 2, 2, dtype=torch.float64)
    mean = torch.full((1, 1, 1, 2), 0.5, dtype=torch.float64)
    root = torch.tensor([[[0.5, -0.5], [-0.5, 0.5]]], dtype=torch.float64)
    index = [torch.zeros(1, dtype=torch.long, device="meta")]
    with pytest.raises(ValueError, match=r"path_chunk_norms: expected parents and heads with values .* got meta"):
        torch.ops.pathkernels.path_chunk_norms(attn, mean, root, mean[0, 0], None, None, index, index, 64)
