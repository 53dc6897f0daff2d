"""pk.top_paths: the certified best-first search returns exactly the top (and bottom)
paths that enumerating every path gives, on pre-norm, RMSNorm and post-norm models, on nearly tied
attributions, and with max_length; a search stopped early keeps a certificate that no path it did
not visit exceeds."""

import math
import sys

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")

from test_real_models import bert, gpt2, llama  # noqa: E402


def captured(family: str, tokens: int = 9):
    model = {"gpt2": lambda: gpt2(4, 4, 32), "llama": llama, "bert": bert}[family]()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, tokens)))
    readout = torch.randn(32, dtype=torch.float64) if family == "bert" else pk.logit_diff(model, 1, 2)
    return model, stack, readout


def assert_same_as_enumeration(stack, readout, k: int, **kwargs):
    every = pk.path_attribution(stack, readout, top_k=k, max_length=kwargs.get("max_length"))
    for largest in (True, False):
        found = pk.top_paths(stack, readout, k, largest=largest, batch_nodes=32, **kwargs)
        assert found.certified and found.stopped == "certified" and found.gap == 0
        values, paths, sources = (
            (every.top_values, every.top_paths, every.top_sources)
            if largest
            else (every.bottom_values, every.bottom_paths, every.bottom_sources)
        )
        torch.testing.assert_close(found.values, values[:, 0, 0], rtol=1e-12, atol=1e-14)
        assert torch.equal(found.paths, paths[:, 0, 0]) and torch.equal(found.sources, sources[:, 0, 0])
        assert found.visited <= found.total == every.counts.sum()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_search_finds_what_enumeration_finds(family):
    _, stack, readout = captured(family)
    assert_same_as_enumeration(stack, readout, 10)
    assert_same_as_enumeration(stack, readout, 3, max_length=1)
    for bound in ("chain", "first_head", "plain"):
        assert_same_as_enumeration(stack, readout, 4, bound=bound)
    assert_same_as_enumeration(stack, readout, 4, max_length=2)  # the bound per node where heads run out


def test_progress_reports_the_search(capsys):
    _, stack, readout = captured("gpt2")
    pk.top_paths(stack, readout, 3, progress=True)
    assert "pathkernels.top_paths" in capsys.readouterr().err


def test_nearly_tied_heads_are_told_apart():
    """Every head of each layer a copy of head 0, perturbed by 1e-9: thousands of attributions
    tie to 1e-9, and the search still returns enumeration's order."""
    model = gpt2(3, 4, 32)
    with torch.no_grad():
        for block in model.transformer.h:  # GPT-2's fused QKV columns: [q | k | v], 4 heads of 8 each
            qkv, qkv_bias = block.attn.c_attn.weight.view(32, 3, 4, 8), block.attn.c_attn.bias.view(3, 4, 8)
            qkv[:] = qkv[:, :, :1] * (1 + 1e-9 * torch.randn(32, 3, 4, 8, dtype=torch.float64))
            qkv_bias[:] = qkv_bias[:, :1] * (1 + 1e-9 * torch.randn(3, 4, 8, dtype=torch.float64))
            out = block.attn.c_proj.weight.view(4, 8, 32)
            out[:] = out[:1] * (1 + 1e-9 * torch.randn(4, 8, 32, dtype=torch.float64))
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 7)))
    values = pk.path_attribution(stack, pk.logit_diff(model, 3, 4)).attribution[:, 0, 0]
    near = (values[:, None] - values[None, :]).abs() < 1e-7 * values.abs().max()
    assert int(near.sum()) > 2 * values.numel()  # the premise: many near ties
    assert_same_as_enumeration(stack, pk.logit_diff(model, 3, 4), 12)


@pytest.mark.parametrize("bound", ["node", "chain", "first_head", "plain"])
@pytest.mark.parametrize("seed", range(3))
def test_a_stopped_search_bounds_every_path_it_did_not_visit(seed, bound):
    """A frontier budget too small to finish: the search stops uncertified, and every path it did
    not visit has an attribution at most its bound (at least −bound for the smallest), whichever
    bound prunes."""
    torch.manual_seed(seed)
    _, stack, readout = captured(["gpt2", "llama", "bert"][seed % 3])
    every = pk.path_attribution(stack, readout)
    # The bound per node certifies these models after a node or two: stop it with its first children.
    budget = 1 if bound == "node" else 4000
    for largest in (True, False):
        found = pk.top_paths(
            stack, readout, 5, largest=largest, batch_nodes=2, memory_budget=budget, record=True, bound=bound
        )
        assert found.stopped == "memory_budget" and found.recorded is not None
        seen = {(tuple(p.tolist()), int(s)) for p, s in zip(*found.recorded[:2])}
        unseen = torch.tensor(
            [
                float(value[0, 0])
                for path, source, value in zip(every.paths, every.path_sources, every.attribution)
                if (tuple(path.tolist()), int(source)) not in seen
            ],
            dtype=torch.float64,
        )
        assert unseen.numel() > 0
        signed = unseen if largest else -unseen
        assert float(signed.max()) <= found.bound * (1 + 1e-12)
        if not found.certified:
            assert found.gap > 0


