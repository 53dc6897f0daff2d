"""Certificates pinned: each term of the certified searches' bounds, and each number the causal
check reports, on a case where that term is the one that decides.

- The pair search's certificate ``scaling · max(F_Q · max(V_K, F_K), F_K · max(V_Q, F_Q))`` is
  ``scaling · max(F_Q V_K, F_K V_Q, F_Q F_K)``: it is checked on cases where ``F_Q V_K`` alone is the
  largest and where ``F_K V_Q`` alone is (a visited norm above its own side's frontier), each side's
  F and V computed here from its walk (V as the largest norm of every vector it visited).
- Each side's largest visited norm is that largest norm after every expansion, on a walk whose
  expansions both raise it and leave it.
- The causal check's clean readout is the model's own logit, its LM head's bias included; its
  clean-score check allows ``2e-4 · |scaling| |q| |k|``, checked at that scale on a head whose
  ``|q| |k|`` is in the thousands.
"""

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

from test_model_families import family_model  # noqa: E402
from test_real_models import gpt2  # noqa: E402


def scaled_gpt2(layers: int, output_scale: float, head_paths_dominate: bool = False):
    """A GPT-2 whose heads' output maps are scaled: small, the paths through no head carry more than
    the rest (visited norms above the frontiers). With ``head_paths_dominate``, the value maps are
    scaled too, the MLPs' outputs ×0.1 and every bias 0 (the constants and the attention-bias
    sources are then 0): the paths through more heads are the longer vectors."""
    model = gpt2(layers=layers).eval()
    width = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.mul_(output_scale)
            if head_paths_dominate:
                block.attn.c_attn.weight[:, 2 * width :].mul_(output_scale)  # the values
                block.mlp.c_proj.weight.mul_(0.1)
        if head_paths_dominate:
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()
    return model


def test_the_pair_certificate_is_each_of_its_terms_where_that_term_decides():
    """Stopped before its first step, ``top_score_pairs`` reports ``|scaling| · max(F_Q V_K, F_K V_Q,
    F_Q F_K)`` (the module docstring's formula, expanded), to 1e-12, with F each side's largest node
    bound and V the largest norm of the vectors it visited (its constant and its direct paths),
    both computed here from the sides' walks. Heads whose outputs are scaled down make the visited
    norms exceed the frontiers, so that the cross terms ``F_Q V_K`` and ``F_K V_Q`` decide: the test
    requires a case where each alone exceeds the other two by 1 %, on which dropping either term
    (or reading V over the wrong dimension) changes the bound."""
    from pathkernels.analysis import score_search
    from pathkernels.analysis.scores import checked_head

    decided = {"query": 0, "key": 0}
    for output_scale in (0.1, 0.3, 1.0):
        stack, _ = capture_huggingface_residual(
            scaled_gpt2(3, output_scale), input_ids=torch.randint(0, 50, (1, 6)), query_key=True
        )
        for head in range(stack.num_heads):
            checked = checked_head(stack, 2, head, 0, "test")
            bounds, with_head = score_search.head_sequence_bounds(checked.model, "chain")
            for query, key in ((5, 1), (5, 4), (3, 0), (4, 2)):
                sides = [
                    score_search._Side(checked, s, row, bounds, with_head)
                    for s, row in (("query", query), ("key", key))
                ]
                f_q, f_k = sides[0].frontier, sides[1].frontier
                v_q, v_k = (float(side.all_vectors().norm(dim=-1).max()) for side in sides)
                terms = {"query": f_q * v_k, "key": f_k * v_q, "both": f_q * f_k}
                expected = abs(float(checked.maps.scaling[2])) * max(terms.values())
                found = pk.top_score_pairs(stack, 2, head, 3, query=query, key=key, time_limit=1e-9)
                assert found.bound == pytest.approx(expected, rel=1e-12), (output_scale, head, query, key)
                for name in ("query", "key"):
                    others = [value for other, value in terms.items() if other != name]
                    decided[name] += terms[name] > 1.01 * max(others)
                if min(decided.values()) >= 1:
                    return
    pytest.fail(f"no case where each cross term alone decides: {decided}")


