"""Where heads look: attention scores as exact sums over pairs of paths (pathkernels.analysis.scores).

Held against independent references:
- the model's own scores: the queries and keys its eager attention used, and, without any hook, its
  patterns (a row's scores less their log-sum-exp are the log of its pattern);
- every pair of paths written literally: each path's term from the design's matrices
  (``literal_pre_norm_terms``) through the model's own projection weights, its own query/key norm
  input and its own rotary function (``apply_rotary_pos_emb`` of its modeling module);
- brute force for the top pairs, and the pairs' row sums for the one-sided attributions.

Models are built from configs with random biases and norm parameters, weights ×5 where the family
test of tests/test_model_families.py builds them so (sharp attention), float64 and float32, padded.
"""

import math
import sys
import warnings

import pytest
import torch
from float64_reference import float64_steps

import pathkernels as pk
from pathkernels.adapters import query_key as query_key_module
from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.analysis.scores import CONSTANT
from pathkernels.core.paths import count_attribution_paths

transformers = pytest.importorskip("transformers")

from test_model_families import family_model, literal_pre_norm_terms, sharpened  # noqa: E402
from test_real_models import gpt2, llama  # noqa: E402

FAMILIES = [
    "gpt2",
    "llama",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2-sliding-biased",
    "gemma3",
    "olmo",
    "olmo2",
    "gpt_neox",
    "phi",
    "phi-qk-layernorm",
    "opt",
    "gptj",
    "falcon",
    "falcon-sequential",
    "falcon-grouped",
]


def build(name: str, dtype=torch.float64):
    if name == "gpt2":
        return gpt2().to(dtype).eval()
    if name in ("llama", "qwen2"):
        return llama(name).to(dtype).eval()
    if name == "phi-qk-layernorm":  # LayerNorms on each head's query and key, random γ and β
        torch.manual_seed(0)
        config = transformers.PhiConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=50,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
        )
        model = sharpened(transformers.PhiForCausalLM(config))  # as family_model randomises its families
        return model.to(dtype)
    return family_model(name, dtype)


def padded_ids():
    """Two sequences of 7, the second left-padded by 2."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 50, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_heads_scores_sum_to_the_models_own(name, dtype):
    """Every layer, head and sequence of a left-padded batch, the last real query against every key
    it may attend: the pair table sums to the scores the model's queries and keys give (1e-12
    relative in float64), and those, capped where the model caps them, less their log-sum-exp, are
    the log of the model's pattern row, a reference that needs no hook. The keys are the real
    tokens the mask lets the query see, and the pattern is 0 on every other."""
    model = build(name, dtype)
    ids, mask = padded_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the left-padded row's positions, as generate gives them
        stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, query_key=True)
    exact = dtype == torch.float64
    for batch in (0, 1):
        patterns = capture.patterns(stack.attn, batch)
        every_head = [pk.score_decompositions(stack, layer, batch=batch) for layer in range(stack.num_layers)]
        for result in (r for layer in every_head for r in layer):
            assert result.table.shape == (len(result.groups), len(result.groups), result.keys.numel())
            error = (result.scores - result.model_scores).abs().max() / result.model_scores.abs().max()
            assert error < (1e-12 if exact else 1e-5), (result, error)
            scores = result.scores
            if result.soft_cap:
                scores = result.soft_cap * torch.tanh(scores / result.soft_cap)
            row = patterns[result.layer, result.head, result.query]
            torch.testing.assert_close(
                scores - torch.logsumexp(scores, 0),
                row[result.keys].log(),
                rtol=0,
                atol=1e-10 if exact else 2e-5,
            )
            others = torch.ones_like(row, dtype=torch.bool)
            others[result.keys] = False
            assert float(row[others].abs().sum()) == 0
            assert bool(result.allowed.all())
            assert set(result.keys.tolist()) <= set(range(2 * batch, result.query + 1))
    assert (name.startswith("gemma2")) == (result.soft_cap is not None)


@pytest.mark.parametrize(
    "extra", [{}, {"multi_query": False, "parallel_attn": False}, {"new_decoder_architecture": True, "num_kv_heads": 2}]
)
def test_falcon_with_alibi_has_its_bias_as_a_term_of_its_own(extra):
    """Falcon with ALiBi (its attention computes the scores inline; the capture replays its own
    projection and head split): the pair table plus the position term is the model's own score and
    the log of its pattern, on a left-padded batch; the position term is ALiBi's, as the model's
    mask carries it."""
    from test_capture_self_check import falcon_with_alibi

    model = falcon_with_alibi(**extra)
    ids, mask = padded_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, query_key=True)
    for batch in (0, 1):
        for result in pk.score_decompositions(stack, 1, batch=batch):
            scale = float(result.model_scores.abs().max())
            torch.testing.assert_close(result.scores, result.model_scores, rtol=0, atol=1e-12 * scale)
            row = capture.patterns(stack.attn, batch)[1, result.head, result.query, result.keys]
            scores = result.scores
            torch.testing.assert_close(scores - torch.logsumexp(scores, 0), row.log(), rtol=0, atol=1e-10)
            steps = result.position.diff()  # the same slope between every two keys: a line in the key
            assert float(result.position.abs().max()) > 0
            torch.testing.assert_close(steps, steps[:1].expand_as(steps), rtol=1e-10, atol=1e-14)


def test_a_vit_looks_at_every_patch():
    """ViT (no mask, learned positions, a class token): the sums are the model's own scores and the
    log of its patterns, every key allowed."""
    config = transformers.ViTConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, image_size=8, patch_size=4
    )
    model = transformers.ViTModel(config).double().eval()
    stack, capture = capture_huggingface_residual(model, pixel_values=torch.randn(1, 3, 8, 8), query_key=True)
    for result in pk.score_decompositions(stack, 1, query=0):
        assert result.keys.tolist() == [0, 1, 2, 3, 4]
        assert float((result.scores - result.model_scores).abs().max()) < 1e-12 * float(result.scores.abs().max())
        row = capture.patterns(stack.attn, 0)[1, result.head, 0]
        torch.testing.assert_close(result.scores - torch.logsumexp(result.scores, 0), row.log(), rtol=0, atol=1e-10)


# --- the literal pairs ----------------------------------------------------------------------------


def attention_module(model, layer: int):
    return model.transformer.h[layer].attn if hasattr(model, "transformer") else model.model.layers[layer].self_attn


def literal_sides(model, capture, layer: int, part: torch.Tensor, with_bias: bool):
    """The query and key ``[H, n, e]`` of a stream part ``[n, d]`` of the first sequence entering
    ``layer``, through the model's own modules: the frozen norm ``D (Y C) Γ`` (+ β and the
    projections' biases when ``with_bias``), its projection weights, its query/key norm at its own
    input's ``1/σ`` (recorded by a hook of this test) and its own ``apply_rotary_pos_emb``."""
    module = attention_module(model, layer)
    n, d = part.shape
    centred = part - part.mean(-1, keepdim=True) if capture.centred else part
    y = capture.norm_scale[0, layer, 0, :, None] * centred * capture.norm_weight[layer, 0]
    if with_bias:
        y = y + capture.norm_bias[layer, 0]
    head_dim = module.head_dim
    if hasattr(module, "c_attn"):
        weight, bias = module.c_attn.weight.detach().double(), module.c_attn.bias.detach().double()
        q, k = y @ weight[:, :d], y @ weight[:, d : 2 * d]
        if with_bias:
            q, k = q + bias[:d], k + bias[d : 2 * d]
    else:
        q = torch.nn.functional.linear(y, module.q_proj.weight.detach().double(), bias_of(module.q_proj, with_bias))
        k = torch.nn.functional.linear(y, module.k_proj.weight.detach().double(), bias_of(module.k_proj, with_bias))
    q, k = q.view(n, -1, head_dim), k.view(n, -1, head_dim)
    for name, side in (("q_norm", q), ("k_norm", k)):
        norm = getattr(module, name, None)
        if norm is not None:
            x = NORM_INPUTS[(layer, name)][0].double()  # [n, heads, e]
            inverse = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            side.mul_(inverse * norm.weight.detach().double())
    q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, n, e]
    if not hasattr(module, "c_attn"):
        rotary = model.model.rotary_emb
        with float64_steps(model), torch.no_grad():
            cos, sin = rotary(y[None], torch.arange(n)[None])
        q, k = sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], 1)
    return q[0], k[0]