def test_bad_arguments_are_refused_by_name():
    model, stack, readout = captured("gpt2")
    cases = [
        ((stack, readout, 0), {}, r"expected top_k"),
        ((stack, torch.randn(32, 2, dtype=torch.float64)), {}, r"expected one readout direction, got 2"),
        ((stack, readout), {"time_limit": -1}, r"expected time_limit to be a positive number"),
        ((stack, readout), {"position": 9}, r"expected positions of real tokens"),
        (
            (stack, readout),
            {"bound": "tight"},
            r"expected bound in \('auto', 'node', 'chain', 'first_head', 'plain'\), got 'tight'",
        ),
    ]
    for args, kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=r"^pathkernels\.top_paths: " + message):
            pk.top_paths(*args, **kwargs)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_the_branch_factors_are_the_norms_of_the_dense_maps(family):
    """G_m from the QR factors equals max_h ‖T_h‖_∞ σ_max(F_h) of the dense d × d feature maps."""
    from pathkernels.analysis.attribution import read_out
    from pathkernels.analysis.top_paths import _head_factor

    _, stack, readout = captured(family)
    model = read_out(stack, readout, None, 0, None, "test").model
    for sublayer in model.sublayers[::2]:  # the attention sublayers
        d = sublayer.gamma.shape[0]
        centre_gamma = (torch.eye(d, dtype=torch.float64) - 1.0 / d) * sublayer.gamma[None, :]
        expected = []
        for head in range(sublayer.attn.shape[0]):
            value_output = sublayer.w_v[head] @ sublayer.w_o[head]
            if sublayer.pre:
                token, feature = sublayer.attn[head] * sublayer.scale[None, :], centre_gamma @ value_output
            else:
                token, feature = sublayer.scale[:, None] * sublayer.attn[head], value_output @ centre_gamma
            expected.append(float(token.abs().sum(-1).max() * torch.linalg.matrix_norm(feature, ord=2)))
        assert _head_factor(sublayer) == pytest.approx(max(expected), rel=1e-10)


def test_the_first_head_factors_are_their_definition():
    """C_s = max over heads h and sources i ≤ s of ‖A_h D‖_∞ · max_t ‖(K_i C Γ W_V,h)_t‖₂ · σ_max(W_O,h),
    written out head by head and source by source."""
    from pathkernels.analysis.attribution import read_out
    from pathkernels.analysis.top_paths import _first_head_factors

    _, stack, readout = captured("gpt2")
    model = read_out(stack, readout, None, 0, None, "test").model
    factors = _first_head_factors(model)
    for index, sublayer in enumerate(model.sublayers):
        if sublayer.attn is None:
            assert factors[index] == 0.0
            continue
        d = sublayer.gamma.shape[0]
        centre_gamma = (torch.eye(d, dtype=torch.float64) - 1.0 / d) * sublayer.gamma[None, :]
        expected = max(
            float((sublayer.attn[h] * sublayer.scale[None, :]).abs().sum(-1).max())
            * float((model.sources[i] @ centre_gamma @ sublayer.w_v[h]).norm(dim=-1).max())
            * float(torch.linalg.matrix_norm(sublayer.w_o[h], ord=2))
            for h in range(sublayer.attn.shape[0])
            for i in range(index + 1)
        )
        assert factors[index] == pytest.approx(expected, rel=1e-10)


def test_the_chain_factors_are_their_definition_and_bound_every_path():
    """The chain bound written out chain by chain (every set of heads, one per attention sublayer
    taken, top to bottom): σ(V_top) · Π ‖T‖_∞ · Π σ(V_lower U_upper) · κ'_lowest, on the captured
    model and on a variant with strong heads over small sources, where chains of several heads
    decide (so that the pairing term is needed); and at the top node of the captured model it
    bounds every path that takes a head, by enumeration."""
    from pathkernels.analysis.attribution import read_out
    from pathkernels.analysis.top_paths import _chain_factors

    model_hf = gpt2(3, 2, 16)
    stack, _ = capture_huggingface_residual(model_hf, input_ids=torch.randint(0, 50, (1, 6)))
    readout = pk.logit_diff(model_hf, 1, 2)
    setup = read_out(stack, readout, None, 0, None, "test")
    variants = {name: variant for name, variant, _, _ in _variants(setup.model, setup.rho[0, 0], setup.phi[0, 0])}
    for model in (setup.model, variants["strong heads, small sources above"]):
        single, several = _chains_by_size(model, stack.num_heads)
        expected = [max(a, b) for a, b in zip(single, several)]
        assert _chain_factors(model) == pytest.approx(expected, rel=1e-10, abs=1e-300)
    assert several[-1] > 2 * single[-1]  # the premise: on the variant, chains of several heads decide
    model = setup.model
    every = pk.path_attribution(stack, readout)
    with_head = (every.paths >= 0).any(1)
    bound = float(setup.rho.abs().sum() * setup.phi.norm()) * _chain_factors(model)[-1]
    assert bool((every.attribution[with_head, 0, 0].abs() <= bound).all())