def test_each_sides_largest_visited_norm_follows_every_expansion():
    """A side's ``largest_norm`` (the V of the certificate) is, after every expansion of a whole walk,
    the largest norm over the vectors it has visited, exactly; the walk (heads' values and outputs ×8,
    no biases, so that paths through more heads are longer) has expansions that raise it and expansions that leave
    it, so neither the old value nor the new tails' alone would do."""
    from pathkernels.analysis import score_search
    from pathkernels.analysis.scores import checked_head

    model = scaled_gpt2(4, 8.0, head_paths_dominate=True)
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    checked = checked_head(stack, 3, 1, 0, "test")
    bounds, with_head = score_search.head_sequence_bounds(checked.model, "chain")
    raised = kept = 0
    for which, row in (("query", 5), ("key", 2)):
        side = score_search._Side(checked, which, row, bounds, with_head)
        assert side.largest_norm == float(side.all_vectors().norm(dim=-1).max())
        while side.heap:
            before = side.largest_norm
            side.expand(3)
            assert side.largest_norm == float(side.all_vectors().norm(dim=-1).max())
            raised += side.largest_norm > before
            newest = side.vectors[-1].norm(dim=-1).max()
            kept += side.largest_norm > float(newest)
    assert raised >= 2 and kept >= 2, (raised, kept)


def _phi_with_head_bias():
    model = family_model("phi")  # PhiForCausalLM: its LM head has a bias, random here
    assert float(model.lm_head.bias.detach().abs().max()) > 0.1
    return model


@pytest.mark.parametrize("side", ["key", "readout"])
def test_the_clean_readout_is_the_models_own_logit_bias_included(side):
    """The causal check's clean readout (score paths, unfrozen, and value paths) is the model's own
    logit at that position, read from its forward pass with no hook: the LM head's bias included.
    The changes are differences, in which the bias cancels; only the clean value shows it."""
    model = _phi_with_head_bias()
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    target = int(torch.randint(0, 50, ()))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    paths, sources = [[-1, -1], [0, -1], [-1, -1]], ["embedding", "embedding", "L0 MLP"]
    options = {"side": "readout"} if side == "readout" else {"layer": 1, "head": 2, "query": 5, "key": 2}
    result = pk.causal_check(
        model, stack, {"input_ids": ids}, paths, sources, readout=pk.logit(model, target), **options
    )
    expected = float(logits[5, target])
    # Phi's float32 rotary angles move its logits by ~1e-8 of their scale; its biases are ~0.3.
    assert abs(result.clean["readout"] - expected) < 1e-6 * float(logits[5].abs().max()), (result.clean, expected)
    assert result.readout_change is not None and result.readout_change.shape == (3,)


def test_the_clean_score_check_allows_its_tolerance_of_the_largest_possible_score():
    """``_check_clean_score`` accepts a clean score within ``2e-4 · |scaling| |q_i| |k_j|`` of the
    capture's and refuses one beyond it: on a head whose queries and keys are scaled up (``|q||k|`` in
    the thousands), half that tolerance is far above 2e-4 itself and must pass, twice it must not."""
    from pathkernels.adapters.self_check import check_tolerance
    from pathkernels.analysis.causal import _check_clean_score
    from pathkernels.analysis.scores import checked_head

    model = gpt2(layers=3).eval()
    width = model.config.n_embd
    with torch.no_grad():
        model.transformer.h[2].attn.c_attn.weight[:, : 2 * width].mul_(20.0)  # queries and keys
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    checked = checked_head(stack, 2, 1, 0, "test")
    maps = checked.maps
    query, key = maps.computed("query", 0, 2, 1)[5], maps.computed("key", 0, 2, 1)[2]
    scaling = float(maps.scaling[2])
    captured = scaling * float(query @ key)
    largest = abs(scaling) * float(query.norm() * key.norm())
    tolerance = check_tolerance(torch.float64)
    assert tolerance * largest > 100 * tolerance  # the factor matters here
    for sign in (1.0, -1.0):
        _check_clean_score(model, captured + sign * 0.5 * tolerance * largest, maps, 0, checked, 5, 2)
        with pytest.raises(ValueError, match=r"scores query 5 against key 2 at"):
            _check_clean_score(model, captured + sign * 2.0 * tolerance * largest, maps, 0, checked, 5, 2)
    # And the model's own clean run passes it, end to end.
    result = pk.causal_check(
        model, stack, {"input_ids": ids}, [[0, -1, -1]], ["embedding"], layer=2, head=1, query=5, key=2
    )
    assert abs(result.clean["score"] - captured) <= 1e-9 * largest


