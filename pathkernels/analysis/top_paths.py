"""The exact top paths of a readout without visiting the whole tree: a best-first search over the
readout trie with a certificate (docs/DESIGN.md, "The top paths, certified").

A node of the trie (:mod:`pathkernels.analysis.readout_trie`) has chosen the branches of the top
sublayers; it holds ``ρ`` (``rᵀ`` through their token maps, ``n`` entries) and ``φ`` (their feature
maps applied to ``v``, ``d`` entries). Every path below it has the attribution ``ρ'ᵀ K φ'``, where
``ρ'``, ``φ'`` continue through the branches below and ``K`` is the source where it ends. So

    |attr| ≤ ‖ρ'‖₁ ‖φ'‖₂ max_t ‖K_t‖₂ ≤ ‖ρ‖₁ ‖φ‖₂ · M_j,

with ``‖ρᵀ T‖₁ ≤ ‖ρ‖₁ ‖T‖_∞`` (the largest row sum of |T|) and ``‖F φ‖₂ ≤ σ_max(F) ‖φ‖₂`` for each
branch, and ``M_j = max_{i ≤ j} κ_i Π_{i ≤ m < j} G_m`` over the sources i a node at level j can still
reach: ``κ_i`` the largest row norm of source i, ``G_m`` the largest factor ``‖T‖_∞ σ_max(F)`` of
sublayer m's branches (the skip's is 1 in a pre-norm model). In a pre-norm model the source is
paired with the path's lowest head instead, whose ``d_head`` values are all of φ it meets
(:func:`_first_head_factors`), a bound tighter by about ``√(d / d_head)``. The search expands the
nodes of largest bound first, in batches, and stops when no unexpanded node's bound exceeds the
k-th value found: then no path left unvisited can enter the top k, and the bound is the certificate.

Those are bounds per level (``bound="chain"``, ``"first_head"``, ``"plain"``). The default,
``bound="node"``, searches pre-norm models over head sequences instead (:class:`_NodeBounds`,
:func:`_search_heads`): a node's paths that take no further head are computed exactly when it is
made, and the rest are bounded from the node's own ``ρ`` (row by row) and ``φ`` (through the next
head's output map), with chains of head pairs kept per token.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pathkernels.analysis.attribution import Readout, check_kept, mean_read_out, named, path_bars, read_out
from pathkernels.analysis.readout_trie import NO_HEAD, Fold, FrozenModel, Sublayer, TensorCache, Walker, describe_path
from pathkernels.core import _memory
from pathkernels.core._figures import check_save_path, saved, titled
from pathkernels.core._memory import check_fits
from pathkernels.core._progress import progress_bar
from pathkernels.core._repr import short_repr
from pathkernels.core._scaling import leading_exponent, power_of_two, times_power_of_two
from pathkernels.core.checks import check_flag, check_int, listed, renamed
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

_WHERE = "pathkernels.top_paths"
_BOUNDS = ("auto", "node", "chain", "first_head", "plain")
# bound="auto" takes the node bound where its set-up, the product of every pair of heads' d_head × d and
# d × d_head maps ((Σ H·d_head)² d / 2 multiply-adds), stays below this on the device, and the plain bound,
# whose set-up is per sublayer, beyond. On a 2-core CPU: GPT-2-XL's 4.7·10^12 took more than 150 s, where
# the plain bound certified its top 20 (16 tokens) in 35 s; Llama-3.2-1B's 1.1·10^12 pays (256 tokens:
# the node bound certified in 137 s, the plain bound's frontier filled its budget after 3,883 paths).
_NODE_SET_UP = {"cpu": 2e12, "cuda": 1e14}


@dataclass
class TopPaths:
    """The ``k`` largest attributions (or smallest, ``largest=False``) of one readout at one token.

    Attributes:
        values: ``[k']`` attributions, best first (``k' ≤ k`` when the tree has fewer paths);
            ``paths [k', L]`` (the head at each layer, −1 where none) and ``sources [k']`` (into
            ``source_names``).
        bound: no path left unvisited has an attribution above ``bound`` (below ``−bound`` for the
            smallest, on the negated readout); ``certified``: ``bound ≤`` the k-th value, so the
            list is exactly the top k; ``gap``: ``max(0, bound − k-th value)`` otherwise (``inf``
            when the time limit passed while the bound was set up: with the bound per node the direct
            paths alone were visited, with the others none).
        visited: paths whose attribution was computed; ``expanded``: trie nodes expanded;
            ``total``: paths in the tree; ``seconds``: the search's time; ``stopped``: why it
            ended (``"certified"``, ``"time_limit"`` or ``"memory_budget"``); ``bound_kind``: the bound
        that pruned (``bound="auto"`` resolved).
        recorded: with ``record=True``, every visited path ``(paths, sources, values)``.
    """

    values: Tensor
    paths: Tensor
    sources: Tensor
    source_names: list[str]
    label: str
    position: int | str  # the token read, or where a batch's mean is read
    largest: bool
    bound: float
    certified: bool
    gap: float
    visited: int
    expanded: int
    total: int
    seconds: float
    stopped: str
    recorded: tuple[Tensor, Tensor, Tensor] | None = None
    model_name: str = ""  # the model's name for figure titles (AttentionStack.name)
    replaced: object | None = None  # the MLPs replaced by transcoders (their steps' names), or None
    bound_kind: str = ""  # "node", "chain", "first_head" or "plain"

    def table(self) -> list[dict]:
        """Rows: rank, path (text), source, length, attribution."""
        return [
            {
                "rank": rank + 1,
                "path": describe_path(self.paths[rank], self.source_names[int(self.sources[rank])], self.replaced),
                "source": self.source_names[int(self.sources[rank])],
                "length": int((self.paths[rank] >= 0).sum()),
                "attribution": float(self.values[rank]),
            }
            for rank in range(self.values.shape[0])
        ]

    def __repr__(self) -> str:
        which = "largest" if self.largest else "smallest"
        values = ", ".join(f"{float(v):.4g}" for v in self.values[:3]) + (", …" if self.values.shape[0] > 3 else "")
        how = "certified" if self.certified else f"not certified, gap {self.gap:.3g} ({self.stopped})"
        headline = (
            f"the {self.values.shape[0]} {which} paths of {self.label} at {self._at()}: {values}; {how}; "
            f"{self.visited:,} of {self.total:,} paths visited in {self.seconds:.3g} s"
        )
        return short_repr(self, headline)

    def _at(self) -> str:
        return f"token {self.position}" if isinstance(self.position, int) else self.position

    def to_frame(self):
        """:meth:`table` as a pandas DataFrame (pandas is optional)."""
        import pandas as pd

        return pd.DataFrame(self.table(), columns=["rank", "path", "source", "length", "attribution"])

    @renamed("pathkernels.TopPaths.plot", k="top_k")
    def plot(self, top_k: int | None = None, *, ax=None, path=None):
        """The ``top_k`` paths found (default: all) as horizontal bars, labelled by path; the title
        says whether the list is certified. More than the paths found is refused. Returns the
        matplotlib Figure; with ``path`` it is also saved there (the format from the suffix)."""
        where = "pathkernels.TopPaths.plot"
        check_save_path(path, where)
        found = self.values.shape[0]
        k = found if top_k is None else check_int(top_k, "top_k", where, minimum=1)
        check_kept(k, found, self.total, where)
        rows = self.table()[:k]
        which = "largest" if self.largest else "smallest"
        how = "certified" if self.certified else f"not certified: gap {self.gap:.3g}"
        label = f"attribution to {self.label} at {self._at()}"
        title = titled(self.model_name, f"the {len(rows)} {which} paths ({how})")
        return saved(path_bars(rows, [], label, title, ax), path)


def _unit(x: Tensor, dims) -> Tensor:
    """The power of two ``2^e ≤ max |x| < 2^(e+1)`` over ``dims`` (kept as size-1 dimensions; 1 where
    x is zero or not finite): dividing by it is exact and brings the largest entry into [1, 2), so
    that squares neither overflow nor underflow to 0 where x does not."""
    return power_of_two(leading_exponent(x, dims, keepdim=True))


def _exponent(x: Tensor) -> int:
    """``e`` with ``2^e ≤ max |x| < 2^(e+1)`` (0 where x is zero or not finite)."""
    return int(leading_exponent(x.flatten(), 0))


def _times_power_of_two(x, exponent: int):
    """``x · 2^exponent`` for a float or a float64 tensor, exact wherever the result is in range."""
    scaled = times_power_of_two(torch.as_tensor(x, dtype=torch.float64), torch.tensor(exponent))
    return scaled if isinstance(x, Tensor) else float(scaled)


def _norm(x: Tensor, dim: int = -1) -> Tensor:
    """``‖x‖₂`` over ``dim``, computed on x scaled by a power of two (:func:`_unit`): the plain norm
    squares the entries, which makes it 0 for entries below 1e-154 and inf above 1e154."""
    unit = _unit(x, dim)
    return (x / unit).norm(dim=dim) * unit.squeeze(dim)


def _safe_bounds(bound: Tensor) -> Tensor:
    """Bounds with NaN (``inf · 0`` where a factor overflowed) taken as ``inf``: a bound that is not
    a number must never prune."""
    return torch.where(bound.isnan(), math.inf, bound)


def _branch_bounds(model: FrozenModel) -> Tensor:
    """``G_m`` per sublayer: the largest ``‖T‖_∞ σ_max(F)`` over its branches, the skip's included."""
    factors = []
    for sublayer in model.sublayers:
        factors.append(max(_skip_factor(sublayer), _head_factor(sublayer)))
    return torch.tensor(factors, dtype=torch.float64)