def _chains_by_size(model, heads_count: int) -> tuple[list[float], list[float]]:
    """The chain bound per level written out, as the largest over chains of one head and over chains
    of several."""
    import itertools

    from pathkernels.analysis.top_paths import _source_head_factors, _token_norms

    attention = [index for index, sublayer in enumerate(model.sublayers) if sublayer.attn is not None]

    def u(index):
        return model.sublayers[index].norm_features_matrix() @ model.sublayers[index].w_v

    def sigma(matrix):
        return float(torch.linalg.matrix_norm(matrix, ord=2))

    single, several = [], []
    for level in range(len(model.sources)):
        expected = [0.0, 0.0]
        below = [index for index in attention if index < level]
        for size in range(1, len(below) + 1):
            for taken in itertools.combinations(sorted(below, reverse=True), size):  # top first
                for heads in itertools.product(range(heads_count), repeat=size):
                    value = sigma(model.sublayers[taken[0]].w_o[heads[0]])
                    for index, head in zip(taken, heads):
                        value *= float(_token_norms(model.sublayers[index])[head])
                    for (upper, g), (lower, g2) in zip(zip(taken, heads), zip(taken[1:], heads[1:])):
                        value *= sigma(model.sublayers[lower].w_o[g2] @ u(upper)[g])
                    value *= float(_source_head_factors(model, taken[-1])[heads[-1]])
                    expected[size > 1] = max(expected[size > 1], value)
        single.append(expected[0])
        several.append(expected[1])
    return single, several


def _every_node(model):
    """Every node of the readout trie of a frozen model, top down, as ``(level, ρ, φ)`` with the
    dense maps written from the design (pre-norm: a head ``ρ ↦ ρ A_h D``, ``φ ↦ C Γ W_V W_O φ``, the
    skip the identity; post-norm: a head ``ρ ↦ ρ D A_h``, ``φ ↦ W_V W_O C Γ φ``, the skip ``ρ ↦ ρ D``,
    ``φ ↦ C Γ φ``), from ``ρ = e``, ``φ = v`` at level S; a node at level j meets source j."""
    import torch as t

    def centre_gamma(sublayer):
        d = sublayer.gamma.shape[0]
        centre = t.eye(d, dtype=t.float64) - (1.0 / d if sublayer.centred else 0.0)
        return centre @ t.diag(sublayer.gamma)

    def walk(level, rho, phi):
        yield level, rho, phi
        if level == 0:
            return
        sublayer = model.sublayers[level - 1]
        if sublayer.pre:
            yield from walk(level - 1, rho, phi)
        else:
            yield from walk(level - 1, rho * sublayer.scale, centre_gamma(sublayer) @ phi)
        if sublayer.attn is None:
            return
        for head in range(sublayer.attn.shape[0]):
            if sublayer.pre:
                token = sublayer.attn[head] * sublayer.scale[None, :]
                feature = centre_gamma(sublayer) @ sublayer.w_v[head] @ sublayer.w_o[head]
            else:
                token = sublayer.scale[:, None] * sublayer.attn[head]
                feature = sublayer.w_v[head] @ sublayer.w_o[head] @ centre_gamma(sublayer)
            yield from walk(level - 1, rho @ token, feature @ phi)

    return walk


def _variants(model, rho, phi):
    """Frozen models built from ``model`` so that each term of the bound's assembly decides
    somewhere, as ``(name, model, ρ, φ)``: a dominant embedding met through skips with weak heads
    (the running maximum over the sources below a node), strong heads over small sources (the
    growth of head chains), norms that scale up (a post-norm skip's growth), random source scales.
    Each is a linear structure of the same shape as a captured model's."""
    import dataclasses

    def rescaled(scales=None, w_o=1.0, norm=1.0):
        sources = [s * f for s, f in zip(model.sources, scales or [1.0] * len(model.sources))]
        sublayers = [
            dataclasses.replace(s, scale=s.scale * norm, w_o=None if s.w_o is None else s.w_o * w_o)
            for s in model.sublayers
        ]
        return dataclasses.replace(model, sources=sources, sublayers=sublayers)

    count = len(model.sources)
    token = int(rho.abs().argmax())
    dominant = rescaled([50.0] + [1.0] * (count - 1), w_o=1e-3)
    aligned = dominant.sources[0][token].clone()  # φ along the embedding's row at the readout token
    generator = torch.Generator().manual_seed(0)
    random_scales = torch.rand(count, generator=generator, dtype=torch.float64).mul(6).sub(3).exp().tolist()
    return [
        ("dominant embedding, weak heads", dominant, rho, aligned),
        ("strong heads, small sources above", rescaled([1.0] + [0.01] * (count - 1), w_o=10.0), rho, phi),
        ("norms that scale up", rescaled(norm=5.0), rho, phi),
        ("random source scales", rescaled(random_scales), rho, phi),
    ]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("bound", ["chain", "first_head", "plain"])