def bias_of(projection, wanted: bool):
    return projection.bias.detach().double() if wanted and projection.bias is not None else None


NORM_INPUTS: dict = {}


def record_norm_inputs(model, ids):
    """The query/key norms' inputs in a float64 forward pass of the model's own (this test's hook)."""
    NORM_INPUTS.clear()
    handles = []
    for layer in range(model.config.num_hidden_layers):
        module = attention_module(model, layer)
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            if norm is not None:
                hook = lambda m, args, key=(layer, name): NORM_INPUTS.__setitem__(key, args[0].detach())  # noqa: E731
                handles.append(norm.register_forward_pre_hook(hook))
    with float64_steps(model), torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3"])
def test_the_pairs_are_the_literal_pairs_and_the_groups_their_sums(name):
    """At the top layer of a 3-layer model (every path from every source below it): each pair's term
    equals ``scaling · ⟨q_p(i), k_p'(j)⟩`` written literally (1e-12 of the score's scale), the top and
    bottom pairs are brute force's, the groups of :func:`score_decomposition` are the literal pairs
    summed by (source, heads), and everything sums to the model's own score."""
    model = build(name)
    ids = torch.randint(0, 50, (1, 6))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    record_norm_inputs(model, ids)
    layer, head, query, key = stack.num_layers - 1, 1, 5, 2
    terms = literal_pre_norm_terms(stack, capture, below=layer)
    scaling = attention_module(model, layer).scaling
    sides = {path: literal_sides(model, capture, layer, term, False) for path, term in terms.items()}
    sides[CONSTANT] = literal_sides(model, capture, layer, torch.zeros_like(capture.embedding[0]), True)
    q = {path: s[0][head, query] for path, s in sides.items()}
    k = {path: s[1][head, key] for path, s in sides.items()}
    literal = {(a, b): scaling * float(q[a] @ k[b]) for a in sides for b in sides}

    pairs = pk.score_pairs(stack, layer, head, query=query, key=key, top_k=5)
    names = [(tuple(p.tolist()), pairs.source_names[int(s)]) for p, s in zip(pairs.paths, pairs.sources)] + [CONSTANT]
    assert set(names) == set(sides) and len(names) == len(set(names)) == len(sides)
    scale = abs(pairs.model_score) + max(abs(v) for v in literal.values())
    got = {(a, b): float(pairs.values[i, j]) for i, a in enumerate(names) for j, b in enumerate(names)}
    assert max(abs(got[pair] - literal[pair]) for pair in literal) < 1e-12 * scale
    assert abs(pairs.score - pairs.model_score) < 1e-12 * scale
    ranked = sorted(literal.values(), reverse=True)
    assert [row["value"] for row in pairs.top] == pytest.approx(ranked[:5], abs=1e-12 * scale)
    assert [row["value"] for row in pairs.bottom] == pytest.approx(sorted(literal.values())[:5], abs=1e-12 * scale)
    best = max(literal, key=literal.get)
    assert (pairs.top[0]["query path"], pairs.top[0]["key path"]) == tuple(map(described, best))

    decomposition = pk.score_decomposition(stack, layer, head, query=query, keys=[key, 0])
    grouped = decomposition.pair_table(key)
    for a, query_group in enumerate(decomposition.groups):
        for b, key_group in enumerate(decomposition.groups):
            expected = sum(v for (p, r), v in literal.items() if (group_of(p), group_of(r)) == (query_group, key_group))
            assert abs(float(grouped[a, b]) - expected) < 1e-12 * scale, (query_group, key_group)
    assert abs(float(decomposition.scores[0]) - pairs.model_score) < 1e-12 * scale