def _skip_factor(sublayer: Sublayer) -> float:
    if sublayer.pre:
        return 1.0
    return float(sublayer.scale.max()) * float(_spectral_norm(sublayer.norm_features_matrix()))


def _token_norms(sublayer: Sublayer) -> Tensor:
    """``‖T_h‖_∞`` per head ``[H]``, the largest row sum of ``|T_h|``: ``T = A D`` (pre-norm) or
    ``D A`` (post-norm)."""
    return sublayer.token_maps.abs().sum(-1).amax(-1)


def _head_factor(sublayer: Sublayer) -> float:
    """The largest ``‖T_h‖_∞ σ_max(F_h)`` over the heads (0 for an MLP), F_h a product of a
    ``d × d_head`` and a ``d_head × d`` factor (:func:`_product_norm`)."""
    if not sublayer.branches:  # an MLP, or a replaced MLP with no feature open here
        return 0.0
    if sublayer.pre:  # F = C Γ W_V W_O
        left, right = sublayer.norm_values, sublayer.w_o
    else:  # F = W_V W_O C Γ
        left, right = sublayer.w_v, sublayer.w_o @ sublayer.norm_features_matrix()
    return float((_token_norms(sublayer) * _product_norm(left, right)).max())


def _spectral_norm(matrix: Tensor) -> Tensor:
    """``σ_max`` over the last two dimensions: the square root of the largest eigenvalue of the
    smaller Gram matrix. (The symmetric eigensolver, because LAPACK's batched SVD and QR of small
    matrices stall for seconds on a loaded two-core machine; the eigensolver does not.)"""
    unit = _unit(matrix, (-2, -1))  # the largest entry scaled into [1, 2): the Gram matrix stays in range
    matrix = matrix / unit
    gram = matrix.mT @ matrix if matrix.shape[-1] <= matrix.shape[-2] else matrix @ matrix.mT
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt() * unit[..., 0, 0]


def _product_norm(left: Tensor, right: Tensor) -> Tensor:
    """An upper bound on ``σ_max(left @ right)``, ``left [..., d, e]``, ``right [..., e, d']``, without
    the ``d × d'`` product, within a relative ``10⁻¹²`` of it: ``‖L R x‖² = xᵀ Rᵀ (LᵀL) R x ≤ ‖Cᵀ R x‖²``
    with ``C Cᵀ = LᵀL + δ I`` (Cholesky, δ = 10⁻¹² of LᵀL's largest diagonal entry, so that it
    exists when L is singular), so it is ``σ_max(Cᵀ R)`` of an ``e × d'`` matrix. Both factors are
    first scaled by powers of two to a largest entry in [1, 2) (:func:`_unit`), so that the Gram
    matrix stays in range."""
    left_unit, right_unit = _unit(left, (-2, -1)), _unit(right, (-2, -1))
    left, right = left / left_unit, right / right_unit
    gram = left.mT @ left
    shift = 1e-12 * gram.diagonal(dim1=-2, dim2=-1).amax(-1) + torch.finfo(gram.dtype).tiny
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    factor = torch.linalg.cholesky(gram + shift[..., None, None] * eye)
    return _spectral_norm(factor.mT @ right) * (left_unit * right_unit)[..., 0, 0]


def _reach_bounds(model: FrozenModel, bound: str = "chain", out_of_time=None) -> Tensor:
    """``M_j`` for j = 0..S: a bound on ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over every path below a node at
    level j. Post-norm: the largest ``κ_i Π_{i ≤ m < j} G_m`` over the sources i ≤ j. Pre-norm,
    where a skip is the identity: the larger of ``max_{i ≤ j} κ_i`` (paths that take no further
    head) and, for the paths that do, the smaller of two bounds: ``max_s C_s Π_{s < m < j} G_m``
    over the attention sublayers s < j where a path takes its lowest head, with the source folded
    into that head (:func:`_first_head_factors`), and the chain bound of :func:`_chain_factors`.
    ``bound`` picks fewer of them: ``"first_head"`` leaves the chain bound out, ``"plain"`` takes the
    post-norm form for every model. :class:`_OutOfTime` when ``out_of_time()`` turns true between
    two sublayers of the set-up."""
    kappa = [float(_norm(source).max()) for source in model.sources]
    growth = _branch_bounds(model).tolist()
    if not model.pre_norm or bound == "plain":
        reach = [kappa[0]]
        for level in range(1, len(model.sources)):
            reach.append(max(kappa[level], growth[level - 1] * reach[-1]))
        return torch.tensor(reach, dtype=torch.float64)
    chains = _chain_factors(model, out_of_time) if bound == "chain" else [math.inf] * len(model.sources)
    no_head = [max(kappa[: level + 1]) for level in range(len(model.sources))]
    with_head = [min(a, b) for a, b in zip(_first_head_reach(model, growth, out_of_time), chains)]
    return torch.tensor([max(a, b) for a, b in zip(no_head, with_head)], dtype=torch.float64)


def _first_head_reach(model: FrozenModel, growth: list[float] | None = None, out_of_time=None) -> list[float]:
    """Pre-norm, ``W_j`` for j = 0..S: a bound on ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over the paths below a
    node at level j that take another head, ``max_{s < j} C_s Π_{s < m < j} G_m`` (the lowest head's
    sublayer s, :func:`_first_head_factors`), from ``W_0 = 0``, ``W_j = max(G_{j−1} W_{j−1}, C_{j−1})``."""
    growth = _branch_bounds(model).tolist() if growth is None else growth
    first = _first_head_factors(model, out_of_time)
    with_head = [0.0]
    for level in range(1, len(model.sources)):
        with_head.append(max(growth[level - 1] * with_head[-1], first[level - 1]))
    return with_head