def test_the_assembled_bound_holds_at_every_node_where_each_term_matters(family, bound):
    """``M_j`` bounds ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over the subtree of every node at level j, checked
    node by node by enumeration, on frozen models built so that each term of the assembly decides
    somewhere (:func:`_variants`): dropping the running maximum over the sources below a node, or a
    branch's growth factor, must fail here."""
    from pathkernels.analysis.attribution import read_out
    from pathkernels.analysis.top_paths import _reach_bounds

    model_hf = {"gpt2": lambda: gpt2(3, 2, 16), "bert": bert}[family]()
    stack, _ = capture_huggingface_residual(model_hf, input_ids=torch.randint(0, 50, (1, 5)))
    readout = torch.randn(stack.d_model, dtype=torch.float64)
    setup = read_out(stack, readout, None, 0, None, "test")
    checked = 0
    for name, model, rho, phi in _variants(setup.model, setup.rho[0, 0], setup.phi[0, 0]):
        reach = _reach_bounds(model, bound)
        nodes = list(_every_node(model)(len(model.sources) - 1, rho, phi))
        # The largest |ρᵀ K φ| at or below each node: its children follow it in the list, before
        # the next node of its level or above.
        largest = [0.0] * len(nodes)
        for index in range(len(nodes) - 1, -1, -1):
            level, node_rho, node_phi = nodes[index]
            value = float((node_rho @ model.sources[level] @ node_phi).abs())
            for later in range(index + 1, len(nodes)):
                if nodes[later][0] >= level:
                    break
                if nodes[later][0] == level - 1:
                    value = max(value, largest[later])
            largest[index] = value
        for index, (level, node_rho, node_phi) in enumerate(nodes):
            scale = float(node_rho.abs().sum() * node_phi.norm())
            assert largest[index] <= reach[level] * scale * (1 + 1e-9), (bound, name, level)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("bound", ["chain", "first_head", "plain"])
def test_the_assembled_bound_is_its_definition(family, bound):
    """``M_j`` written from its definition (docs/DESIGN.md, "The top paths, certified") over the
    factors, which have tests of their own: a loosened term (a sum for a maximum, a factor counted
    twice) fails here, a dropped one in the test above."""
    from pathkernels.analysis.attribution import read_out
    from pathkernels.analysis.top_paths import (
        _branch_bounds,
        _chain_factors,
        _first_head_factors,
        _reach_bounds,
    )

    _, stack, readout = captured(family)
    frozen = read_out(stack, readout, None, 0, None, "test").model
    for _, model, _, _ in _variants(frozen, torch.ones(1), None):
        kappa = [float(source.norm(dim=-1).max()) for source in model.sources]
        growth = _branch_bounds(model).tolist()
        expected = []
        for level in range(len(model.sources)):
            # Post-norm (or "plain"): the largest κ_i Π_{i ≤ m < j} G_m over the sources below.
            plain = max(kappa[i] * math.prod(growth[i:level]) for i in range(level + 1))
            if not model.sublayers[0].pre or bound == "plain":
                expected.append(plain)
                continue
            no_head = max(kappa[: level + 1])
            first = _first_head_factors(model)
            with_head = max([first[s] * math.prod(growth[s + 1 : level]) for s in range(level)], default=0.0)
            if bound == "chain":
                with_head = min(with_head, _chain_factors(model)[level])
            expected.append(max(no_head, with_head))
        torch.testing.assert_close(
            _reach_bounds(model, bound), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0
        )


# The bound per node (bound="node"): nodes are head sequences, a node's tails are computed when it
# is made, and ``_NodeBounds.remaining`` bounds the rest of its subtree.


def _dense_head(model, a: int, head: int):
    """Head ``head`` of attention sublayer number ``a`` as dense maps from the design: the token map
    ``A_h D`` ``[n, n]``, ``U = C Γ W_V`` ``[d, e]`` and ``V = W_O`` ``[e, d]`` (pre-norm)."""
    index = [i for i, s in enumerate(model.sublayers) if s.attn is not None][a]
    sublayer = model.sublayers[index]
    d = sublayer.gamma.shape[0]
    centre = torch.eye(d, dtype=torch.float64) - (1.0 / d if sublayer.centred else 0.0)
    return (
        index,
        sublayer.attn[head] * sublayer.scale[None, :],
        centre @ torch.diag(sublayer.gamma) @ sublayer.w_v[head],
        sublayer.w_o[head],
    )


def _head_sequences(model, rho, phi):
    """Every node of the search over head sequences, top down from the root ``(ρ, φ)``, as
    ``(a, head, ρ, z, tails, rest)``: the node's last head (head of attention sublayer a), its ``ρ``
    and ``z = V φ_parent`` (its φ is ``U z``), the attributions of its tails (sources 0..its level,
    no further head) and ``rest``, the largest |attribution| of the paths below it that take
    another head (0 if none), by enumeration with the dense maps of :func:`_dense_head`."""
    attention = sum(1 for s in model.sublayers if s.attn is not None)
    nodes = []

    def below(top: int, rho, phi) -> float:
        best = 0.0
        for a in range(top):
            for head in range(model.num_heads):
                index, token, u, v = _dense_head(model, a, head)
                child_rho, z = rho @ token, v @ phi
                child_phi = u @ z
                tails = torch.stack([child_rho @ model.sources[i] @ child_phi for i in range(index + 1)])
                rest = below(a, child_rho, child_phi)
                nodes.append((a, head, child_rho, z, tails, rest))
                best = max(best, float(tails.abs().max()), rest)
        return best

    below(attention, rho, phi)
    return nodes