def test_a_head_that_writes_nothing_has_node_bounds_of_zero_even_where_rounding_dips_below_zero(monkeypatch):
    """A head whose output map is 0 (head 2 of layer 1): the pair search's node for it bounds every
    vector below it by exactly 0. The node bound takes square roots of the largest eigenvalues of
    two Gram matrices (``‖Z‖₂`` and ``‖U Z‖₂``), both 0 here; an eigensolver may round such an
    eigenvalue to just below 0, which must still give 0, not NaN (which the bound would take as
    inf): simulated by an eigensolver that returns −1e-20 for every eigenvalue that is 0."""
    from pathkernels.analysis import score_search
    from pathkernels.analysis.scores import checked_head

    model = gpt2(layers=3).eval()
    head_dim = model.config.n_embd // model.config.n_head
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight[2 * head_dim : 3 * head_dim].zero_()  # W_O of L1H2
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    checked = checked_head(stack, 2, 0, 0, "test")
    bounds, with_head = score_search.head_sequence_bounds(checked.model, "chain")
    exact = torch.linalg.eigvalsh

    def rounded_below_zero(matrix):
        values = exact(matrix)
        return torch.where(values == 0, -1e-20, values)

    for solver in (exact, rounded_below_zero):
        monkeypatch.setattr(torch.linalg, "eigvalsh", solver)
        side = score_search._Side(checked, "query", 5, bounds, with_head, record=True)
        node_bounds = dict(side.record[0])  # the root's children: (attention sublayer, head) → bound
        assert node_bounds[((1, 2),)] == 0.0, solver
        others = [bound for prefix, bound in node_bounds.items() if prefix != ((1, 2),)]
        assert len(others) == 2 * 4 - 1 and all(0 < bound < float("inf") for bound in others)


def test_an_exhausted_pair_search_reports_every_path_of_each_side_visited():
    """k above the number of pairs: the search visits every path of both sides and says so,
    ``visited == (total, total)`` (each side's constant not counted), and lists every pair."""
    stack, _ = capture_huggingface_residual(
        gpt2(layers=2).eval(), input_ids=torch.randint(0, 50, (1, 5)), query_key=True
    )
    listed = pk.score_pairs(stack, 1, 0, query=4, key=1)
    pairs = listed.values.numel()
    found = pk.top_score_pairs(stack, 1, 0, pairs + 5, query=4, key=1)
    assert found.stopped == "exhausted" and found.certified and found.bound == 0.0
    assert found.visited == (found.total, found.total) == (listed.paths.shape[0], listed.paths.shape[0])
    expected = torch.sort(listed.values.flatten(), descending=True).values
    torch.testing.assert_close(found.values, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))


def test_the_pair_search_stops_at_its_memory_budget_by_the_bytes_it_counts():
    """The memory the pair search counts before its first step: per side, each frontier node
    ``8 n + 8 L + 250`` bytes (its ρ, the heads above it, the heap's entry) and each visited vector
    ``8 e`` (the constant and the direct paths: 1 + S of them), nothing expanded yet. A budget one
    byte below that sum stops it there (only the direct pairs visited); that sum itself lets it
    take a step."""
    stack, _ = capture_huggingface_residual(
        gpt2(layers=3).eval(), input_ids=torch.randint(0, 50, (1, 6)), query_key=True
    )
    n, layers, heads, e = 6, 2, stack.num_heads, stack.w_v.shape[-1]
    sources = 1 + 2 * layers  # the embedding, then each layer's attention bias and MLP
    per_side = 2 * heads * (8 * n + 8 * layers + 250) + 8 * e * (1 + sources)
    held = 2 * per_side
    stopped = pk.top_score_pairs(stack, 2, 1, 3, query=5, key=1, memory_budget=held - 1, batch_nodes=1)
    assert stopped.stopped == "memory_budget" and stopped.visited == (sources, sources), stopped
    stepped = pk.top_score_pairs(stack, 2, 1, 3, query=5, key=1, memory_budget=held, batch_nodes=1)
    assert sum(stepped.visited) > 2 * sources, stepped


def test_the_search_over_head_sequences_with_no_head_allowed_keeps_the_direct_paths():
    """``max_length=0`` on the search over head sequences (``bound="node"``): the paths through no
    head alone, certified and equal to the enumeration's; no path through a head is folded in (the
    root's children, whose tails go through a head, must not be made)."""
    from test_top_paths import assert_same_as_enumeration, captured

    _, stack, readout = captured("gpt2")
    assert_same_as_enumeration(stack, readout, 4, max_length=0)
    found = pk.top_paths(stack, readout, 4, max_length=0)
    assert found.visited == found.total == len(found.source_names) and bool((found.paths == -1).all())