def _source_head_factors(model: FrozenModel, index: int) -> Tensor:
    """``κ'_{s,h} = max_{i ≤ s, t} ‖(K_i U_h)_t‖₂`` per head ``[H]`` of attention sublayer s = ``index``,
    ``U_h = C Γ W_V,h``: how far a source that meets the path's lowest head, h of s, reaches
    through that head's d_head values. Kept on the model: the first-head and chain bounds both ask
    for every sublayer's (at the GPT-2-small shape with transcoders, 37 sources: most of the set-up)."""
    kept = model.__dict__.setdefault("_source_head_factors", {})
    if index not in kept:
        values = model.sublayers[index].norm_values  # [H, d, d_head]
        sources = torch.stack(model.sources[: index + 1])  # [I, n, d]
        kept[index] = _norm(torch.einsum("ind,hde->ihne", sources, values)).amax(dim=(0, 2))
    return kept[index]


def _first_head_factors(model: FrozenModel, out_of_time=None) -> list[float]:
    """Pre-norm, per sublayer s: ``C_s = max_{h, i ≤ s} ‖A_h D‖_∞ κ'_{i,h} σ_max(W_O,h)`` for an
    attention sublayer (0 for an MLP), with ``κ'_{i,h} = max_t ‖(K_i C Γ W_V,h)_t‖₂``. A path whose
    lowest head is h of sublayer s, from source i, then contributes ``Σ_t (ρᵀ A_h D)_t ·
    (K_i C Γ W_V,h)_t · (W_O,h φ)`` ≤ ``‖ρ‖₁ ‖A_h D‖_∞ κ'_{i,h} σ_max(W_O,h) ‖φ‖₂`` for the ρ, φ
    just above it: the source's rows meet φ only through the head's d_head values, where the
    plain ``κ_i σ_max(F_h)`` pairs them at full width."""
    factors = []
    for index, sublayer in enumerate(model.sublayers):
        if not sublayer.branches:  # an MLP, or a replaced MLP with no feature open here
            factors.append(0.0)
            continue
        _stop_if(out_of_time)
        output_norm = _spectral_norm(sublayer.w_o)  # [H]
        factors.append(float((_token_norms(sublayer) * _source_head_factors(model, index) * output_norm).max()))
    return factors


def _pair_norms(outputs: Tensor, inputs: Tensor) -> Tensor:
    """``σ(V_g U_h)`` ``[H, G]`` for the lower sublayer's output maps ``V [G, e, d]`` and the upper's
    input maps ``U [H, d, f]``: the spectral norm of each ``e × f`` product, which is the plain norm
    of a vector where either side has rank one (a transcoder's features: every pair of thousands of
    steps at the cost of one product)."""
    product = torch.einsum("ged,hdf->hgef", outputs, inputs)
    if product.shape[-1] == 1 or product.shape[-2] == 1:
        return _norm(product.flatten(-2))
    return _spectral_norm(product)


def _chain_factors(model: FrozenModel, out_of_time=None) -> list[float]:
    """Pre-norm, per level j: a bound on ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over the paths below a node at
    level j that take at least one more head, from the chain of those heads as a whole.

    With ``F_h = U_h V_h`` (``U = C Γ W_V`` ``d × d_head``, ``V = W_O``), a path through heads
    ``t`` (top) … ``b`` (lowest) from source i has ``attr = rᵀ K_i U_b (V_b U_·) ⋯ (V_· U_t) (V_t φ)``
    with ``‖r‖₁ ≤ ‖ρ‖₁ Π ‖T‖_∞``, so ``|attr| ≤ ‖ρ‖₁ ‖φ‖₂ σ(V_t) · Q_t``, where, over the chains
    that start at head g of sublayer s,
    ``Q_{s,g} = ‖T_{s,g}‖_∞ max(κ'_{s,g}, max_{s' < s, g'} σ(V_{s',g'} U_{s,g}) Q_{s',g'})``
    (:func:`_source_head_factors` for κ'). Consecutive heads meet through the ``d_head × d_head``
    product of one's output and the next one's input map, which is far below the product of
    their spectral norms when the heads' subspaces are not aligned. Where either side is a replaced
    MLP's sublayer of thousands of rank-one steps, the pair is bounded by ``σ(V_g) σ(U_h)`` instead
    (Cauchy–Schwarz), so that its maximum over g is one number per lower sublayer, not a product
    per pair of steps."""
    chain: dict[int, Tensor] = {}  # Q per attention sublayer [H], bottom up
    output_norms: dict[int, Tensor] = {}  # σ(V_g) per sublayer [H]
    for index, sublayer in enumerate(model.sublayers):
        if not sublayer.branches:
            continue
        _stop_if(out_of_time)
        best = _source_head_factors(model, index)
        into = sublayer.norm_values  # U of this sublayer's heads [H, d, e]
        input_norms = None
        for lower, q in chain.items():
            below = model.sublayers[lower]
            if below.branch_ids is None and sublayer.branch_ids is None:
                pair = _pair_norms(below.w_o, into)
                best = torch.maximum(best, (pair * q[None, :]).amax(1))  # [H upper, H lower] → [H upper]
                continue
            input_norms = _spectral_norm(into) if input_norms is None else input_norms
            best = torch.maximum(best, float((output_norms[lower] * q).max()) * input_norms)
        chain[index] = _token_norms(sublayer) * best
        output_norms[index] = _spectral_norm(sublayer.w_o)
    starts = {index: float((output_norms[index] * q).max()) for index, q in chain.items()}  # σ(V_t) Q_t, best t
    levels = range(len(model.sources))
    return [max([start for index, start in starts.items() if index < level], default=0.0) for level in levels]


_CACHE_BYTES = 1 << 29  # the node bound's maps per head (source and pair maps) kept between steps
_CHILDREN = 1 << 16  # children made at once by the search over head sequences


class _OutOfTime(Exception):
    """The time limit passed while a bound was set up."""


def _stop_if(out_of_time) -> None:
    """:class:`_OutOfTime` where ``out_of_time`` (None: no limit) returns true."""
    if out_of_time is not None and out_of_time():
        raise _OutOfTime