def _chains_written_out(model):
    """``Q_c[u]`` per head c (attention sublayer a, head h) from its definition, token by token and
    pair by pair: ``Σ_v T_c[u, v] max(max_{i ≤ s} ‖(K_i U_c)_v‖₂, max_{c' below} σ(V_c' U_c) Q_c'[v])``
    with σ the dense spectral norm."""
    attention = sum(1 for s in model.sublayers if s.attn is not None)
    n = model.sources[0].shape[0]
    chains = {}
    for a in range(attention):
        for head in range(model.num_heads):
            index, token, u, _ = _dense_head(model, a, head)
            best = []
            for v in range(n):
                value = max(float((model.sources[i][v] @ u).norm()) for i in range(index + 1))
                for (a2, g), q in chains.items():
                    if a2 == a:  # heads of the same sublayer are not below
                        continue
                    pair = float(torch.linalg.matrix_norm(_dense_head(model, a2, g)[3] @ u, ord=2))
                    value = max(value, pair * float(q[v]))
                best.append(value)
            chains[a, head] = torch.tensor(
                [sum(float(token[r, v]) * best[v] for v in range(n)) for r in range(n)], dtype=torch.float64
            )
    return chains


def _positive_models():
    """Frozen pre-norm models on which the bound per node is attained, or nearly: one value per
    head (d_head = 1), every weight, source, gain and readout positive (no cancellation, and each
    σ of a pair of heads is the product it bounds), as ``(name, model, ρ, φ)``. With one-hot
    attention (each query reads one key) every token follows one path, so the per-token chains are
    the largest path exactly; with soft attention one head per sublayer dominates, so that the
    same continuation is the largest from every token. Norm scales differ from token to token."""
    from pathkernels.analysis.readout_trie import FrozenModel, Sublayer

    generator = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    def build(layers, heads, n, d, attention, source_scale=1.0, dominant=1.0, source_scales=None):
        sublayers, sources = [], [rand(n, d) * source_scale]
        for layer in range(layers):
            if attention == "one-hot":
                keys = torch.randint(0, n, (heads, n), generator=generator)
                attn = torch.zeros(heads, n, n, dtype=torch.float64)
                attn[torch.arange(heads)[:, None], torch.arange(n)[None, :], keys] = 1.0
            else:
                attn = rand(heads, n, n) + 0.1
                attn = attn / attn.sum(-1, keepdim=True)
            w_v, w_o = rand(heads, d, 1) + 0.1, rand(heads, 1, d) + 0.1
            w_o[0] *= dominant
            scale, gamma = 0.5 + rand(n), 0.5 + rand(d)
            sublayers.append(Sublayer(layer, attn, scale, gamma, w_v, w_o, pre=True, centred=False))
            sublayers.append(Sublayer(layer, None, 0.5 + rand(n), 0.5 + rand(d), None, None, pre=True, centred=False))
            sources += [rand(n, d) * 0.3, rand(n, d) * 0.3]
        if source_scales is not None:
            sources = [s * f for s, f in zip(sources, source_scales)]
        names = [f"source {i}" for i in range(len(sources))]
        return FrozenModel(sublayers, sources, names, layers, heads)

    def readout(model, token):
        rho = torch.zeros(model.sources[0].shape[0], dtype=torch.float64)
        rho[token] = 0.7
        return rho, rand(model.sources[0].shape[1]) + 0.1

    scales = (6 * rand(9) - 3).exp().tolist()
    cases = [
        ("one-hot attention", build(4, 2, 4, 3, "one-hot")),
        ("one-hot attention, strong heads over small sources", build(4, 2, 4, 3, "one-hot", source_scale=0.05)),
        ("one-hot attention, random source scales", build(4, 2, 4, 3, "one-hot", source_scales=scales)),
        (
            "soft attention, a dominant head",
            build(4, 2, 4, 3, "soft", dominant=20.0, source_scales=[30.0] + [0.01] * 8),
        ),
    ]
    return [(name, model, *readout(model, 1)) for name, model in cases]


def _node_bound_cases():
    """The positive models of :func:`_positive_models` and captured GPT-2 and Llama models (d_head > 1,
    centred norms, biases) with the rescalings of :func:`_variants`."""
    from pathkernels.analysis.attribution import read_out

    cases = [(name, model, rho, phi, True) for name, model, rho, phi in _positive_models()]
    for family in ("gpt2", "llama"):
        model_hf = {"gpt2": lambda: gpt2(4, 2, 16), "llama": lambda: llama(layers=3, heads=2, kv_heads=1, width=16)}[
            family
        ]()
        stack, _ = capture_huggingface_residual(model_hf, input_ids=torch.randint(0, 50, (1, 5)))
        setup = read_out(stack, torch.randn(stack.d_model, dtype=torch.float64), None, 0, None, "test")
        for name, model, rho, phi in _variants(setup.model, setup.rho[0, 0], setup.phi[0, 0]):
            cases.append((f"{family}: {name}", model, rho, phi, False))
    return cases


