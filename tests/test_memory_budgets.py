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
from test_score_features import captured

import pathkernels as pk
import pathkernels.core._memory as memory

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


def test_score_decomposition_takes_half_the_free_memory_by_default(monkeypatch):
    """With no memory_budget the budget is half what the machine has free; a machine with too
    little is refused before any work, saying so."""
    _, _, stack, _ = captured("gpt2", features=3)
    monkeypatch.setattr(memory, "available_memory", lambda device: 4000)
    by_default = r"more than memory_budget \(by default half the 3\.91 KiB .* available on cpu\)"
    with pytest.raises(ValueError, match=by_default):
        pk.score_decomposition(stack, 1, 0)
    for bad in (0, -5, 2.5, True, "1GB"):
        expected = "score_decomposition: expected memory_budget to be a positive int or None"
        with pytest.raises(ValueError, match=expected):
            pk.score_decomposition(stack, 1, 0, memory_budget=bad)