class _NodeBounds:
    """Pre-norm: the bound per node (``bound="node"``; docs/DESIGN.md, "The top paths, certified"),
    set up once per model. Its nodes are head sequences: a node has taken heads down to its last,
    head h of attention sublayer a (a = 0..A−1 bottom up; its basis is ``a·H + h``), and holds ``ρ``
    ``[n]`` and ``z = V_{a,h} ⋯ v`` ``[d_head]``: its φ is ``U_{a,h} z``, as a skip is the identity.
    Every path below it either takes no further head (a tail: from source i ≤ its level, value
    ``ρᵀ (K_i U_{a,h}) z``, computed exactly) or takes a next head ``c = (a', g)``, a' < a, and then
    continues, with

        |attr| ≤ (|ρ|ᵀ Q_c) ‖V_c U_{a,h} z‖₂,
        Q_c[u] = Σ_v T_c[u, v] max(κ'_c[v], max_{c' below c} σ(V_{c'} U_c) Q_{c'}[v]),
        κ'_c[v] = max_{i ≤ s(c)} ‖(K_i U_c)_v‖₂,

    ``U = C Γ W_V``, ``V = W_O``, ``T = A D`` (entrywise ≥ 0). :meth:`remaining` is the largest over c,
    and at most the first-head bound ``‖ρ‖₁ ‖φ‖₂ W`` (:func:`_first_head_reach`)."""

    def __init__(self, model: FrozenModel, cache_bytes: int = _CACHE_BYTES, out_of_time=None, where: str = _WHERE):
        self.model = model
        self.index = [index for index, sublayer in enumerate(model.sublayers) if sublayer.attn is not None]
        self.heads = model.num_heads
        self.head_dim = model.sublayers[self.index[0]].w_v.shape[-1]
        self._check_fits(cache_bytes, where)
        self.sources = torch.stack(model.sources)  # [S + 1, n, d]
        self.values = [model.sublayers[index].norm_values for index in self.index]  # U [H, d, e]
        self.outputs = torch.cat([model.sublayers[index].w_o for index in self.index])  # V [A·H, e, d]
        # T [H, n, n] per attention sublayer: the sublayers' own, not a copy of them all (A·H·n² float64,
        # 4.3 GB at the Llama-3.2-1B shape and 1,024 tokens).
        self.token_maps = [model.sublayers[index].token_maps for index in self.index]
        # ‖U z‖₂ as √(zᵀ UᵀU z), U and z scaled by powers of two to a largest entry in [1, 2) (:func:`_unit`):
        # the Gram matrix of the scaled U [H, e, e], and the scale per head [H].
        self.value_units = [_unit(u, (-2, -1)) for u in self.values]
        self.grams = [(u / unit).mT @ (u / unit) for u, unit in zip(self.values, self.value_units)]
        self._cache = TensorCache(cache_bytes)
        first = _first_head_reach(model)
        self.reach = [first[index] for index in self.index]  # W at the level of each attention sublayer
        self.chains = self._chains(out_of_time)
        self.below = [torch.cat(self.chains[:a]).T.contiguous() if a else None for a in range(len(self.chains))]

    @staticmethod
    def set_up_bytes(model: FrozenModel, cache_bytes: int = _CACHE_BYTES) -> int:
        """The memory the set-up takes beyond ``model``: the token maps not made yet (``H·n²``
        float64 per attention sublayer), the sources, the output and value maps and their Gram
        matrices, the cache, and the largest source maps made at once."""
        sublayers = [sublayer for sublayer in model.sublayers if sublayer.attn is not None]
        tokens, d = model.sources[0].shape
        heads, head_dim = model.num_heads, sublayers[0].w_v.shape[-1]
        maps = sum(s.attn.numel() for s in sublayers if "token_maps" not in s.__dict__)
        head_maps = sum(s.w_o.numel() for s in sublayers)  # A·H·e·d: the outputs, and the values' as many
        sources = len(model.sources) * tokens * d
        largest = len(model.sources) * heads * tokens * head_dim  # one sublayer's source maps
        return 8 * (maps + sources + 2 * head_maps + 2 * largest) + cache_bytes

    def _check_fits(self, cache_bytes: int, where: str) -> None:
        """Refuse by name, before the set-up, what the free memory cannot hold (:meth:`set_up_bytes`)."""
        model = self.model
        tokens = model.sources[0].shape[0]
        check_fits(
            self.set_up_bytes(model, cache_bytes),
            model.sources[0].device,
            where,
            f"the bound per node's set-up ({len(self.index)} attention sublayers × {self.heads} heads on {tokens} "
            "tokens: the heads' token maps, H·n² float64 each, the source maps and its cache) needs about",
            'pass bound="plain" (set up per sublayer), fewer tokens, or free memory',
            error=MemoryError,
        )

    def _chains(self, out_of_time=None) -> list[Tensor]:
        """``Q`` per attention sublayer ``[H, n]``, bottom up (:class:`_OutOfTime` when
        ``out_of_time()`` turns true between two sublayers)."""
        chains: list[Tensor] = []
        n, heads, e = self.sources.shape[1], self.heads, self.head_dim
        for a, index in enumerate(self.index):
            _stop_if(out_of_time)
            best = _norm(self.source_maps(a).view(heads, n, index + 1, e)).amax(-1)  # κ' [H, n]
            if a:
                pair = torch.stack(  # σ(V_c' U_c) [H, a·H]
                    [_spectral_norm(self.pair_map(a, h).view(e, a * heads, e).transpose(0, 1)) for h in range(heads)]
                )
                best = torch.maximum(best, (pair[:, :, None] * torch.cat(chains)[None]).amax(1))
            chains.append(torch.einsum("huv,hv->hu", self.token_maps[a], best))
        return chains

    def source_maps(self, a: int) -> Tensor:
        """``K_i U_{a,h}`` for the sources i ≤ the sublayer's index, ``[H, n, (i, d_head)]``."""
        index = self.index[a]

        def compute():
            maps = torch.einsum("ind,hde->hnie", self.sources[: index + 1], self.values[a])
            return maps.reshape(self.heads, self.sources.shape[1], -1).contiguous()

        return self._cache.get(("sources", a), compute)

    def pair_map(self, a: int, head: int) -> Tensor:
        """``(V_c U_{a,h})ᵀ`` for every head c below sublayer a, ``[d_head, (c, d_head)]``: a node's
        ``z`` times it is the ``z`` of each of its children."""

        def compute():
            below = self.outputs[: a * self.heads]  # [a·H, e, d]
            return torch.einsum("de,cfd->ecf", self.values[a][head], below).reshape(self.head_dim, -1).contiguous()

        return self._cache.get(("pairs", a, head), compute)

    def child_features(self, a: int, head: int, z: Tensor) -> Tensor:
        """Every child's ``z = V_c U_{a,h} z`` ``[N, a·H, d_head]``, heads below in basis order: by the pair
        maps where d_head or more nodes share them, else through φ = U z in d coordinates."""
        if z.shape[0] >= self.head_dim or ("pairs", a, head) in self._cache:
            children = z @ self.pair_map(a, head)
        else:
            phi = z @ self.values[a][head].T  # [N, d]
            children = phi @ self.outputs[: a * self.heads].flatten(0, 1).T
        return children.view(z.shape[0], a * self.heads, self.head_dim)

    def tails(self, a: int, head: int, rho: Tensor, z: Tensor) -> Tensor:
        """The attributions ``ρᵀ K_i U z`` of the paths that take no head below the nodes ``[N, i]``."""
        return ((rho @ self.source_maps(a)[head]).view(rho.shape[0], -1, self.head_dim) * z[:, None, :]).sum(-1)

    def through(self, rho: Tensor, count: int) -> Tensor:
        """``ρ T_c`` for ρ ``[N, n]`` and every head c of the lowest ``count`` attention sublayers:
        ``[N, count·H, n]``, heads in basis order."""
        # A batched GEMM over the maps as they are held (an einsum copies them, H·n² per call, first).
        return torch.cat([torch.matmul(rho, maps).transpose(0, 1) for maps in self.token_maps[:count]], dim=1)

    def children(self, a: int, head: int, rho: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        """Every child's ``ρ`` ``[N, a·H, n]`` and ``z`` ``[N, a·H, d_head]``, heads below in basis order."""
        return self.through(rho, a), self.child_features(a, head, z)

    def remaining(self, a: int, head: int, rho: Tensor, z: Tensor) -> Tensor:
        """A bound on ``|attr|`` over the paths below the nodes that take another head ``[N]``."""
        if a == 0:
            return torch.full((rho.shape[0],), -math.inf, dtype=torch.float64, device=rho.device)
        outputs = _norm(self.child_features(a, head, z))  # ‖V_c φ‖₂ [N, a·H]
        node = (outputs * (rho.abs() @ self.below[a])).amax(-1)
        unit = _unit(z, -1)
        scaled = z / unit
        phi_norm = torch.einsum("Ne,ef,Nf->N", scaled, self.grams[a][head], scaled).clamp_min(0).sqrt()  # ‖U z‖₂
        phi_norm = phi_norm * unit[:, 0] * self.value_units[a][head, 0, 0]
        return _safe_bounds(
            torch.fmin(node, rho.abs().sum(-1) * phi_norm * self.reach[a])
        )  # fmin: a NaN side is no bound


@renamed(_WHERE, k="top_k")
def top_paths(
    stack,
    readout: Readout | Tensor,
    top_k: int = 20,
    *,
    position: int | None = None,
    batch: int | list[int] = 0,
    largest: bool = True,
    max_length: int | None = None,
    time_limit: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    batch_nodes: int = 4096,
    record: bool = False,
    bound: str = "auto",
    progress: bool = False,
) -> TopPaths:
    """The exact ``top_k`` largest (or smallest) path attributions of one readout at one token, found
    by a best-first search over the readout trie with a certificate (module docstring).

    Args:
        stack: a captured stack (:func:`pathkernels.adapters.capture_huggingface_residual`).
        readout: one direction: :func:`pathkernels.logit_diff`, :func:`pathkernels.logit`, a
            :class:`Readout` of one row or a vector ``[d]``.
        top_k: how many paths (``k=``, its old name, is taken with a FutureWarning).
        position: the token read out (default: the last real token; for a classifier's class logits,
            the token its score head reads); ``batch``: the element, or a list of elements: then the
            paths of their mean (each element read at ``position``, or at its own last real token),
            searched over :func:`~pathkernels.analysis.readout_trie.block_diagonal_model`.
        largest: the largest attributions, or the smallest (the largest of the negated readout).
        max_length: only paths through at most this many heads.
        time_limit: seconds; at the limit the best list so far comes back with its gap.
        memory_budget: bytes for the frontier of unexpanded nodes; reaching it also stops.
        batch_nodes: nodes expanded per step (the ones of largest bound), on the capture's device
            (the level kinds: one readout-engine call per level among them).
        record: keep every visited path and its attribution (for checking the certificate).
        bound: which bound prunes (docs/DESIGN.md, "The top paths, certified"): ``"node"``
            (pre-norm models are searched over head sequences, each node's paths that take no
            further head computed at once and the rest bounded from the node's own ``ρ`` and ``φ``
            through per-token chains of head pairs, :class:`_NodeBounds`), ``"chain"`` (a bound per
            level: consecutive heads paired and the source folded into the lowest), ``"first_head"``
            (the source folded, the rest per-sublayer maxima) or ``"plain"`` (the product of
            per-sublayer maxima); post-norm models use ``"plain"`` in every case. ``"auto"`` (the
            default): ``"node"`` where its set-up, a product per pair of heads, is small for the
            device (GPT-2 small's and Llama-3.2-1B's are; GPT-2-XL's and Gemma-2-2B's are not on a
            CPU), else ``"plain"``; with transcoders ``"chain"``. The result's ``bound_kind`` says which.
        progress: report the paths visited, the frontier, the largest open bound and the k-th value.

    Returns:
        :class:`TopPaths`: the paths, their values, and the certificate (``bound``,
        ``certified``, ``gap``) with how much of the tree was visited.
    """
    start = time.monotonic()
    options = SearchOptions.checked(
        _WHERE, top_k, largest, time_limit, memory_budget, batch_nodes, record, bound, progress, start
    )
    if position is not None and (isinstance(position, bool) or not isinstance(position, numbers.Integral)):
        raise TypeError(
            f"{_WHERE}: expected position to be one token position (an int) or None, got {type(position).__name__} "
            f"{position!r}; for several positions call top_paths once per position"
        )
    batch = listed(batch)
    if isinstance(batch, (list, tuple)):  # the mean of these elements, each read at its own token
        if not batch:
            raise ValueError(f"{_WHERE}: expected batch to be an element or a non-empty list of them, got []")
        setups = [read_out(stack, readout, position, b, max_length, _WHERE, in_batch=True) for b in batch]
        setup = mean_read_out(setups, _WHERE)
    else:
        setup = read_out(stack, readout, position, batch, max_length, _WHERE)
    if len(setup.readout.labels) != 1:
        raise ValueError(f"{_WHERE}: expected one readout direction, got {len(setup.readout.labels)}")
    return named(search_top_paths(setup, options), stack)


@dataclass(frozen=True)
class SearchOptions:
    """The checked options of a best-first search (:func:`top_paths`' arguments of the same names)."""

    k: int
    largest: bool
    time_limit: float | None
    memory_budget: int
    batch_nodes: int
    record: bool
    bound: str
    progress: bool
    start: float  # time.monotonic() when the call began: the time limit counts from it

    @staticmethod
    def checked(where, k, largest, time_limit, memory_budget, batch_nodes, record, bound, progress, start):
        """The options, each refused in ``where``'s name where it is not what the search takes."""
        k = check_int(k, "top_k", where, minimum=1)
        batch_nodes = check_int(batch_nodes, "batch_nodes", where, minimum=1)
        memory_budget = check_int(memory_budget, "memory_budget", where, minimum=1)
        if time_limit is not None and (
            isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real) or not time_limit > 0
        ):
            raise ValueError(
                f"{where}: expected time_limit to be a positive number of seconds or None, got {time_limit!r}"
            )
        if bound not in _BOUNDS:
            raise ValueError(f"{where}: expected bound in {_BOUNDS}, got {bound!r}")
        largest, record, progress = (
            check_flag(value, name, where)
            for name, value in (("largest", largest), ("record", record), ("progress", progress))
        )
        return SearchOptions(k, largest, time_limit, memory_budget, batch_nodes, record, bound, progress, start)