def test_the_bound_per_node_holds_below_every_node_and_is_attained_where_built_to_be():
    """At every node of the search over head sequences, by enumeration: the tails are the paths'
    attributions, and ``remaining`` bounds every path below the node that takes another head; on the
    positive models it equals that largest path at every node (to 1e-9), so a term dropped, shrunk or
    loosened fails here."""
    from pathkernels.analysis.top_paths import _NodeBounds

    for name, model, rho, phi, attained in _node_bound_cases():
        node = _NodeBounds(model)
        nodes = _head_sequences(model, rho, phi)
        ratios = []
        for a, head, node_rho, z, tails, rest in nodes:
            torch.testing.assert_close(node.tails(a, head, node_rho[None], z[None])[0], tails, rtol=1e-10, atol=1e-12)
            bound = float(node.remaining(a, head, node_rho[None], z[None])[0])
            if a == 0:
                assert bound == -math.inf and rest == 0.0, name
                continue
            assert rest <= bound * (1 + 1e-9), (name, a, head, rest, bound)
            ratios.append(rest / bound)
        assert len(ratios) >= 8, name
        if attained:
            assert min(ratios) > 1 - 1e-9, (name, min(ratios))


def test_the_bound_per_node_is_its_definition():
    """The chains ``Q`` and ``remaining`` written out token by token and head by head with dense
    maps (:func:`_chains_written_out`), on captured and positive models: a term loosened (a sum
    for a maximum, a matrix norm for a row) fails here."""
    from pathkernels.analysis.top_paths import _first_head_reach, _NodeBounds

    for name, model, rho, phi, _ in _node_bound_cases():
        node = _NodeBounds(model)
        chains = _chains_written_out(model)
        attention = [i for i, s in enumerate(model.sublayers) if s.attn is not None]
        for a in range(len(attention)):
            expected = torch.stack([chains[a, h] for h in range(model.num_heads)])
            torch.testing.assert_close(node.chains[a], expected, rtol=1e-9, atol=1e-300, msg=name)
        first = _first_head_reach(model)
        for a, head, node_rho, z, _, _ in _head_sequences(model, rho, phi)[:40]:
            if a == 0:
                continue
            u = _dense_head(model, a, head)[2]
            terms = [
                float(node_rho.abs() @ chains[a2, g]) * float((_dense_head(model, a2, g)[3] @ (u @ z)).norm())
                for a2 in range(a)
                for g in range(model.num_heads)
            ]
            expected = min(max(terms), float(node_rho.abs().sum() * (u @ z).norm()) * first[attention[a]])
            got = float(node.remaining(a, head, node_rho[None], z[None])[0])
            assert got == pytest.approx(expected, rel=1e-9), name


def test_the_search_over_head_sequences_visits_every_path_once():
    """With k beyond the paths nothing is pruned: the search visits each path once, and its list is
    the enumeration's whole, in order."""
    _, stack, readout = captured("gpt2")
    every = pk.path_attribution(stack, readout, top_k=int(1e4))
    total = int(every.counts.sum())
    found = pk.top_paths(stack, readout, total + 5, record=True)
    assert found.visited == total == found.values.shape[0] and found.certified
    seen = {(tuple(p.tolist()), int(s)) for p, s in zip(*found.recorded[:2])}
    assert len(seen) == total
    torch.testing.assert_close(found.values, every.top_values[:total, 0, 0], rtol=1e-12, atol=1e-14)


def test_a_time_limit_within_the_set_up_of_the_bound_per_node_stops_uncertified():
    """The set-up of the bound per node checks the time limit between sublayers: past it, the
    search returns the direct paths, uncertified, with an infinite bound and gap."""
    _, stack, readout = captured("gpt2")
    found = pk.top_paths(stack, readout, 3, time_limit=1e-9)
    assert found.stopped == "time_limit" and not found.certified
    assert found.bound == math.inf and found.gap == math.inf
    assert found.visited == 9 and found.values.shape[0] == 3 and bool((found.paths == -1).all())  # 9 sources


@pytest.mark.parametrize("bound", ["chain", "first_head"])
def test_a_time_limit_within_the_set_up_of_a_level_bound_stops_uncertified(bound, monkeypatch):
    """The set-ups of the chain and first-head bounds check the time limit between sublayers too
    (the chain bound's head pairs took 229 s past a 120 s limit at GPT-2-XL's shape): past it, the
    search returns at once, uncertified, nothing visited, with an infinite bound and gap; no pair
    of heads was multiplied (the check comes before each sublayer's)."""
    top_paths_module = sys.modules["pathkernels.analysis.top_paths"]  # the package's name is the function's
    pairs = []
    original = top_paths_module._pair_norms
    monkeypatch.setattr(top_paths_module, "_pair_norms", lambda *a: pairs.append(1) or original(*a))
    _, stack, readout = captured("gpt2")
    found = pk.top_paths(stack, readout, 3, time_limit=1e-9, bound=bound)
    assert found.stopped == "time_limit" and not found.certified and found.bound_kind == bound
    assert found.bound == math.inf and found.gap == math.inf and found.visited == 0 and not pairs
    assert pk.top_paths(stack, readout, 3, bound=bound).certified and (pairs or bound == "first_head")