def described(path) -> str:
    if path == CONSTANT:
        return CONSTANT
    choices, source = path
    heads = [f"L{layer}H{h}" for layer, h in enumerate(choices) if h >= 0]
    return f"{' → '.join(heads)} from {source}" if heads else f"{source} (direct)"


def group_of(path) -> str:
    if path == CONSTANT:
        return CONSTANT
    choices, source = path
    length = sum(h >= 0 for h in choices)
    return f"{source} (direct)" if length == 0 else f"{source} via {length} head{'s' * (length > 1)}"


@pytest.mark.parametrize("side", ["query", "key"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "gemma3", "phi-qk-layernorm"])
def test_one_side_fixed_is_a_readout_whose_paths_are_the_pair_rows(name, side):
    """With the key fixed to the model's own, each query path's attribution is its row of the pair
    table summed over the key side (and, with the query fixed, each key path's column): the readout
    trie walks the stream below the layer, its paths plus its constant are the model's own score,
    and a ``max_length`` leaves the rest ``unenumerated``, exactly."""
    model = build(name)
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    layer, head, query, key = stack.num_layers - 1, 2, 5, 3
    pairs = pk.score_pairs(stack, layer, head, query=query, key=key)
    result = pk.score_attribution(stack, layer, head, query=query, key=key, side=side)
    scale = abs(pairs.model_score) + float(pairs.values.abs().max())
    assert abs(float(result.value) - pairs.model_score) < 1e-12 * scale
    assert abs(float(result.by_source_length.sum() + result.constant) - float(result.value)) < 1e-12 * scale
    sums = pairs.values.sum(1 if side == "query" else 0)  # [P+1]: each path against the whole other side
    index = {(tuple(p.tolist()), int(s)): i for i, (p, s) in enumerate(zip(pairs.paths, pairs.sources))}
    assert result.attribution is not None and result.attribution.shape[0] == pairs.paths.shape[0]
    for path, source, value in zip(result.paths, result.path_sources, result.attribution[:, 0, 0]):
        assert abs(float(value) - float(sums[index[(tuple(path.tolist()), int(source))]])) < 1e-12 * scale
    assert abs(float(result.constant) - float(sums[-1])) < 1e-12 * scale
    short = pk.score_attribution(stack, layer, head, query=query, key=key, side=side, max_length=0)
    direct = sum(float(sums[i]) for (p, _), i in index.items() if all(h < 0 for h in p))
    assert abs(float(short.by_source_length.sum()) - direct) < 1e-12 * scale
    assert abs(float(short.unenumerated) - (float(result.value) - float(result.constant) - direct)) < 1e-12 * scale


@pytest.mark.parametrize("layer", [2, 0])
@pytest.mark.parametrize("bound", ["node", "chain", "plain"])
@pytest.mark.parametrize("side", ["query", "key"])
def test_the_certified_top_paths_of_one_side_are_brute_forces(side, bound, layer):
    """score_top_paths, largest and smallest, on every bound: certified, and the k values the k
    largest (smallest) of every path's share from score_attribution's full walk; stopped at once
    (a time limit passed before the search), the bound it reports is above every path not listed.
    At layer 0 the model below the head has no sublayer (its one path is the embedding)."""
    model = build("gpt2")
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    every = pk.score_attribution(stack, layer, 3, query=5, key=1, side=side).attribution[:, 0, 0]
    scale = float(every.abs().max())
    for largest in (True, False):
        found = pk.score_top_paths(stack, layer, 3, 6, query=5, key=1, side=side, largest=largest, bound=bound)
        assert found.certified and found.total == every.numel()
        expected = torch.sort(every, descending=largest).values[:6]
        torch.testing.assert_close(found.values, expected, rtol=0, atol=1e-12 * scale)
        limit = 1e-9  # seconds: out of time before the first expansion
        stopped = pk.score_top_paths(stack, layer, 3, 6, query=5, key=1, side=side, largest=largest, time_limit=limit)
        signed = torch.sort(every * (1 if largest else -1), descending=True).values
        listed = stopped.values * (1 if largest else -1)
        ceiling = max(stopped.bound, float(listed.min())) if listed.numel() else stopped.bound
        assert not stopped.certified or listed.numel() == 6
        assert float(signed[listed.numel() :].max()) <= ceiling + 1e-12 * scale


