"""Padded batches: every function that takes token_mask gives, element by element, what each
sequence gives alone."""

import pytest
import torch

import pathkernels as pk
from pathkernels import adapters
from pathkernels.testing import padded_network, random_attention, transformer_lens_attention_only

# The padded-model tests compare path outputs of Hugging Face stacks, the attention-only network's
# (which pathkernels warns about for models with norms and MLPs, tested in test_adapters.py).
pytestmark = pytest.mark.filterwarnings("ignore:.*has norms and MLPs:UserWarning")

transformers = pytest.importorskip("transformers")

LENGTHS = [7, 4, 4, 5]  # two elements share a mask: one group of two


def gpt2_padded_batch(padding_side: str, pass_positions: bool = True):
    """A tiny GPT-2, a padded batch of LENGTHS and each sequence on its own (float64 stacks). Without
    ``pass_positions`` the adapter derives the left-padded sequences' positions from the mask."""
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=3, n_embd=24, vocab_size=50, n_positions=16)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    n = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), n, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), n, dtype=torch.long)
    sequences = [torch.randint(1, 50, (length,)) for length in LENGTHS]
    for b, sequence in enumerate(sequences):
        real = slice(n - len(sequence), n) if padding_side == "left" else slice(0, len(sequence))
        ids[b, real], mask[b, real] = sequence, 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # each sequence sees the positions it has alone
    extra = {"position_ids": positions} if pass_positions else {}
    padded = adapters.from_huggingface(model, input_ids=ids, attention_mask=mask, **extra)
    alone = [adapters.from_huggingface(model, input_ids=sequence[None]).to(torch.float64) for sequence in sequences]
    return padded.to(torch.float64), alone, mask.bool()


# The length sums here are the attention-only network's, on purpose: the warning says so.
@pytest.mark.filterwarnings("ignore:pathkernels.AttentionStack.length_sums.*has LayerNorm and MLPs")
@pytest.mark.parametrize("pass_positions", [True, False], ids=["position_ids", "derived"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_padded_gpt2_batch_matches_each_sequence_alone(padding_side, pass_positions):
    padded, alone, mask = gpt2_padded_batch(padding_side, pass_positions)
    assert torch.equal(padded.token_mask, mask)
    close = {"rtol": 1e-5, "atol": 1e-6}  # the float32 model computes each sequence in another batch
    tree = pk.PathTree.complete(2, 3, skip=True)
    products = pk.decompose(padded).results  # the stack itself: its token mask applies
    outputs = padded.path_residuals(tree, x=padded.residual_stream(0))
    outputs_from_function = pk.path_residuals(padded, tree, x=padded.residual_stream(0))
    torch.testing.assert_close(outputs_from_function.residual, outputs.residual, rtol=0, atol=0)
    sums = padded.length_sums()
    rolled = pk.rollout(padded)
    ratios = pk.metrics.residual_ratio(padded.hidden_states, token_mask=padded.token_mask)
    contraction = pk.metrics.dobrushin(padded.attn, token_mask=padded.token_mask[:, None, None, :])
    for b, single in enumerate(alone):
        real = mask[b].nonzero().flatten()
        expected = pk.decompose(single).results
        torch.testing.assert_close(products.residual[b], expected.residual[0], **close)
        torch.testing.assert_close(products.norm[b], expected.norm[0], **close)
        expected = single.path_residuals(tree, x=single.residual_stream(0))
        torch.testing.assert_close(outputs.residual[b], expected.residual[0], **close)
        torch.testing.assert_close(outputs.norm[b], expected.norm[0], **close)
        torch.testing.assert_close(sums[:, b, real], single.length_sums()[:, 0], **close)
        assert bool((sums[:, b, ~mask[b]] == 0).all())
        torch.testing.assert_close(rolled[b][real][:, real], pk.rollout(single)[0], **close)
        assert float(rolled[b].sum()) == pytest.approx(len(real))  # padded rows and columns are 0
        torch.testing.assert_close(ratios[:, b], pk.metrics.residual_ratio(single.hidden_states)[:, 0], **close)
        torch.testing.assert_close(contraction[b], pk.metrics.dobrushin(single.attn)[0], **close)
    # Without the mask the padded tokens count as tokens: the short sequences' numbers change.
    unmasked = pk.decompose(padded.attn).results
    assert not torch.allclose(unmasked.residual[1], products.residual[1], rtol=1e-3)


def test_padded_bert_batch_matches_each_sequence_alone():
    model = transformers.BertModel(
        transformers.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=50,
            max_position_embeddings=16,
        )
    )
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    padded = adapters.from_huggingface(model, input_ids=ids, attention_mask=mask).to(torch.float64)
    decomposition = pk.decompose(padded, x=padded.residual_stream(0))
    for b, length in enumerate((6, 3)):
        single = adapters.from_huggingface(model, input_ids=ids[b : b + 1, :length]).to(torch.float64)
        expected = pk.decompose(single, x=single.residual_stream(0)).results
        torch.testing.assert_close(decomposition.results.residual[b], expected.residual[0], rtol=1e-5, atol=1e-6)


def test_masked_metrics_and_engine_on_random_inputs():
    """Hand-made padding: each element's real block is row-stochastic, padded entries are junk."""
    batch, layers, heads, n, d = 3, 2, 2, 5, 3
    lengths = [5, 2, 3]
    attn, x, w_v, w_o, mask = padded_network(lengths, layers, heads, n, d)
    tree = pk.PathTree.complete(layers, heads, skip=True)
    masked = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, token_mask=mask)
    unbatched = pk.path_residuals(attn[1], tree, x=x[1], w_v=w_v, w_o=w_o, token_mask=mask[1])
    hidden = torch.randn(4, batch, n, d, dtype=torch.float64)
    for b, length in enumerate(lengths):
        alone = pk.path_residuals(
            attn[b : b + 1, ..., :length, :length], tree, x=x[b : b + 1, :length], w_v=w_v, w_o=w_o
        )
        torch.testing.assert_close(masked.residual[b], alone.residual[0])
        torch.testing.assert_close(masked.norm[b], alone.norm[0])
        real = hidden[:, b, :length]
        for metric in ("residual_ratio", "token_similarity", "effective_rank", "stable_rank"):
            function = getattr(pk.metrics, metric)
            torch.testing.assert_close(function(hidden, token_mask=mask)[:, b], function(real), msg=metric)
        for norm in ("frobenius", "composite"):
            torch.testing.assert_close(
                pk.metrics.rank1_residual(hidden, norm=norm, token_mask=mask)[:, b],
                pk.metrics.rank1_residual(real, norm=norm),
            )
    torch.testing.assert_close(unbatched.residual, masked.residual[1])
    # An all-true mask changes nothing.
    full = pk.path_residuals(attn[:1], tree, x=x[:1], w_v=w_v, w_o=w_o, token_mask=torch.ones(1, n))
    torch.testing.assert_close(full.residual, pk.path_residuals(attn[:1], tree, x=x[:1], w_v=w_v, w_o=w_o).residual)