def test_auto_takes_the_node_bound_unless_its_set_up_is_too_large_for_the_device(monkeypatch):
    """bound="auto" (the default) is the node bound on a small model, and the plain bound where
    the node bound's head pairs exceed the device's set-up allowance: both certify the same list."""
    top_paths_module = sys.modules["pathkernels.analysis.top_paths"]  # the package's name is the function's
    _, stack, readout = captured("gpt2")
    node = pk.top_paths(stack, readout, 5)
    assert node.bound_kind == "node" and node.certified
    monkeypatch.setitem(top_paths_module._NODE_SET_UP, "cpu", 1.0)
    plain = pk.top_paths(stack, readout, 5)
    assert plain.bound_kind == "plain" and plain.certified
    assert torch.equal(plain.paths, node.paths)
    torch.testing.assert_close(plain.values, node.values, rtol=1e-12, atol=0)
    assert pk.top_paths(stack, readout, 5, bound="node").bound_kind == "node"


def test_auto_takes_the_plain_bound_where_the_node_bounds_set_up_does_not_fit_the_free_memory(monkeypatch):
    """bound="auto" takes the node bound where the memory free holds its set-up, to the byte, and
    the plain bound a byte below (where bound="node" is refused by name): the same certified list."""
    top_paths_module = sys.modules["pathkernels.analysis.top_paths"]
    memory = sys.modules["pathkernels.core._memory"]
    from pathkernels.analysis.readout_trie import frozen_model

    _, stack, readout = captured("gpt2")
    real = torch.ones(stack.attn.shape[-1], dtype=torch.bool)
    need = top_paths_module._NodeBounds.set_up_bytes(frozen_model(stack, stack.residual_capture, 0, real))
    found = {}
    for free in (need, need - 1):
        monkeypatch.setattr(memory, "available_memory", lambda device, free=free: free)
        found[free] = pk.top_paths(stack, readout, 5)
        assert found[free].certified
    assert found[need].bound_kind == "node" and found[need - 1].bound_kind == "plain"
    assert torch.equal(found[need].paths, found[need - 1].paths)
    with pytest.raises(MemoryError, match=r"the bound per node's set-up .* bound=\"plain\""):
        pk.top_paths(stack, readout, 5, bound="node")


def _assert_top_paths_of(stack, readout, k: int, scale: float, **kwargs):
    """top_paths of ``readout`` scaled by ``scale`` returns, certified, the enumeration's list of the
    unscaled readout (values scaled, relative 1e-12), for the largest and the smallest (which a
    negative scale swaps)."""
    every = pk.path_attribution(stack, readout, top_k=k)
    for largest in (True, False):
        found = pk.top_paths(stack, readout * scale, k, largest=largest, **kwargs)
        top = largest == (scale > 0)
        values, paths = (every.top_values, every.top_paths) if top else (every.bottom_values, every.bottom_paths)
        assert found.certified and found.stopped == "certified", (scale, largest)
        assert torch.equal(found.paths, paths[:, 0, 0]), (scale, largest)
        torch.testing.assert_close(found.values / scale, values[:, 0, 0], rtol=1e-12, atol=0)
        assert math.isfinite(found.bound) and found.bound <= abs(scale) * 1e3


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("scale", [1e-300, 1e-200, 1e250, 1e300, -1e-300])
def test_certificates_hold_at_every_scale_of_the_readout(family, scale):
    """A readout scaled by 1e±300: the list and certificate are the unscaled readout's, scaled, for
    every bound (the squares of the bounds' norms made them 0 below 1e-154, so that a wrong list
    came back certified)."""
    _, stack, readout = captured(family)
    direction = readout.directions[0] if isinstance(readout, pk.Readout) else readout
    for bound in ("node", "chain", "first_head", "plain"):
        _assert_top_paths_of(stack, direction, 4, scale, bound=bound)


@pytest.mark.parametrize("scale", [1e300, 1e-300])
def test_certificates_hold_at_every_scale_of_the_weights(scale):
    """Every head's value map scaled by ``s = 1e±300`` and its output map by ``4/s``: the bounds meet
    factors of 1e±300 (value maps, their Gram matrices, the norms of pairs of heads), and paths
    through several heads are in the lists, so that every bound is needed. The search must still
    certify the enumeration's list."""
    model = gpt2(4, 4, 32)
    with torch.no_grad():
        for block in model.transformer.h:  # GPT-2's fused QKV columns: [q | k | v]
            block.attn.c_attn.weight[:, 64:] *= scale
            block.attn.c_attn.bias[64:] *= scale
            block.attn.c_proj.weight *= 4 / scale
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 9)))
    readout = pk.logit_diff(model, 1, 2).directions[0]
    every = pk.path_attribution(stack, readout, top_k=12)
    lengths = (torch.cat([every.top_paths, every.bottom_paths]) >= 0).sum(-1)
    assert int(lengths.max()) >= 2  # the premise: chains of heads are among the listed paths
    for bound in ("node", "chain", "first_head", "plain"):
        _assert_top_paths_of(stack, readout, 12, 1.0, bound=bound)