@pytest.mark.parametrize("bound", ["chain", "first_head", "plain"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "phi-qk-layernorm"])
def test_the_certified_top_pairs_are_the_listed_pairs_top(name, bound):
    """top_score_pairs, largest and smallest, on every bound: certified and equal to the top of
    every pair listed by score_pairs (values and both paths)."""
    stack, _ = capture_huggingface_residual(build(name), input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    layer = stack.num_layers - 1
    listed = pk.score_pairs(stack, layer, 1, query=5, key=2, top_k=8)
    scale = float(listed.values.abs().max())
    for largest, rows in ((True, listed.top), (False, listed.bottom)):
        found = pk.top_score_pairs(stack, layer, 1, 8, query=5, key=2, largest=largest, bound=bound, batch_nodes=3)
        assert found.certified and found.stopped in ("certified", "exhausted"), found
        assert [row["value"] for row in found.table()] == pytest.approx(
            [row["value"] for row in rows], abs=1e-12 * scale
        )
        assert [(row["query path"], row["key path"]) for row in found.table()][:3] == [
            (row["query path"], row["key path"]) for row in rows
        ][:3]


@pytest.mark.parametrize("largest", [True, False])
def test_a_search_stopped_early_bounds_every_pair_it_did_not_list(largest):
    """Stopped before certifying (a time limit passed before the first step, or memory budgets that
    stop it at 30 points along the way), the reported bound holds: no pair outside the list exceeds
    the larger of the bound and the list's k-th value, and the list is certified exactly when the
    bound is at most that value. A 4-layer GPT-2 with sharp attention, so that paths through
    further heads and both frontiers matter."""
    stack, _ = capture_huggingface_residual(
        gpt2(layers=4).eval(), input_ids=torch.randint(0, 50, (1, 6)), query_key=True
    )
    listed = pk.score_pairs(stack, 3, 3, query=5, key=1)
    signed = listed.values.flatten() * (1 if largest else -1)
    ranked = torch.sort(signed, descending=True).values
    scale = float(signed.abs().max())
    stops = [{"time_limit": 1e-9}] + [{"memory_budget": budget} for budget in range(4_000, 124_000, 4_000)]
    uncertified = 0
    for limits in stops:
        found = pk.top_score_pairs(stack, 3, 3, 5, query=5, key=1, largest=largest, batch_nodes=1, **limits)
        kept = found.values * (1 if largest else -1)
        kth = float(kept[-1]) if kept.numel() == 5 else -math.inf
        ceiling = max(found.bound, kth)
        assert float(ranked[kept.numel() :].max()) <= ceiling + 1e-12 * scale, (limits, found, ceiling)
        assert found.certified == (found.bound <= kth), (limits, found)
        uncertified += not found.certified
        if found.certified:
            torch.testing.assert_close(kept, ranked[:5], rtol=0, atol=1e-12 * scale)
    assert uncertified >= 5  # the sweep stops it before the certificate


@pytest.mark.parametrize("amplified", [1.0, 8.0])
@pytest.mark.parametrize("side", ["query", "key"])
def test_every_node_bound_is_above_every_vector_below_it(side, amplified):
    """The search's node bound, checked node by node on a whole walk: every path below a node (its
    tails and every path through further heads) has a vector no longer than the node's bound. A
    4-layer GPT-2, and the same with every head's value and output maps ×8 (paths through more
    heads then carry more)."""
    from pathkernels.analysis import score_search
    from pathkernels.analysis.scores import checked_head

    model = gpt2(layers=4).eval()
    width = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.mul_(amplified)
            block.attn.c_attn.weight[:, 2 * width :].mul_(amplified)  # the values
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    head = checked_head(stack, 3, 1, 0, "test")
    bounds, with_head = score_search.head_sequence_bounds(head.model, "chain")
    walk = score_search._Side(head, side, 4, bounds, with_head, record=True)
    while walk.heap:
        walk.expand(16)
    norms = walk.all_vectors().norm(dim=-1)
    heads_taken = walk.record[1]
    assert len(heads_taken) == norms.numel() == 1 + count_attribution_paths(3, 4, 3)  # every path, and the constant
    for prefix, bound in walk.record[0]:
        below = torch.tensor([taken[: len(prefix)] == prefix for taken in heads_taken])
        assert bool(below.any()) and float(norms[below].max()) <= bound * (1 + 1e-12), (prefix, bound)


def test_the_certificate_is_the_formula_over_both_frontiers():
    """Stopped before its first step, the search reports ``scaling · max(F_Q · max(V_K, F_K),
    F_K · max(V_Q, F_Q))``: each side's largest node bound F and largest visited norm V (its
    constant and its paths through no head), computed here from the two sides' walks."""
    from pathkernels.analysis import score_search
    from pathkernels.analysis.scores import checked_head

    # The formula is tested only where both sides' frontiers exceed their visited norms, so that
    # neither max(...) can hide a wrong term. Heads that amplify make that the rule; about one draw
    # in 200 misses it (the frozen norms undo part of the amplification), so draw again then.
    for _ in range(10):
        model = gpt2(layers=4).eval()
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_proj.weight.mul_(8.0)
        stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
        head = checked_head(stack, 3, 2, 0, "test")
        bounds, with_head = score_search.head_sequence_bounds(head.model, "chain")
        sides = (score_search._Side(head, side, row, bounds, with_head) for side, row in (("query", 5), ("key", 1)))
        query, key = sides
        f_q, f_k, v_q, v_k = query.frontier, key.frontier, query.largest_norm, key.largest_norm
        if f_q > v_q and f_k > v_k:
            break
    else:
        pytest.fail("ten draws in a row had a frontier below its visited norms")
    expected = float(head.maps.scaling[3]) * max(f_q * max(v_k, f_k), f_k * max(v_q, f_q))
    found = pk.top_score_pairs(stack, 3, 2, 5, query=5, key=1, time_limit=1e-9)
    assert not found.certified and found.bound == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("fixture", ["attn_only_2l", "gpt2_4l", "llama_2l"])
def test_the_top_20_pairs_of_every_fixture_head_are_certified(fixture):
    """Each fixture's top layer, every head, at the example's last token against its first:
    the top 20 pairs certified and equal to the full list."""
    from pathkernels.fixtures import load_fixture

    model, inputs = load_fixture(fixture)
    stack, _ = capture_huggingface_residual(model, **inputs, query_key=True)
    layer = stack.num_layers - 1
    for head in range(stack.num_heads):
        found = pk.top_score_pairs(stack, layer, head, 20, key=1)
        listed = pk.score_pairs(stack, layer, head, key=1, top_k=20)
        assert found.certified, found
        scale = float(listed.values.abs().max())
        assert [float(v) for v in found.values] == pytest.approx(
            [row["value"] for row in listed.top], abs=1e-12 * scale
        )


def test_layer_zero_has_only_the_embedding_and_the_constant():
    model = build("llama")
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 5)), query_key=True)
    result = pk.score_decomposition(stack, 0, 3)
    assert result.groups == ("embedding (direct)", CONSTANT)
    assert float((result.scores - result.model_scores).abs().max()) < 1e-12 * float(result.model_scores.abs().max())
    attribution = pk.score_attribution(stack, 0, 3, key=2)
    assert attribution.by_source_length.shape[:2] == (1, 1)


