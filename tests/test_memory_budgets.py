"""Memory budgets: a function that allocates in proportion to the model or the prompt streams within
its ``memory_budget``, gives the same numbers streamed as in one piece, and refuses by name, with
the bytes it needs, where even its least piece does not fit; by default its budget is half the
memory the machine has free.

Each function is driven three ways on fresh random models: with a budget that holds everything at
once, with exactly the need its refusal names (its least piece: one group, one chunk), and with one
byte less (refused)."""

import re

import pytest
import torch
from test_real_models import gpt2
from test_score_features import captured

import pathkernels as pk
import pathkernels.core._memory as memory
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

EVERYTHING = 1 << 40  # a budget that holds any of these small models' work in one piece


def need_named_in(error: pytest.ExceptionInfo) -> int:
    """The bytes a refusal says it needs: the first ``(12,345 bytes)`` of its message."""
    return int(re.search(r"\(([\d,]+) bytes\)", str(error.value)).group(1).replace(",", ""))


@pytest.mark.parametrize("name, cross_layer", [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_score_decompositions_stream_one_group_at_a_time_within_the_least_budget(name, cross_layer):
    """Every head of the top layer at a middle query and every key, with transcoders (a cross-layer
    set's steps arrive above where they read): at the least budget that fits, each source's groups
    run one at a time through every branch and projection, and every table is the one computed in
    one piece; a byte less is refused, naming the argument and the need."""
    _, _, stack, _ = captured(name, features=4, cross_layer=cross_layer)
    layer = stack.num_layers - 1
    whole = pk.score_decompositions(stack, layer, query=4, memory_budget=EVERYTHING)
    refusal = r"score_decompositions: the result .* need .* more than memory_budget=1,000 ="
    with pytest.raises(ValueError, match=refusal):
        pk.score_decompositions(stack, layer, query=4, memory_budget=1000)
    with pytest.raises(ValueError) as refused:
        pk.score_decompositions(stack, layer, query=4, memory_budget=1000)
    need = need_named_in(refused)
    least = pk.score_decompositions(stack, layer, query=4, memory_budget=need)
    for one, streamed in zip(whole, least):
        scale = float(one.table.abs().max())
        torch.testing.assert_close(streamed.table, one.table, rtol=0, atol=1e-12 * scale)
        assert streamed.groups == one.groups
        torch.testing.assert_close(streamed.scores, one.model_scores, rtol=0, atol=1e-10 * scale)
    with pytest.raises(ValueError, match=f"more than memory_budget={need - 1:,}"):
        pk.score_decompositions(stack, layer, query=4, memory_budget=need - 1)


def frozen_need(stack, tokens: int | None = None, copied: int = 0, layers: int | None = None) -> int:
    """The bytes a frozen model of ``stack``'s first ``layers`` layers (default: every one) on
    ``tokens`` real tokens (default: every token) is refused beyond: float64 token maps
    (``L·H·n²``), ``copied`` bytes per pattern entry where it copies the patterns (0 where it reads
    the stack's own), the heads' maps four times, the sources."""
    layers, heads, d = stack.num_layers if layers is None else layers, stack.num_heads, stack.d_model
    tokens = stack.attn.shape[-1] if tokens is None else tokens
    maps = 4 * layers * heads * d * stack.w_v.shape[-1]
    return (8 + copied) * layers * heads * tokens**2 + 8 * (maps + (2 * layers + 2) * tokens * d)


def test_score_decomposition_takes_half_the_free_memory_by_default(monkeypatch):
    """With no memory_budget the budget is half what the machine has free: a machine with one
    byte less than twice the need is refused before any work, saying so; bad budgets are refused."""
    _, _, stack, _ = captured("gpt2", features=3)
    with pytest.raises(ValueError) as refused:
        pk.score_decomposition(stack, 1, 0, memory_budget=1)
    need = need_named_in(refused)
    free = 2 * need - 1
    assert free >= frozen_need(stack)  # the frozen model fits: the budget is what refuses
    monkeypatch.setattr(memory, "available_memory", lambda device: free)
    by_default = rf"more than memory_budget \(by default half the .* \({free:,} bytes\) available on cpu\)"
    with pytest.raises(ValueError, match=by_default):
        pk.score_decomposition(stack, 1, 0)
    monkeypatch.setattr(memory, "available_memory", lambda device: free + 1)
    assert pk.score_decomposition(stack, 1, 0).table.shape[-1] == 6
    for bad in (0, -5, 2.5, True, "1GB"):
        expected = "score_decomposition: expected memory_budget to be a positive int or None"
        with pytest.raises(ValueError, match=expected):
            pk.score_decomposition(stack, 1, 0, memory_budget=bad)


def test_a_frozen_model_the_free_memory_cannot_hold_is_refused_before_any_work(monkeypatch):
    """Every analysis freezes the model per call (float64 token maps, L·H·n², and the heads' maps;
    the patterns are the stack's own; a head's scores, the layers up to it); where the machine has
    less free, the caller refuses by name with the size, before allocating (at Llama-3.2-1B's shape
    and 1,024 tokens the kernel killed the process)."""
    _, _, stack, _ = captured("gpt2", features=3)
    model = stack.residual_capture
    need, d = frozen_need(stack), stack.d_model
    readout = torch.randn(d, dtype=torch.float64)
    monkeypatch.setattr(memory, "available_memory", lambda device: need)
    assert pk.top_paths(stack, readout, 3).certified  # exactly what it needs: it runs
    monkeypatch.setattr(memory, "available_memory", lambda device: need - 1)
    frozen = r"the frozen model of batch element 0 \(3 layers × 2 heads on 6 tokens: .*\) needs about .* more than the"
    with pytest.raises(MemoryError, match=r"^pathkernels\.top_paths: " + frozen):
        pk.top_paths(stack, readout, 3)
    with pytest.raises(MemoryError, match=r"^pathkernels\.path_attribution: " + frozen):
        pk.path_attribution(stack, readout)
    below = frozen_need(stack, layers=2)  # a layer-1 head's scores read the model up to its attention
    assert below < need
    monkeypatch.setattr(memory, "available_memory", lambda device: below)
    pk.score_decomposition(stack, 1, 0, memory_budget=EVERYTHING)
    monkeypatch.setattr(memory, "available_memory", lambda device: below - 1)
    frozen = frozen.replace("3 layers", "2 layers")
    with pytest.raises(MemoryError, match=r"^pathkernels\.score_decomposition: " + frozen):
        pk.score_decomposition(stack, 1, 0, memory_budget=EVERYTHING)
    assert model is stack.residual_capture


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_frozen_model_holds_the_patterns_as_the_stack_does_and_copies_a_padded_sequences(monkeypatch, dtype):
    """The frozen model reads the stack's own patterns (a float32 model's in float32) and makes its
    token maps ``A·D`` in float64, exactly the float64 product; a left-padded sequence's real
    tokens are one copy in the stack's dtype, counted in what it needs: at that need it runs, a
    byte below it is refused."""
    from pathkernels.analysis.readout_trie import frozen_model

    model = gpt2(layers=2, heads=2, width=8).to(dtype).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.warns(UserWarning, match=r"left-padded row\(s\) 1 get positions counted from their first real"):
        stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    for batch, copied in ((0, 0), (1, stack.attn.element_size())):
        real = mask[batch].bool()
        frozen = frozen_model(stack, capture, batch, real)
        for layer in range(stack.num_layers):
            sublayer = frozen.sublayers[2 * layer]
            held = stack.attn[batch, layer][:, real][:, :, real]
            assert sublayer.attn.dtype == dtype and torch.equal(sublayer.attn, held)
            assert (sublayer.attn.data_ptr() == stack.attn[batch, layer].data_ptr()) == (copied == 0)
            maps = sublayer.token_maps
            assert maps.dtype == torch.float64
            assert torch.equal(maps, held.double() * capture.norm_scale[batch, layer, 0][real].double())
        need, readout = frozen_need(stack, int(real.sum()), copied), torch.randn(stack.d_model, dtype=torch.float64)
        monkeypatch.setattr(memory, "available_memory", lambda device, need=need: need)
        pk.path_attribution(stack, readout, batch=batch)
        monkeypatch.setattr(memory, "available_memory", lambda device, need=need: need - 1)
        with pytest.raises(MemoryError, match=r"the frozen model of batch element"):
            pk.path_attribution(stack, readout, batch=batch)


def test_the_node_bounds_set_up_the_free_memory_cannot_hold_is_refused_naming_the_plain_bound(monkeypatch):
    """top_paths' node bound makes every head's token map and the source maps before it searches;
    where the memory free once the frozen model is made cannot hold them, it refuses by name and
    points to the plain bound, which then runs."""
    model = gpt2(layers=3, heads=2, width=8).eval()  # the node bound is for models without transcoders
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    readout = torch.randn(stack.d_model, dtype=torch.float64)
    asked = []

    def free_once(device):  # enough for the frozen model, then nothing
        asked.append(device)
        return EVERYTHING if len(asked) % 2 else 1

    monkeypatch.setattr(memory, "available_memory", free_once)
    with pytest.raises(MemoryError, match=r"^pathkernels\.top_paths: the bound per node's set-up .* bound=\"plain\""):
        pk.top_paths(stack, readout, 3, bound="node")
    asked.clear()
    assert pk.top_paths(stack, readout, 3, bound="plain").certified
