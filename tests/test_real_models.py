"""Paths of real transformers: a model's residual stream, norms frozen, as
an exact sum of paths from the embedding, the layers' constants and the MLP outputs; for GPT-2 and
ViT (pre-LN), BERT and RoBERTa (post-LN) and the Llama family (RMSNorm, grouped-query attention,
rotary positions, a float32 softmax).

Models are built from configs (no downloads), in float64, with every bias and every norm's γ and β
random, so that no term can hide behind a zero or a one.
"""

import itertools
import warnings

import pytest
import torch

from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")


def randomised(model, norm_marker: str):
    """``model`` in float64 with every bias drawn from N(0, 0.5²) and every norm's γ from U(0.5, 1.5)
    (norms: parameters whose name holds ``norm_marker``)."""
    model = model.double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif norm_marker in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def gpt2(layers: int = 3, heads: int = 4, width: int = 32):
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=layers, n_head=heads, n_embd=width, vocab_size=50, n_positions=16, initializer_range=0.3
        )
    )
    return randomised(model, norm_marker="ln_")


def test_the_paths_of_a_gpt2_sum_to_its_residual_stream():
    """Σ over path lengths of the exact sums equals the stream entering the final LayerNorm."""
    model = gpt2()
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (2, 9)))
    sums = stack.length_sums()
    assert sums.shape == (4, 2, 9, 32)
    total = sums.sum(0)
    error = (total - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    # Every length carries weight: the decomposition is not the attention-only network's.
    assert all(float(s.abs().max()) > 1e-3 for s in sums)


def enumerated_pre_norm_sums(sources, layers, heads, token_map, feature_map):
    """Σ by length of every pre-norm path written out: a source ``(first layer, [n, d])``, then at
    each later layer the skip or head h's ``token_map(l, h) @ · @ feature_map(l, h)``."""
    expected = torch.zeros(layers + 1, *sources[0][1].shape, dtype=torch.float64)
    for first_layer, source in sources:
        later = range(first_layer, layers)
        for choice in itertools.product([None, *range(heads)], repeat=len(later)):
            term = source
            for layer, head in zip(later, choice):
                if head is not None:
                    term = token_map(layer, head) @ term @ feature_map(layer, head)
            expected[sum(h is not None for h in choice)] += term
    return expected


def test_the_length_sums_are_the_sums_of_the_enumerated_paths():
    """Each path's term written literally from the design's matrices (D = diag(1/σ), C = I − 11ᵀ/d,
    Γ = diag(γ)), summed by length, against the dynamic programming."""
    layers, heads, width, n = 2, 2, 8, 5
    model = gpt2(layers, heads, width)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, n)))
    attn, w_v, w_o, b_o = (
        t.double()[0] if t.dim() == 5 else t.double() for t in (stack.attn, stack.w_v, stack.w_o, stack.b_o)
    )
    centre = torch.eye(width, dtype=torch.float64) - 1.0 / width
    ones = torch.ones(n, 1, dtype=torch.float64)

    def token_map(layer, head):
        return attn[layer, head] @ torch.diag(capture.norm_scale[0, layer, 0])

    def feature_map(layer, head):
        return centre @ torch.diag(capture.norm_weight[layer, 0]) @ w_v[layer, head] @ w_o[layer, head]

    # Sources: the embedding before layer 0; after layer l's attention, its constant rows and its MLP.
    sources = [(0, capture.embedding[0])]
    for layer in range(layers):
        constant = sum(capture.norm_bias[layer, 0] @ w_v[layer, h] @ w_o[layer, h] for h in range(heads)) + b_o[layer]
        sources.append((layer + 1, ones @ constant[None] + capture.mlp_out[0, layer]))
    expected = enumerated_pre_norm_sums(sources, layers, heads, token_map, feature_map)
    torch.testing.assert_close(stack.length_sums()[:, 0], expected, rtol=1e-12, atol=1e-12)


def bert(layers: int = 3, heads: int = 4, width: int = 32):
    model = transformers.BertModel(
        transformers.BertConfig(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            hidden_size=width,
            intermediate_size=2 * width,
            vocab_size=50,
            max_position_embeddings=16,
            initializer_range=0.3,
        )
    )
    return randomised(model, norm_marker="LayerNorm")