# --- the known answer ---------------------------------------------------------------------------


def test_the_induction_heads_look_by_k_composition_through_the_previous_token_head():
    """attn_only_2l, the fixture example: at each of the 15 tokens of the second copy whose next
    token induction predicts, scoring the token after the first occurrence, each of the four
    layer-1 heads (60 cases): the pair of the query's direct embedding and the key's path through
    L0H0, the previous-token head (K-composition), is the top pair in 55 and second in the other 5
    (tokens 30 and 31, where the direct embedding against the direct embedding leads). It carries a
    median 0.71 of the score (10th–90th percentile 0.54–0.96; float64, measured)."""
    from pathkernels.fixtures import load_fixture, previous_occurrence, repeated_positions

    model, inputs = load_fixture("attn_only_2l")
    stack, _ = capture_huggingface_residual(model, **inputs, query_key=True)
    ids = inputs["input_ids"]
    previous, predictable = previous_occurrence(ids)[0], repeated_positions(ids)[0]
    induction = ("embedding (direct)", "L0H0 from embedding")
    ranks, shares = [], []
    for token in predictable.nonzero().flatten().tolist():
        target = int(previous[token]) + 1
        for head in range(stack.num_heads):
            pairs = pk.score_pairs(stack, 1, head, query=token, key=target, top_k=2)
            assert abs(pairs.score - pairs.model_score) < 1e-12 * abs(pairs.model_score)
            listed = [(row["query path"], row["key path"]) for row in pairs.top]
            assert induction in listed, (token, head, pairs.top)
            ranks.append(listed.index(induction) + 1)
            shares.append(pairs.top[ranks[-1] - 1]["fraction"])
            if ranks[-1] == 2:
                assert token in (30, 31) and listed[0] == ("embedding (direct)", "embedding (direct)")
    assert len(ranks) == 60 and ranks.count(1) == 55
    shares = torch.tensor(shares, dtype=torch.float64)
    assert 0.68 < float(shares.median()) < 0.74, shares


# --- refusals, results and mutations ------------------------------------------------------------


def test_what_is_not_read_is_refused_by_name():
    ids = torch.randint(0, 50, (1, 5))
    bert = transformers.BertModel(
        transformers.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16)
    ).eval()
    with pytest.raises(ValueError, match=r"query_key=True reads the queries and keys of gpt2, .*not yet of 'bert'"):
        capture_huggingface_residual(bert, input_ids=ids, query_key=True)
    with pytest.raises(ValueError, match=r"query_key=True reads pre-norm models; this 'opt' normalises after"):
        capture_huggingface_residual(family_model("opt-post-projected"), input_ids=ids, query_key=True)

    stack, _ = capture_huggingface_residual(build("gpt2"), input_ids=ids)
    with pytest.raises(ValueError, match=r"^pathkernels\.score_decomposition: expected a stack captured with its"):
        pk.score_decomposition(stack, 0, 0)
    upcast = build("gpt2", torch.float32)  # its upcast refuses float64 itself
    upcast.config.reorder_and_upcast_attn = True
    for block in upcast.transformer.h:
        block.attn.reorder_and_upcast_attn = True
    with pytest.raises(ValueError, match=r"computed their scores outside eager_attention_forward"):
        capture_huggingface_residual(upcast, input_ids=ids, query_key=True)