def test_a_bound_that_is_not_a_number_never_prunes():
    """``inf · 0`` in a bound's factors gives NaN, which compares false with the k-th value and so
    would prune: it is taken as ``inf``."""
    from pathkernels.analysis.top_paths import _norm, _safe_bounds

    bounds = _safe_bounds(torch.tensor([math.nan, 1.0, math.inf, -math.inf], dtype=torch.float64))
    assert bounds.tolist() == [math.inf, 1.0, math.inf, -math.inf]
    tiny = torch.tensor([[3e-300, 4e-300], [3e300, 4e300], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_norm(tiny), torch.tensor([5e-300, 5e300, 0.0], dtype=torch.float64), rtol=1e-15, atol=0)


def test_exact_ties_at_the_kth_value_give_a_valid_certified_list():
    """Every head of each layer an exact copy of head 0: attributions tie exactly in groups, and for
    every k the k-th value sits in a tie. Which of the tied paths is returned is not specified; the
    values must be enumeration's, each returned path's own attribution, and certified."""
    model = gpt2(3, 3, 24)
    with torch.no_grad():
        for block in model.transformer.h:  # 3 heads of 8: q, k and v columns, the output rows
            qkv, qkv_bias = block.attn.c_attn.weight.view(24, 3, 3, 8), block.attn.c_attn.bias.view(3, 3, 8)
            qkv[:] = qkv[:, :, :1].clone()
            qkv_bias[:] = qkv_bias[:, :1].clone()
            out = block.attn.c_proj.weight.view(3, 8, 24)
            out[:] = out[:1].clone()
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    readout = pk.logit_diff(model, 1, 2)
    every = pk.path_attribution(stack, readout)
    own = {
        (tuple(p.tolist()), int(s)): float(v[0, 0])
        for p, s, v in zip(every.paths, every.path_sources, every.attribution)
    }
    ordered = every.attribution[:, 0, 0].sort(descending=True).values
    tied = 0
    for k in range(1, 25):
        found = pk.top_paths(stack, readout, k, batch_nodes=2)
        assert found.certified
        torch.testing.assert_close(found.values, ordered[:k], rtol=1e-12, atol=1e-14)
        for path, source, value in zip(found.paths, found.sources, found.values):
            assert own[tuple(path.tolist()), int(source)] == pytest.approx(float(value), rel=1e-12, abs=1e-14)
        tied += int(k < ordered.numel() and bool((ordered[k] - ordered[k - 1]).abs() <= 1e-14 * ordered.abs().max()))
    assert tied >= 5  # the premise: many k-th values tie with the next one


def test_the_top_paths_of_a_batch_mean_are_those_of_every_path_averaged():
    """``top_paths(batch=[…])`` searches the mean over a padded batch, each element read at its own
    last real token: certified, and equal (largest and smallest) to the top of the path-by-path mean
    of separate path_attribution calls. Its model (the elements' tokens side by side, the token maps
    block-diagonal) walked whole gives the mean batch_attribution folds in step. Per-element
    readouts are refused: batch_attribution has their mean."""
    from test_real_models import gpt2

    import pathkernels.analysis.attribution as attribution

    model = gpt2().eval()
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, :2] = 0
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    readout = pk.logit_diff(model, 1, 2)
    alone = [pk.path_attribution(stack, readout, batch=b, top_k=0) for b in range(3)]
    mean = torch.stack([r.attribution[:, 0, 0] for r in alone]).mean(0)
    for largest in (True, False):
        found = pk.top_paths(stack, readout, top_k=6, batch=[0, 1, 2], largest=largest)
        assert found.certified and found.position == "each element's own token (8, 5, 8)"
        ordered = torch.sort(mean, descending=largest)
        torch.testing.assert_close(found.values, ordered.values[:6], rtol=1e-12, atol=1e-14)
        assert torch.equal(found.paths, alone[0].paths[ordered.indices[:6]])
    setups = [attribution.read_out(stack, readout, None, b, None, "test") for b in range(3)]
    whole = attribution.attribute(attribution.mean_read_out(setups, "test"), 3, 1 << 30)
    in_step = pk.batch_attribution(stack, readout, top_k=3).mean
    torch.testing.assert_close(whole.by_source_length, in_step.by_source_length, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(whole.by_head, in_step.by_head, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(whole.value, in_step.value, rtol=1e-14, atol=1e-14)
    other = attribution.read_out(stack, pk.logit_diff(model, 3, 4), None, 1, None, "test")
    with pytest.raises(ValueError, match=r"^test: the mean over a batch reads one readout"):
        attribution.mean_read_out([setups[0], other], "test")
    with pytest.raises(ValueError, match=r"^pathkernels\.top_paths: expected batch to be an element or a non-empty"):
        pk.top_paths(stack, readout, batch=[])


def test_the_level_search_frontier_grows_its_buffers_to_the_budget_not_past_it():
    """_Frontier's buffers grow by half, but not past ``most`` rows unless one step's nodes need
    more: a frontier of 4 rows limited to 10 holds 10 after taking 6, then exactly what a step
    adds beyond (12 + 1), never 1.5× of it."""
    frontier_class = sys.modules["pathkernels.analysis.top_paths"]._Frontier

    def rows(count: int) -> list[torch.Tensor]:
        return [torch.rand(count, 3, dtype=torch.float64), torch.rand(count, dtype=torch.float64)]

    frontier = frontier_class(rows(4))
    frontier.most = 10
    frontier.add(rows(3))
    assert frontier.parts[0].shape[0] == 7 and frontier.live == 7
    frontier.add(rows(3))
    assert frontier.parts[0].shape[0] == 10 and frontier.live == 10
    frontier.add(rows(3))
    assert frontier.parts[0].shape[0] == 13 and frontier.live == 13
    assert bool((frontier.bounds > -math.inf).all())