def search_top_paths(setup, options: SearchOptions) -> TopPaths:
    """:func:`top_paths` of a checked readout of one direction at one token
    (:class:`~pathkernels.analysis.attribution.CheckedReadout`: its frozen model may be the part of
    a model below a layer, as :func:`pathkernels.score_top_paths` reads it)."""
    k, largest, record, bound = options.k, options.largest, options.record, options.bound
    # The search runs on ρ and φ scaled by powers of two (exactly) to a largest entry in [1, 2): every
    # attribution and bound is bilinear in them, so values and bounds scale back exactly, and the
    # bounds' squares stay in range whatever the readout's scale (1e-300 made them 0, pruning the
    # true top paths).
    shift = _exponent(setup.rho[0, :1]) + _exponent(setup.phi[0, :1])
    setup = dataclasses.replace(
        setup,
        rho=_times_power_of_two(setup.rho, -_exponent(setup.rho[0, :1])),
        phi=_times_power_of_two(setup.phi, -_exponent(setup.phi[0, :1])),
    )
    model, layers = setup.model, setup.model.layers
    sign = 1.0 if largest else -1.0
    total = sum(model.path_counts(setup.max_length))
    bar = progress_bar(total, enabled=options.progress, unit="path", desc=_WHERE)
    # The k largest of the (signed) attributions found, and with record every visited path.
    fold = Fold(len(model.sources), layers, 1, 1, k, keep=record, bottom=False)
    search = _Search(
        setup, sign, fold, k, options.start, options.time_limit, options.memory_budget, options.batch_nodes, bar
    )
    bound = _chosen_bound(model, bound)
    if bound == "node":
        pruned, frontier, visited, expanded, stopped = _search_heads(search)
    else:
        try:
            pruned, frontier, visited, expanded, stopped = _search_levels(
                search, _reach_bounds(model, bound, search.out_of_time)
            )
        except _OutOfTime:  # the set-up outlasted the time limit: no path visited, no bound
            pruned, frontier, visited, expanded, stopped = -math.inf, math.inf, 0, 0, "time_limit"
    kth = _kth(fold, k)
    # Pruned nodes were at most the k-th value when dropped, and it only grows.
    remaining = max(pruned, frontier)
    certified = remaining <= kth
    recorded = None
    if record:
        nothing = (
            torch.zeros(0, layers, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, 1, 1, dtype=torch.float64),
        )
        paths, sources, values = (torch.cat(parts) for parts in zip(nothing, *fold.kept))  # none: stopped at once
        recorded = (paths, sources, _times_power_of_two(sign * values[:, 0, 0], shift))
    if bar is not None:
        bar.close()
    return TopPaths(
        values=_times_power_of_two(sign * fold.best[0][:, 0, 0], shift),
        paths=fold.best[1][:, 0, 0],
        sources=fold.best[2][:, 0, 0],
        source_names=model.source_names,
        label=("" if largest else "−") + setup.readout.labels[0],
        position=setup.read_at or setup.positions[0],
        largest=largest,
        bound=_times_power_of_two(max(remaining, 0.0), shift),  # −inf: no path was left; inf: no bound in time
        certified=bool(certified),
        gap=0.0 if certified else _times_power_of_two(max(0.0, remaining - kth), shift),
        visited=visited,
        expanded=expanded,
        total=total,
        seconds=time.monotonic() - options.start,
        stopped=stopped,
        recorded=recorded,
        replaced=model.replaced,
        bound_kind=bound,
    )