def test_arguments_are_checked_in_the_callers_name():
    stack, _ = capture_huggingface_residual(build("llama"), input_ids=torch.randint(0, 50, (1, 5)), query_key=True)
    for call, match in (
        (lambda: pk.score_decomposition(stack, 3, 0), r"^pathkernels\.score_decomposition: expected layer"),
        (lambda: pk.score_decomposition(stack, 0, 4), r"^pathkernels\.score_decomposition: expected head"),
        (lambda: pk.score_decomposition(stack, 1, 0, query=5), r"expected query"),
        (lambda: pk.score_decomposition(stack, 1, 0, keys=[]), r"expected keys to hold at least one position"),
        (lambda: pk.score_decompositions(stack, 1, [0, 9]), r"^pathkernels\.score_decompositions: expected head"),
        (lambda: pk.score_pairs(stack, 2, 0, key=1, memory_budget=1000), r"use score_decomposition"),
        (lambda: pk.score_attribution(stack, 2, 0, key=1, side="value"), r"expected side to be 'query' or 'key'"),
        (lambda: pk.score_pairs(stack, 2, 0, key=1.0), r"^pathkernels\.score_pairs: expected key to be an int"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            call()


def test_results_print_short_and_tabulate_and_plot(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    stack, _ = capture_huggingface_residual(build("gpt2"), input_ids=torch.randint(0, 50, (1, 6)), query_key=True)
    result = pk.score_decomposition(stack, 2, 1, query=5)
    assert len(repr(result).splitlines()) == 1 and "L2H1" in repr(result)
    frame = result.to_frame(3)
    assert math.isclose(frame["value"].sum(), float(result.scores[3]), rel_tol=1e-12)
    assert frame["value"].abs().is_monotonic_decreasing
    difference = result.pair_table(3, other=1)
    assert math.isclose(float(difference.sum()), float(result.scores[3] - result.scores[1]), rel_tol=1e-10)
    figure = result.plot(3, other=1, path=tmp_path / "pairs.png")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "key side" and ax.get_ylabel() == "query side" and "L2H1" in ax.get_title()
    assert (tmp_path / "pairs.png").stat().st_size > 0
    pairs = pk.score_pairs(stack, 2, 1, query=5, key=3)
    assert len(repr(pairs).splitlines()) == 1
    assert list(pairs.to_frame().columns)[:3] == ["rank", "query path", "key path"]
    with pytest.raises(ValueError, match="expected key= one of the 6 key positions"):
        result.pair_table()


def test_a_wrong_rotation_or_query_norm_scale_is_refused(monkeypatch):
    """The capture rebuilds the model's own queries and keys from the stream and refuses beyond the
    tolerance: a rotation left out, or a query/key norm's scale taken as 1, does not pass."""
    ids = torch.randint(0, 50, (1, 6))
    model = build("llama")
    capture_huggingface_residual(model, input_ids=ids, query_key=True)  # passes as it is
    with monkeypatch.context() as patch:
        patch.setattr(query_key_module.QueryKeyCapture, "rotate", lambda self, x, *args: x)
        with pytest.raises(ValueError, match=r"rebuild the model's own queries and keys only to"):
            capture_huggingface_residual(model, input_ids=ids, query_key=True)
    original = query_key_module._norm_scale_gain

    def unscaled(*args):
        scale, gain = original(*args)
        return torch.ones_like(scale), gain

    monkeypatch.setattr(query_key_module, "_norm_scale_gain", unscaled)
    with pytest.raises(ValueError, match=r"rebuild the model's own queries and keys only to"):
        capture_huggingface_residual(build("qwen3"), input_ids=ids, query_key=True)


# --- TransformerLens ------------------------------------------------------------------------------

TRANSFORMER_LENS_CASES = {
    "LN": {},
    "LNPre": {"normalization_type": "LNPre"},
    "RMS, rotary halves, grouped keys": {
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_dim": 4,
        "n_key_value_heads": 2,
    },
    "rotary adjacent pairs": {"positional_embedding_type": "rotary", "rotary_dim": 8, "rotary_adjacent_pairs": True},
    "attention-only, no norm": {"normalization_type": None, "attn_only": True},
    "soft-capped scores": {"attn_scores_soft_cap": 30.0},
    "ALiBi": {"positional_embedding_type": "alibi"},
    "query/key norms, rotary, grouped keys": {
        "normalization_type": "RMS",
        "positional_embedding_type": "rotary",
        "rotary_dim": 8,
        "use_qk_norm": True,
        "n_key_value_heads": 2,
    },
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # 3.x deprecates HookedTransformer
@pytest.mark.parametrize("case", TRANSFORMER_LENS_CASES)
def test_a_transformer_lens_model_scores_sum_to_its_own(case):
    """A HookedTransformer (3.x) or a TransformerBridge over the native model (4.x) of each kind, a
    left-padded batch: every head's grouped sums are the scores the model's own hooks give (3.x:
    ``hook_attn_scores``, 1e-12 relative where not masked) and, less their log-sum-exp, the log of
    its patterns (1e-10; on 4.x, whose hook holds the pattern, 1e-12 on the unpadded sequence and
    1e-6 on the padded one, where the bridge's own pattern differs from the softmax of its own
    scores by up to 2e-8). A native bridge has no ALiBi: that case reads a default model there."""
    pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    from pathkernels.adapters.residual import capture_transformer_lens_residual
    from pathkernels.testing import transformer_lens_major

    extra = dict(TRANSFORMER_LENS_CASES[case])
    tokens = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0
    version = transformer_lens_major()
    if version != 3 and extra.get("positional_embedding_type") == "alibi":
        extra = {}
    model = tl_model(attn_only=extra.pop("attn_only", False), **extra)
    stack, capture = capture_transformer_lens_residual(model, tokens, attention_mask=mask, query_key=True)
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    for batch in (0, 1):
        patterns = capture.patterns(stack.attn, batch)
        for layer in range(stack.num_layers):
            own = cache[f"blocks.{layer}.attn.hook_attn_scores"][batch].double()  # 3.x: [H, n, n], capped, masked
            for result in pk.score_decompositions(stack, layer, batch=batch):
                scores = result.scores
                if result.soft_cap:
                    scores = result.soft_cap * torch.tanh(scores / result.soft_cap)
                if version == 3:
                    expected = own[result.head, result.query, result.keys]
                    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))
                row = patterns[layer, result.head, result.query, result.keys]
                tolerance = 1e-10 if version == 3 else (1e-12 if batch == 0 else 1e-6)
                torch.testing.assert_close(scores - torch.logsumexp(scores, 0), row.log(), rtol=0, atol=tolerance)
    assert (result.soft_cap is not None) == (case == "soft-capped scores")


# Bridges over Hugging Face models: learned positions (GPT-2); rotary halves, grouped keys (Llama);
# query/key norms per head (Qwen3, Gemma-3) and over every head (OLMo 2); a soft cap and sliding
# windows (Gemma-2); partial rotary (Phi); a fused projection the bridge rotates itself (GPT-NeoX).
BRIDGED = ["gpt2", "llama", "qwen3", "gemma3", "olmo2", "gemma2-sliding-biased", "phi", "gpt_neox"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", BRIDGED)
def test_a_bridge_over_a_hugging_face_model_reads_its_scores(name, dtype, tmp_path):
    """A TransformerBridge over a float64 Hugging Face model (3.x and 4.x), left-padded: every head's
    sums are its own hook_attn_scores (before the cap) to 1e-12, from the same forward with its
    float32 steps in float64 (as the capture runs it), and to the rounding of its float32 rotary
    angles from its unmodified forward. Its rotary models' own forward gives NaN at the real tokens
    of a left-padded row (a fully masked query's float32 softmax), so check=False keeps them. A
    float32 bridge: to 1e-5 of both."""
    pytest.importorskip("transformer_lens")
    from test_adapters import bridge_over

    from pathkernels.adapters.precision import in_float64
    from pathkernels.adapters.residual import capture_transformer_lens_residual

    model = build(name, dtype)
    tokens, mask = padded_ids()
    tokens = tokens % 40
    bridge = bridge_over(model, tmp_path, dtype=dtype)
    exact = 1e-12 if dtype == torch.float64 else 1e-5
    stack, capture = capture_transformer_lens_residual(
        bridge, tokens, attention_mask=mask, query_key=True, check=name == "gpt2"
    )
    cap = float(capture.query_key.soft_cap.max())
    with in_float64(bridge):
        _, same_pass = bridge.run_with_cache(tokens, attention_mask=mask)
    _, unmodified = bridge.run_with_cache(tokens, attention_mask=mask)
    for batch in (0, 1):
        for layer in range(stack.num_layers):
            for result in pk.score_decompositions(stack, layer, batch=batch):
                assert (result.soft_cap is not None) == (cap > 0)
                for cache, tolerance in ((same_pass, exact), (unmodified, 1e-5)):
                    own = cache[f"blocks.{layer}.attn.hook_attn_scores"][batch].double()
                    expected = own[result.head, result.query, result.keys]
                    if cap > 0:
                        expected = cap * torch.atanh(expected / cap)
                    scale = float(expected.abs().max())
                    if batch == 1 and not bool(expected.isfinite().all()):
                        assert cache is unmodified and name != "gpt2"  # the NaN of its unmodified forward
                        continue
                    torch.testing.assert_close(result.scores, expected, rtol=0, atol=tolerance * scale)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_bridge_whose_scores_are_not_read_is_refused(tmp_path, monkeypatch):
    """A bridge's score side that would not give its own hook_attn_scores is refused (a scaling off
    by 0.1 %), and so are what is not read: a family outside QUERY_KEY_FAMILIES and an option that
    changes the queries beside the hooks. The rotary bridge's own unmodified forward, NaN at the
    real tokens of a left-padded row, is named as the reason its value side cannot be checked."""
    pytest.importorskip("transformer_lens")
    from test_adapters import bridge_over

    from pathkernels.adapters import residual

    tokens, mask = padded_ids()
    tokens = tokens % 40
    bridge = bridge_over(build("llama"), tmp_path, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"forward pass gives NaN or inf at real tokens of sequence\(s\) \[1\]"):
        residual.capture_transformer_lens_residual(bridge, tokens, attention_mask=mask)
    original = residual._transformer_lens_query_key

    def scaled(*args):
        maps = original(*args)
        maps.scaling = maps.scaling * 1.001
        return maps

    with monkeypatch.context() as patch:
        patch.setattr(residual, "_transformer_lens_query_key", scaled)
        with pytest.raises(ValueError, match=r"give the model's own scores \(hook_attn_scores\) only to"):
            residual.capture_transformer_lens_residual(bridge, tokens[:1], query_key=True)
    residual.capture_transformer_lens_residual(bridge, tokens[:1], query_key=True)  # as it is
    monkeypatch.setattr(bridge.cfg, "use_attn_in", True, raising=False)
    with pytest.raises(ValueError, match=r"does not read per-head attention inputs \(use_attn_in\) yet"):
        residual.capture_transformer_lens_residual(bridge, tokens[:1], query_key=True)
    monkeypatch.setattr(bridge.original_model.config, "model_type", "bloom")
    with pytest.raises(ValueError, match=r"query_key=True reads bridges over Hugging Face gpt2, .* not over 'bloom'"):
        residual.capture_transformer_lens_residual(bridge, tokens[:1], query_key=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_what_transformer_lens_does_not_read_is_refused_by_name():
    pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    from pathkernels.adapters.residual import capture_transformer_lens_residual
    from pathkernels.testing import transformer_lens_major

    tokens = torch.randint(0, 50, (1, 5))
    if transformer_lens_major() != 3:  # a native bridge has no relative position bias: its option refused
        with pytest.raises(ValueError, match=r"relative_positional_bias|Unsupported positional_embedding_type"):
            capture_transformer_lens_residual(tl_model(positional_embedding_type="relative_positional_bias"), tokens)
        return
    model = tl_model(positional_embedding_type="relative_positional_bias")
    with pytest.raises(ValueError, match=r"does not read 'relative_positional_bias' positions \(a bias added"):
        capture_transformer_lens_residual(model, tokens, query_key=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_alibi_is_a_term_of_its_own_in_every_result():
    """TransformerLens ALiBi (3.x): the bias is each score's ``position`` term, the row "position bias"
    of the grouped table, part of score_pairs' score and of the one-sided readouts' constant, so
    that each still sums to the model's own score; the causal check's prediction does not move."""
    pytest.importorskip("transformer_lens")
    from test_real_models_transformer_lens import tl_model

    from pathkernels.adapters.residual import capture_transformer_lens_residual
    from pathkernels.testing import transformer_lens_major

    if transformer_lens_major() != 3:
        pytest.skip("HookedTransformer: 3.x")
    model = tl_model(positional_embedding_type="alibi")
    tokens = torch.randint(0, 50, (1, 6))
    stack, _ = capture_transformer_lens_residual(model, tokens, query_key=True)
    layer, head, query, key = 2, 3, 5, 1
    result = pk.score_decomposition(stack, layer, head, query=query)
    slope_term = float(model.blocks[layer].attn.alibi[head, query, key])
    assert slope_term != 0 and float(result.position[key]) == pytest.approx(slope_term, abs=0)
    frame = result.to_frame(key)
    assert frame["value"].sum() == pytest.approx(float(result.model_scores[key]), rel=1e-12)
    assert float(frame.loc[frame["query group"] == "position bias", "value"].iloc[0]) == slope_term
    pairs = pk.score_pairs(stack, layer, head, query=query, key=key)
    assert pairs.position == slope_term and pairs.score == pytest.approx(pairs.model_score, rel=1e-12)
    for side in ("query", "key"):
        share = pk.score_attribution(stack, layer, head, query=query, key=key, side=side)
        closed = float(share.by_source_length.sum() + share.constant)
        assert closed == pytest.approx(float(share.value), rel=1e-12)


def test_every_score_result_plots_and_refuses_a_k_beyond_what_it_kept(tmp_path):
    """ScorePairs, TopScorePairs and CausalCheck plot (bars of the pairs, or the prediction beside
    the measured change), save where asked, and refuse a ``k`` beyond the pairs kept; a batch's
    attribution frames every element and the mean, and plots the mean."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    ids = torch.randint(0, 50, (2, 6))
    model = build("gpt2")
    stack, _ = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    pairs = pk.score_pairs(stack, 2, 1, query=5, key=3, top_k=4)
    figure = pairs.plot(path=tmp_path / "pairs.png")
    assert len(figure.axes[0].patches) == 8 and (tmp_path / "pairs.png").stat().st_size > 0
    assert " · " in figure.axes[0].get_yticklabels()[0].get_text()
    with pytest.raises(ValueError, match=r"ScorePairs\.plot: expected top_k <= 4"):
        pairs.plot(5)
    found = pk.top_score_pairs(stack, 2, 1, query=5, key=3, top_k=3)
    assert len(found.plot().axes[0].patches) == 3 and "certified" in found.plot().axes[0].get_title()
    with pytest.raises(ValueError, match=r"TopScorePairs\.plot: expected top_k <= 3"):
        found.plot(4)
    inputs = {"input_ids": ids}
    path = torch.cat([pairs.paths[1:2], torch.full((1, 1), -1)], 1)  # below layer 2, then no head there
    check = pk.causal_check(model, stack, inputs, path, pairs.sources[1:2], layer=2, head=1, query=5, key=3)
    bars = check.plot(path=tmp_path / "check.png").axes[0].patches
    assert len(bars) == 2 and float(bars[0].get_width()) == pytest.approx(float(check.predicted[0]))
    batch = pk.batch_attribution(stack, pk.logit_diff(model, 1, 2), top_k=2)
    frame = batch.to_frame()
    assert frame.columns[0] == "element" and sorted(set(frame["element"].astype(str))) == ["0", "1", "mean"]
    assert len(batch.plot().axes[0].patches) == 4