def test_the_paths_of_a_bert_sum_to_its_last_hidden_state():
    """Post-LN: every branch, the skip included, passes the frozen norm after it; Σ over path
    lengths equals the last hidden state."""
    stack, capture = capture_huggingface_residual(bert(), input_ids=torch.randint(0, 50, (2, 9)))
    assert capture.layout == "post" and capture.final_scale is None
    sums = stack.length_sums()
    error = (sums.sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    assert all(float(s.abs().max()) > 1e-3 for s in sums)


def enumerated_post_norm_sums(stack, capture, batch: int = 0) -> torch.Tensor:
    """``[L+1, n, d]``: a post-norm model's paths summed by length, each written literally: a source,
    then at every sublayer after it the skip (D · C Γ) or a head (D A_h · W_h C Γ), with the norms'
    D = diag(1/σ), C = I − 11ᵀ/d and Γ = diag(γ); a sublayer's constant rows and the MLP's output
    enter after it as sources (D · C Γ, plus the norm's 1 βᵀ)."""
    layers, heads, width = stack.num_layers, stack.num_heads, stack.d_model
    n = stack.attn.shape[-1]
    attn, w_v, w_o, b_o = (
        t.double()[batch] if t.dim() == 5 else t.double() for t in (stack.attn, stack.w_v, stack.w_o, stack.b_o)
    )
    centre = torch.eye(width, dtype=torch.float64) - 1.0 / width
    ones = torch.ones(n, 1, dtype=torch.float64)

    def norm(layer, which):  # (D, C Γ) of a frozen LayerNorm
        return torch.diag(capture.norm_scale[batch, layer, which]), centre @ torch.diag(
            capture.norm_weight[layer, which]
        )

    # Sublayers in order: (layer, 0) attention, (layer, 1) MLP. Sources enter after a sublayer.
    sublayers = [(layer, which) for layer in range(layers) for which in (0, 1)]
    sources = [(0, capture.embedding[batch])]
    for index, (layer, which) in enumerate(sublayers):
        d, cg = norm(layer, which)
        inner = ones @ b_o[layer][None] if which == 0 else capture.mlp_out[batch, layer]
        sources.append((index + 1, d @ inner @ cg + ones @ capture.norm_bias[layer, which][None]))
    expected = torch.zeros(layers + 1, n, width, dtype=torch.float64)
    for first, source in sources:
        later = sublayers[first:]
        choices = [[None] if which == 1 else [None, *range(heads)] for _, which in later]
        for choice in itertools.product(*choices):
            term = source
            for (layer, which), head in zip(later, choice):
                d, cg = norm(layer, which)
                term = (
                    d @ term @ cg
                    if head is None
                    else d @ attn[layer, head] @ term @ w_v[layer, head] @ w_o[layer, head] @ cg
                )
            expected[sum(h is not None for h in choice)] += term
    return expected


def test_the_bert_length_sums_are_the_sums_of_the_enumerated_paths():
    layers, heads, width, n = 2, 2, 8, 5
    stack, capture = capture_huggingface_residual(bert(layers, heads, width), input_ids=torch.randint(0, 50, (1, n)))
    expected = enumerated_post_norm_sums(stack, capture)
    torch.testing.assert_close(stack.length_sums()[:, 0], expected, rtol=1e-12, atol=1e-12)


def test_other_families_are_refused_by_name():
    model = transformers.BloomModel(transformers.BloomConfig(n_layer=1, n_head=2, hidden_size=8, vocab_size=50))
    with pytest.raises(ValueError, match=r"^pathkernels\.adapters\.capture_huggingface_residual: GPT-2, .* 'bloom'"):
        capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 4)))


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_captured_stack_sums_the_model_by_path_length(family):
    """stack.length_sums() of a captured stack is the model's own decomposition, with no warning;
    arguments that belong to the attention-only network are refused."""
    model = gpt2() if family == "gpt2" else bert()
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (2, 9)))
    assert stack.residual_capture is capture
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sums = stack.length_sums()
    assert (sums.sum(0) - capture.residual).abs().max() < 1e-10 * capture.residual.abs().max()
    with pytest.raises(ValueError, match=r"^pathkernels\.AttentionStack\.length_sums: this stack holds the model"):
        stack.length_sums(biases=False)
    moved = stack.to(torch.float32)
    assert moved.residual_capture.embedding.dtype == torch.float64
    torch.testing.assert_close(moved.length_sums(), sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_padded_batch_is_decomposed_on_its_real_tokens(padding_side):
    """Each sequence's real rows sum to its stream; padded rows are 0."""
    model = gpt2()
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padding_side == "right":
        mask[1, 6:] = 0
    else:
        mask[1, :3] = 0
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    total = stack.length_sums().sum(0)
    real = mask.bool()
    assert bool((total[~real] == 0).all())
    error = (total[real] - capture.residual[real]).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error


def llama(family: str = "llama", layers: int = 3, heads: int = 4, kv_heads: int = 2, width: int = 32, dtype=None):
    """A Llama-family decoder with grouped-query attention and rotary positions; Llama's attention
    biases switched on, Qwen2's are there by design (query, key and value), Mistral has none."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    extra = {"attention_bias": True} if family == "llama" else {}
    config = config_class(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=width,
        intermediate_size=2 * width,
        vocab_size=50,
        max_position_embeddings=64,
        initializer_range=0.3,
        **extra,
    )
    model = randomised(model_class(config), norm_marker="norm")
    return model if dtype is None else model.to(dtype)


def final_norm_input(model, **inputs):
    """The stream entering the final norm in the model's own forward pass (no hooks of ours that
    change it)."""
    seen = []
    handle = model.base_model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_paths_of_a_llama_family_model_sum_to_its_residual_stream(family):
    """RMSNorm without centring or β, grouped-query attention, rotary positions and a float32
    softmax and float32 norms in the model's own forward pass: Σ over path lengths equals the stream
    entering the final norm to 1e-10, and that stream is the model's own computed in float64 to
    1e-12 (to float32's rounding of the model's unmodified forward pass)."""
    from float64_reference import float64_steps

    model = llama(family)
    ids = torch.randint(0, 50, (2, 9))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    assert capture.layout == "pre" and capture.norm == "rmsnorm" and not capture.centred
    assert capture.attn_row_sums is None  # the softmax computed in float64
    if family != "mistral":
        assert float(capture.value_bias.abs().max()) > 0.1
    assert capture.unembedding is model.lm_head.weight or torch.equal(capture.unembedding, model.lm_head.weight)
    sums = stack.length_sums()
    error = (sums.sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    assert all(float(s.abs().max()) > 1e-3 for s in sums)
    own = final_norm_input(model, input_ids=ids)
    assert (own - capture.residual).abs().max() < 1e-5 * own.abs().max()
    with float64_steps(model):
        exact = final_norm_input(model, input_ids=ids)
    assert (exact - capture.residual).abs().max() < 1e-12 * exact.abs().max()


def test_the_llama_length_sums_are_the_sums_of_the_enumerated_paths():
    """Each path literally: token maps A_h D with the patterns as computed, feature maps Γ W_V W_O
    (RMSNorm: no centring), constants (A_h 1) b_Vᵀ W_O."""
    layers, heads, width, n = 2, 2, 8, 5
    model = llama(layers=layers, heads=heads, kv_heads=1, width=width)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, n)))
    attn = capture.patterns(stack.attn, 0)
    w_v, w_o = stack.w_v.double(), stack.w_o.double()

    def token_map(layer, head):
        return attn[layer, head] @ torch.diag(capture.norm_scale[0, layer, 0])

    def feature_map(layer, head):
        return torch.diag(capture.norm_weight[layer, 0]) @ w_v[layer, head] @ w_o[layer, head]

    sources = [(0, capture.embedding[0])]
    for layer in range(layers):
        constant = capture.output_bias[layer][None].expand(n, width).clone()
        for h in range(heads):
            rows = attn[layer, h].sum(-1, keepdim=True)
            constant += rows @ (capture.value_bias[layer, h] @ w_o[layer, h])[None]
        sources.append((layer + 1, constant + capture.mlp_out[0, layer]))
    expected = enumerated_pre_norm_sums(sources, layers, heads, token_map, feature_map)
    torch.testing.assert_close(stack.length_sums()[:, 0], expected, rtol=1e-12, atol=1e-12)


def test_a_float32_llama_is_decomposed_to_float32s_precision():
    """A float32 model keeps its own float32 norms; the float64 sums match its stream to float32's
    rounding."""
    model = llama(dtype=torch.float32)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (2, 9)))
    assert capture.attn_row_sums is None  # the softmax's precision is the model's
    total = stack.length_sums().sum(0)
    assert (total - capture.residual).abs().max() < 1e-4 * capture.residual.abs().max()


def test_a_left_padded_llama_batch_is_decomposed_on_its_real_tokens():
    model = llama()
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    total = stack.length_sums().sum(0)
    real = mask.bool()
    assert bool((total[~real] == 0).all())
    error = (total[real] - capture.residual[real]).abs().max() / capture.residual[real].abs().max()
    assert error < 1e-10, error


def test_the_paths_of_a_roberta_and_a_vit_sum_to_their_streams():
    """RoBERTa reads as BERT (post-LN); ViT is pre-LN with a final LayerNorm, on pixels."""
    roberta = transformers.RobertaModel(
        transformers.RobertaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=50,
            max_position_embeddings=20,
            initializer_range=0.3,
        )
    )
    vit = transformers.ViTModel(
        transformers.ViTConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=64,
            image_size=8,
            patch_size=4,
            initializer_range=0.3,
        )
    )
    cases = [
        (randomised(roberta, norm_marker="LayerNorm"), {"input_ids": torch.randint(3, 50, (2, 7))}, "post"),
        (
            randomised(vit, norm_marker="layernorm"),
            {"pixel_values": torch.randn(2, 3, 8, 8, dtype=torch.float64)},
            "pre",
        ),
    ]
    for model, inputs, layout in cases:
        stack, capture = capture_huggingface_residual(model, **inputs)
        assert capture.layout == layout
        error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
        assert error < 1e-10, (type(model).__name__, error)


def test_pk_length_sums_takes_a_stack():
    """pk.length_sums(stack) is the stack's own: the model's stream for a captured one."""
    import pathkernels as pk

    model = gpt2()
    ids = torch.randint(0, 50, (1, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    assert torch.equal(pk.length_sums(stack), stack.length_sums())
    plain = pk.adapters.from_huggingface(model, input_ids=ids)
    with pytest.warns(UserWarning, match="has LayerNorm and MLPs"):
        torch.testing.assert_close(pk.length_sums(plain), plain.length_sums())
    with pytest.raises(ValueError, match=r"^pathkernels\.length_sums: with an AttentionStack its own w_v, .* got w_v"):
        pk.length_sums(stack, stack.residual_stream(0), stack.w_v, stack.w_o)