def _chosen_bound(model: FrozenModel, bound: str) -> str:
    """The bound a search over ``model`` runs: post-norm models take ``"plain"`` for ``"node"``
    and ``"auto"``, models with transcoders ``"chain"``; pre-norm models without, for ``"auto"``,
    ``"node"`` where its set-up is within :data:`_NODE_SET_UP` of the device and the memory free
    holds it (:meth:`_NodeBounds.set_up_bytes`), else ``"plain"``."""
    if bound not in ("auto", "node"):
        return bound
    if not model.pre_norm:
        return "plain"
    if model.replaced is not None:
        return "chain"
    if bound == "node":
        return bound
    attention = [sublayer for sublayer in model.sublayers if sublayer.attn is not None]
    head_columns = sum(sublayer.w_o.shape[0] * sublayer.w_o.shape[1] for sublayer in attention)  # Σ H·d_head
    set_up = head_columns**2 * model.sources[0].shape[-1] / 2
    device = model.sources[0].device
    if set_up > _NODE_SET_UP.get(device.type, _NODE_SET_UP["cpu"]):
        return "plain"
    free = _memory.available_memory(device)
    return "node" if free is None or _NodeBounds.set_up_bytes(model) <= free else "plain"


@dataclass
class _Search:
    """What both searches share: the checked readout, the sign (−1 for the smallest), the fold,
    and the limits."""

    setup: object  # CheckedReadout
    sign: float
    fold: Fold
    k: int
    start: float
    time_limit: float | None
    memory_budget: int
    batch_nodes: int
    bar: object

    def out_of_time(self) -> bool:
        return self.time_limit is not None and time.monotonic() - self.start > self.time_limit

    def report(self, paths: int, frontier: Tensor, kth: float) -> None:
        if self.bar is not None:
            self.bar.update(paths)
            open_bound = float(frontier.max()) if frontier.numel() else 0.0
            self.bar.set_postfix_str(f"frontier {frontier.numel():,}, open bound {open_bound:.3g}, k-th {kth:.3g}")