def test_bad_masks_are_refused_clearly():
    attn = random_attention(2, 2, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(2, 2)
    with pytest.raises(
        ValueError, match=r"path_residuals: expected token_mask of shape \[B, n\] = \[2, 4\], got \[4\]"
    ):
        pk.path_residuals(attn, tree, token_mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_mask keeps no token of batch element 1"):
        pk.path_residuals(attn, tree, token_mask=torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="expected token_mask of bools or 0/1 values"):
        pk.decompose(attn, token_mask=torch.full((2, 4), 2))
    with pytest.raises(ValueError, match="materialize=True cannot honour token_mask"):
        pk.path_residuals(attn, tree, token_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), materialize=True)
    # Real queries that attend to padded keys: not row-stochastic on the real tokens, and the message
    # names the element of the whole batch.
    with pytest.raises(ValueError, match=r"but real token 0 of batch element 1, layer 0, head 0 sums to .*token_mask"):
        pk.path_residuals(attn, tree, token_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"dobrushin: expected token_mask with 4 dims"):
        pk.metrics.dobrushin(attn, token_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"residual_ratio: expected token_mask to broadcast against the rows"):
        pk.metrics.residual_ratio(torch.randn(3, 2, 4, 5), token_mask=torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_padded_transformer_lens_batch_matches_each_sequence_alone():
    pytest.importorskip("transformer_lens")
    model = transformer_lens_attention_only(n_layers=2, n_heads=2, d_model=16, d_head=8, n_ctx=16, d_vocab=30)
    ids = torch.randint(1, 30, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])  # right padding: the positions are those of the sequence alone
    padded = adapters.from_transformer_lens(model, ids, attention_mask=mask)
    assert torch.equal(padded.token_mask, mask.bool())
    alone = adapters.from_transformer_lens(model, ids[1:, :4])
    torch.testing.assert_close(
        pk.decompose(padded, x=padded.residual_stream(0)).results.residual[1],
        pk.decompose(alone, x=alone.residual_stream(0)).results.residual[0],
    )
    torch.testing.assert_close(padded.length_sums()[:, 1, :4], alone.length_sums()[:, 0])


def test_masked_calls_check_shapes_before_restricting():
    attn = random_attention(2, 2, 2, 4, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    tree = pk.PathTree.complete(2, 2)
    w_v, w_o = torch.randn(2, 2, 3, 2, dtype=torch.float64), torch.randn(2, 2, 2, 3, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"path_residuals: expected x of shape \[B, n, d\] = \[2, 4, d\], got \[1, 4, 3\]"
    ):
        pk.path_residuals(attn, tree, x=torch.randn(1, 4, 3, dtype=torch.float64), w_v=w_v, w_o=w_o, token_mask=mask)