def _search_levels(search: _Search, reach: Tensor) -> tuple[float, float, int, int, str]:
    """The search over the readout trie, sublayer by sublayer, with the bound per level ``reach``
    (``M_j``, :func:`_reach_bounds`): ``(largest pruned bound, largest open bound, paths visited,
    nodes expanded, why it stopped)``."""
    setup, fold, k = search.setup, search.fold, search.k
    model, layers = setup.model, setup.model.layers
    walker = Walker(model, low_rank=False)  # the frontier mixes nodes below many heads: φ in d coordinates
    # The frontier: unexpanded nodes, each at a level (the source it meets next).
    rho, phi = setup.rho[:, :1], search.sign * setup.phi
    device = rho.device  # the capture's: the frontier lives there, the fold on the CPU
    reach = reach.to(device)
    level = torch.full((1,), len(model.sublayers), dtype=torch.long, device=device)
    choices = torch.full((1, layers), -1, dtype=torch.long, device=device)
    lengths = torch.zeros(1, dtype=torch.long, device=device)
    node_bytes = 8 * (rho.shape[-1] + phi.shape[-1] + layers + 3)
    frontier = _Frontier([rho, phi, level, choices, lengths, _bounds(rho, phi, reach, level)])
    frontier.most = max(1, search.memory_budget // node_bytes)  # its buffers grow to the budget, not past it
    pruned, visited, expanded = -math.inf, 0, 0
    # A node's children through its heads are made at once, with their temporaries (about four times
    # their size): as many nodes a batch as fit a quarter of the budget that way. A replaced MLP's
    # steps (thousands) are bounded before they are made (_step_children), in sub-batches of nodes
    # whose bounds and children, were every one to survive, fit the same quarter.
    heads = max((s.branches for s in model.sublayers if s.branch_ids is None), default=0) + 1
    batch_nodes = max(1, min(search.batch_nodes, search.memory_budget // (16 * node_bytes * heads)))
    stopped = "certified"
    while frontier.live:
        kth = _kth(fold, k)
        pruned = max(pruned, frontier.prune(kth))  # nodes whose every path is below the k-th value
        if not frontier.live:
            break
        if search.out_of_time():
            stopped = "time_limit"
            break
        if frontier.size * node_bytes > search.memory_budget:
            frontier.compact()
        if frontier.live * node_bytes > search.memory_budget:
            stopped = "memory_budget"
            break
        picked = frontier.take(min(batch_nodes, frontier.live))
        expanded += picked[0].shape[0]
        new = []
        for at in picked[2].unique().tolist():
            group = picked[2] == at
            g_rho, g_phi, g_choices, g_lengths = picked[0][group], picked[1][group], picked[3][group], picked[4][group]
            values = walker.values(at, g_rho, g_phi, [(g_rho.shape[0], None)])
            visited += values.shape[0]
            if search.bar is not None:
                search.report(values.shape[0], frontier.bounds[frontier.bounds > -math.inf], kth)
            fold.add(at, values, g_choices, g_lengths)
            if at == 0:
                continue
            runs = [(g_rho.shape[0], None)]
            sublayer = model.sublayers[at - 1]
            if sublayer.branch_ids is not None and sublayer.pre:  # a replaced MLP's steps, thousands of them
                children = []
                size = max(1, search.memory_budget // (16 * node_bytes * (sublayer.branches + 1)))
                for first in range(0, g_rho.shape[0], size):
                    part = slice(first, first + size)
                    step = (g_rho[part], g_phi[part], g_choices[part], g_lengths[part], setup.max_length)
                    made, dropped = _step_children(sublayer, at - 1, *step, reach, _kth(fold, k))
                    children += made
                    pruned = max(pruned, dropped)
            else:  # (Walker.children's last item, the runs, is None here: bounds made below)
                children = [
                    (*part, None) for *part, _ in walker.children(at, g_rho, g_phi, g_choices, g_lengths, runs,
                                                                  setup.max_length)
                ]  # fmt: skip
            for child_level, *part, made_bound in children:  # (a step's children come with their bounds)
                if isinstance(child_level, int):
                    child_level = torch.full((part[0].shape[0],), child_level, dtype=torch.long, device=device)
                if made_bound is None:
                    made_bound = _bounds(part[0], part[1], reach, child_level)
                new.append((*part[:2], child_level, *part[2:], made_bound))
        if new:
            grown = [torch.cat(p) for p in zip(*new)]
            kth = _kth(fold, k)
            alive = grown[-1] > kth  # children whose every path is below the k-th value: pruned at once
            if not bool(alive.all()):
                pruned = max(pruned, float(grown[-1][~alive].max()))
                grown = [t[alive] for t in grown]
            frontier.add(grown)
    return pruned, frontier.largest(), visited, expanded, stopped


class _Frontier:
    """The unexpanded nodes of :func:`_search_levels`, as parts ``rho [M, 1, n]``, ``phi [M, 1, d]``,
    ``level [M]``, ``choices [M, L]``, ``lengths [M]`` and ``bounds [M]``: the first ``size`` rows of
    buffers that grow by half. A node taken or pruned is marked dead (its bound −inf: a live node's
    bound is at least 0) and the dead rows are dropped only when they are half of those held, so that
    a step costs about what it takes and adds, not a copy of the whole frontier."""

    def __init__(self, parts: list[Tensor]):
        self.parts = parts
        self.size = self.live = parts[0].shape[0]
        self.most = math.inf  # the rows the buffers grow to by half at most (more only for one step's nodes)

    @property
    def bounds(self) -> Tensor:
        """The bounds of the rows held ``[size]`` (−inf where dead)."""
        return self.parts[-1][: self.size]

    def largest(self) -> float:
        """The largest bound of a live node (−inf when none is left)."""
        return float(self.bounds.max()) if self.live else -math.inf

    def prune(self, kth: float) -> float:
        """Mark dead the live nodes whose bound is at most ``kth``; returns the largest of those bounds."""
        bounds = self.bounds
        dropped = (bounds <= kth) & (bounds > -math.inf)
        if not bool(dropped.any()):
            return -math.inf
        largest = float(bounds[dropped].max())
        bounds[dropped] = -math.inf
        self.live -= int(dropped.sum())
        return largest

    def take(self, count: int) -> list[Tensor]:
        """The ``count`` live nodes of largest bound (``count ≤ live``), as ``[rho, phi, level, choices,
        lengths]``, marked dead."""
        taken = torch.topk(self.bounds, count).indices
        picked = [part[taken] for part in self.parts[:-1]]
        self.bounds[taken] = -math.inf
        self.live -= count
        return picked

    def add(self, parts: list[Tensor]) -> None:
        """Append nodes (parts as the frontier's, their bounds last)."""
        if 2 * self.live <= self.size:
            self.compact()
        count = parts[0].shape[0]
        capacity = self.parts[0].shape[0]
        if self.size + count > capacity:
            capacity = int(max(self.size + count, min(capacity + capacity // 2, self.most)))
            self.parts = [
                torch.cat([buffer[: self.size], buffer.new_empty(capacity - self.size, *buffer.shape[1:])])
                for buffer in self.parts
            ]
        for buffer, part in zip(self.parts, parts):
            buffer[self.size : self.size + count] = part
        self.size += count
        self.live += count

    def compact(self) -> None:
        """Drop the dead rows (the live ones keep their order)."""
        if self.live < self.size:
            keep = self.bounds > -math.inf
            self.parts = [buffer[: self.size][keep] for buffer in self.parts]
            self.size = self.live


def _step_children(
    sublayer: Sublayer, below: int, rho, phi, choices, lengths, max_length: int, reach: Tensor, kth: float
):
    """The children of nodes ``rho [N, 1, n]``, ``phi [N, 1, d]`` through a replaced MLP's sublayer of
    rank-one steps (pre-norm; ``below`` its index, the level under it): the skip's, then only the
    steps whose child can still exceed ``kth``, each bounded before it is made: a step f's child is
    ``ρ ⊙ w_f`` and ``(φ · v_f) u_f`` (``w_f`` its diagonal token map, ``v_f`` and ``u_f`` its output
    and input maps), so its bound is ``‖ρ ⊙ w_f‖₁ |φ · v_f| ‖u_f‖ · M`` with ``M`` the reach of the
    level the step goes to (``reach [levels]``; a cross-layer step from an earlier layer goes below
    that layer's MLP), ``[N, F]`` at once without an ``[N, F, d]`` tensor. Returns ``(parts, largest
    bound dropped)``: each part ``(child levels, rho, phi, choices, lengths, bounds)``, the skip's
    level ``below`` and bounds None (the caller's to make)."""
    parts = [(below, rho, phi, choices, lengths, None)]
    grows = lengths < max_length
    if not bool(grows.any()):
        return parts, -math.inf
    rho, phi, choices, lengths = rho[grows], phi[grows], choices[grows], lengths[grows]
    weights = sublayer.token_maps.diagonal(dim1=-2, dim2=-1)  # [F, n]
    outputs = sublayer.w_o[:, 0, :]  # v_f [F, d] (the row form's F_in)
    inputs = sublayer.norm_values[:, :, 0]  # u_f [F, d] (its F_out)
    if getattr(sublayer, "_input_norms", None) is None:  # ‖u_f‖ and |w_f|ᵀ [n, F], once per sublayer
        sublayer._input_norms = _norm(inputs)
        sublayer._absolute_weights = weights.abs().T.contiguous()
        sublayer._levels = {}
    if below not in sublayer._levels:  # each step's level, per place of the sublayer (an edge's model starts
        runs = sublayer.branch_levels(below)  # higher up the same sublayers: its levels count from there)
        levels = [torch.full((stop - first,), level, dtype=torch.long) for first, stop, level in runs]
        sublayer._levels[below] = torch.cat([torch.zeros(0, dtype=torch.long), *levels]).to(rho.device)
    step_levels = sublayer._levels[below]
    along = phi[:, 0] @ outputs.T  # φ · v_f [N, F]
    step_reach = reach[step_levels]  # [F]
    bound = _safe_bounds(
        (rho[:, 0].abs() @ sublayer._absolute_weights) * along.abs() * sublayer._input_norms * step_reach
    )
    keep = bound > kth
    dropped = float(torch.where(keep, -math.inf, bound).max()) if bool((~keep).any()) else -math.inf
    node, step = keep.nonzero(as_tuple=True)
    if node.numel():
        child_rho = rho[node] * weights[step][:, None, :]
        child_phi = along[node, step][:, None, None] * inputs[step][:, None, :]
        child_choices = choices[node].clone()
        child_choices[:, sublayer.column] = sublayer.choice_values(choices.device)[step]
        levels = step_levels[step]
        parts.append((levels, child_rho, child_phi, child_choices, lengths[node] + 1, bound[node, step]))
    return parts, dropped


def _search_heads(search: _Search) -> tuple[float, float, int, int, str]:
    """Pre-norm: the search over head sequences with the bound per node (:class:`_NodeBounds`). A
    node is made with its tails (the paths below it that take no further head) visited at once, and
    its bound covers the rest; expanding it makes its children, one per head below its last. The
    root (no head yet) is expanded first. Returns as :func:`_search_levels`."""
    setup, fold, k = search.setup, search.fold, search.k
    model, layers, max_length = setup.model, setup.model.layers, setup.max_length
    rho0, phi0 = setup.rho[0, :1], search.sign * setup.phi[0, :1]  # [1, n], [1, d]
    device = rho0.device
    no_head = torch.full((1, layers), NO_HEAD, dtype=torch.long, device=device)
    direct = torch.einsum("Nu,iud,Nd->Ni", rho0, torch.stack(model.sources), phi0)  # the root's tails
    try:
        node = _NodeBounds(model, out_of_time=search.out_of_time)
    except _OutOfTime:  # the set-up outlasted the time limit: only the direct paths are known
        for source in range(direct.shape[1]):
            fold.add(source, direct[:, source, None, None], no_head, torch.zeros(1, dtype=torch.long, device=device))
        search.report(direct.numel(), direct[0, :0], _kth(fold, k))
        return -math.inf, math.inf, direct.numel(), 0, "time_limit"
    heads, head_dim = node.heads, node.head_dim
    layer_of = torch.tensor([model.sublayers[index].layer for index in node.index], device=device)
    counts = {"visited": 0, "pruned": -math.inf}
    pending: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # tails to fold: values, sources, choices, lengths

    def emit(tails: Tensor, choices: Tensor, lengths: Tensor) -> None:
        """Fold the tails ``[N, i]`` (the paths from sources 0..i−1): those that can still enter the
        top k, or all of them with ``record``."""
        counts["visited"] += tails.numel()
        kth = _kth(fold, k)
        if fold.kept is None and math.isfinite(kth):
            rows, sources = (tails >= kth).nonzero(as_tuple=True)
        else:
            rows, sources = (
                t.flatten()
                for t in torch.meshgrid(
                    torch.arange(tails.shape[0], device=device),
                    torch.arange(tails.shape[1], device=device),
                    indexing="ij",
                )
            )
        if rows.numel():
            pending.append((tails[rows, sources], sources, choices[rows], lengths[rows]))

    def flush() -> None:
        if not pending:
            return
        values, sources, choices, lengths = (torch.cat(p) for p in zip(*pending))
        pending.clear()
        for source in sources.unique().tolist():
            at = sources == source
            fold.add(source, values[at][:, None, None], choices[at], lengths[at])

    def make(basis: Tensor, rho: Tensor, z: Tensor, choices: Tensor, lengths: Tensor) -> list[Tensor]:
        """The nodes ``(basis [N], ρ, z, choices, lengths)``, sorted by basis: their tails folded, and
        those whose bound exceeds the k-th value as frontier parts ``[basis, ρ, z, choices,
        lengths, bound]``."""
        order = torch.argsort(basis, stable=True)
        basis, rho, z, choices, lengths = (t[order] for t in (basis, rho, z, choices, lengths))
        values, sizes = torch.unique_consecutive(basis, return_counts=True)
        bound = torch.empty(basis.shape[0], dtype=torch.float64, device=device)
        first = 0
        for value, size in zip(values.tolist(), sizes.tolist()):
            a, head, run = value // heads, value % heads, slice(first, first + size)
            emit(node.tails(a, head, rho[run], z[run]), choices[run], lengths[run])
            bound[run] = node.remaining(a, head, rho[run], z[run])
            first += size
        bound = torch.where(lengths < max_length, bound, -math.inf)  # no head left to take
        flush()
        alive = bound > _kth(fold, k)
        if not bool(alive.all()):
            counts["pruned"] = max(counts["pruned"], float(bound[~alive].max()))
        return [t[alive] for t in (basis, rho, z, choices, lengths, bound)]

    # The root: its tails (the direct paths from every source), then a child per head.
    emit(direct, no_head, torch.zeros(1, dtype=torch.long, device=device))
    flush()
    frontier = [torch.zeros(0, dtype=torch.long, device=device)] * 6
    expanded = 1
    if max_length > 0:
        count = len(node.index) * heads
        basis = torch.arange(count, device=device)
        rho = torch.cat([rho0[0] @ model.sublayers[index].token_maps for index in node.index])  # [A·H, n]
        z = torch.cat([phi0 @ model.sublayers[index].w_o.transpose(-1, -2) for index in node.index]).reshape(
            count, head_dim
        )
        choices = no_head.repeat(count, 1)
        choices[basis, layer_of[basis // heads]] = basis % heads
        frontier = make(basis, rho, z, choices, torch.ones(count, dtype=torch.long, device=device))
    node_bytes = 8 * (rho0.shape[-1] + head_dim + layers + 4)
    stopped = "certified"
    while frontier[0].numel():
        kth = _kth(fold, k)
        alive = frontier[5] > kth
        if not bool(alive.all()):  # nodes whose every path left is below the k-th value
            counts["pruned"] = max(counts["pruned"], float(frontier[5][~alive].max()))
            frontier = [t[alive] for t in frontier]
            if not frontier[0].numel():
                break
        if search.out_of_time():
            stopped = "time_limit"
            break
        if frontier[0].numel() * node_bytes > search.memory_budget:
            stopped = "memory_budget"
            break
        take = torch.topk(frontier[5], min(search.batch_nodes, frontier[5].numel())).indices
        keep = torch.ones_like(frontier[5], dtype=torch.bool)
        keep[take] = False
        picked = [t[take] for t in frontier[:5]]
        frontier = [t[keep] for t in frontier]
        expanded += take.numel()
        visited_before = counts["visited"]
        # Expand the picked nodes by basis; make the children about _CHILDREN at a time.
        order = torch.argsort(picked[0], stable=True)
        picked = [t[order] for t in picked]
        values, sizes = torch.unique_consecutive(picked[0], return_counts=True)
        first, made, waiting, held = 0, [], [], 0
        for value, size in zip(values.tolist(), sizes.tolist()):
            a, head = value // heads, value % heads
            step = max(1, _CHILDREN // max(1, a * heads))
            for chunk in range(first, first + size, step):
                run = slice(chunk, min(chunk + step, first + size))
                rho, z = node.children(a, head, picked[1][run], picked[2][run])  # [N, a·H, ·]
                parents, children = rho.shape[0], a * heads
                basis = torch.arange(children, device=device).repeat(parents)
                choices = picked[3][run].repeat_interleave(children, 0)
                choices[torch.arange(basis.shape[0], device=device), layer_of[basis // heads]] = basis % heads
                lengths = picked[4][run].repeat_interleave(children) + 1
                waiting.append((basis, rho.flatten(0, 1), z.flatten(0, 1), choices, lengths))
                held += basis.shape[0]
                if held >= _CHILDREN:
                    made.append(make(*(torch.cat(part) for part in zip(*waiting))))
                    waiting, held = [], 0
            first += size
        if waiting:
            made.append(make(*(torch.cat(part) for part in zip(*waiting))))
        if made:
            frontier = [torch.cat([t, *parts]) for t, *parts in zip(frontier, *made)]
        search.report(counts["visited"] - visited_before, frontier[5], _kth(fold, k))
    frontier_bound = float(frontier[5].max()) if frontier[5].numel() else -math.inf
    return counts["pruned"], frontier_bound, counts["visited"], expanded, stopped


def _bounds(rho: Tensor, phi: Tensor, reach: Tensor, level: Tensor) -> Tensor:
    """``‖ρ‖₁ ‖φ‖₂ M_level`` per node (one position, one readout)."""
    return _safe_bounds(rho[:, 0].abs().sum(-1) * _norm(phi[:, 0]) * reach[level])


def _kth(fold: Fold, k: int) -> float:
    """The k-th largest attribution found, or −inf while fewer than k paths have been visited."""
    values = fold.best[0]
    return float(values[k - 1, 0, 0]) if values.shape[0] == k else -math.inf
