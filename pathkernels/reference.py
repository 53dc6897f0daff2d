"""Pure-PyTorch references of every op (``<op>_ref``): slow, obvious, float64-capable.

They compute in the dtype they are given; tests pass float64 copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def residual_ref(x: Tensor) -> Tensor:
    """``x − 1·μᵀ`` with μ the mean over the rows: ``[..., n, m] -> [..., n, m]``."""
    return x - x.mean(dim=-2, keepdim=True)


def matrix_norms_ref(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖x‖_1, ‖x‖_∞, ‖x‖_{1,∞})`` from the abs sums: ``[..., n, m] -> 3 × [...]``.

    ``‖x‖_1`` is the largest column abs sum, ``‖x‖_∞`` the largest row abs sum (0 for m = 0)."""
    if x.shape[-1] == 0:
        zero = x.new_zeros(x.shape[:-2])
        return zero, zero, zero
    a = x.abs()
    l1 = a.sum(-2).amax(-1)
    linf = a.sum(-1).amax(-1)
    return l1, linf, torch.sqrt(l1 * linf)


def composite_norm_ref(x: Tensor) -> Tensor:
    return matrix_norms_ref(x)[2]


def residual_norm_ref(x: Tensor) -> Tensor:
    return composite_norm_ref(residual_ref(x))


def fused_leaf_norms_ref(
    attn: Tensor, right: Tensor, mean: Tensor, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``_fused_leaf_norms`` in float64 on the CPU: per leaf k, with ``R_k = scale_k C(A) right_k``
    (attn ``[n, n]``, right ``[n, c, m]``, mean ``[c, m]``, scale ``[c]``), ``‖R_k‖_{1,∞}`` and
    ``‖1 mean_kᵀ + R_k‖_{1,∞}``, each ``[c]``."""
    leaves = torch.einsum("ik,kcj->cij", attn.double().cpu(), right.double().cpu())
    if scale is not None:
        leaves = leaves * scale.double().cpu()[:, None, None]
    return composite_norm_ref(leaves), composite_norm_ref(leaves + mean.double().cpu()[:, None, :])


def path_products_ref(
    attn: Tensor, paths: Tensor, x: Tensor | None = None, w_v: Tensor | None = None, w_o: Tensor | None = None
) -> Tensor:
    """The per-path loop: ``P_p = A[L, p_L] ⋯ A[1, p_1]`` (or ``Y_p = P_p X W_p``) for every path.

    attn ``[B, L, H, n, n]``, paths ``[M, L]`` (-1 = skip), x ``[B, n, d]``, w_v ``[L, H, d, d_head]``,
    w_o ``[L, H, d_head, d]`` -> ``[B, M, n, n]`` (or ``[B, M, n, d]``).
    """
    from pathkernels.core.paths import check_paths

    paths, _ = check_paths(
        paths, "pathkernels.reference.path_products_ref", num_heads=attn.shape[2], num_layers=attn.shape[1]
    )
    batch, n = attn.shape[0], attn.shape[-1]
    out = []
    for path in paths.tolist():
        m = torch.eye(n, dtype=attn.dtype).expand(batch, n, n) if x is None else x
        for layer, head in enumerate(path):
            if head >= 0:
                m = attn[:, layer, head] @ m
                if x is not None:
                    m = m @ w_v[layer, head] @ w_o[layer, head]
        out.append(m)
    return torch.stack(out, dim=1)


def attention_network_ref(
    attn: Tensor, x: Tensor, w_v: Tensor, w_o: Tensor, b_o: Tensor | None = None, *, skip: bool = True
) -> Tensor:
    """An attention-only network: ``X_l = [X_{l-1}] + Σ_h A[l, h] X_{l-1} W_V W_O + 1 b_O[l]ᵀ``.

    attn ``[B, L, H, n, n]``, x ``[B, n, d]``, b_o ``[L, d]`` or None (zero biases) -> ``[B, n, d]``:
    the sum over all its paths, the bias paths included.
    """
    for layer in range(attn.shape[1]):
        heads = sum(attn[:, layer, h] @ x @ w_v[layer, h] @ w_o[layer, h] for h in range(attn.shape[2]))
        if b_o is not None:
            heads = heads + b_o[layer]
        x = x + heads if skip else heads
    return x


def trie_products_ref(
    attn: Tensor, tree, x: Tensor | None = None, w_v: Tensor | None = None, w_o: Tensor | None = None
) -> Tensor:
    """Every path's product by the path tree's trie, materialised level by level in plain PyTorch.

    attn ``[B, L, H, n, n]``, a :class:`~pathkernels.PathTree`, optional x ``[B, n, d]``, w_v, w_o ->
    ``[B, M, n, n]`` (or ``[B, M, n, d]``) in the tree's result order: what
    ``path_residuals(..., materialize=True)`` returns, and a second evaluator beside the per-path
    loop :func:`path_products_ref`.
    """
    from pathkernels.core.paths import SKIP, build_trie_chunk

    chunk = build_trie_chunk(tree.leaf_range(0, tree.num_leaves))
    batch, n = attn.shape[0], attn.shape[-1]
    device = attn.device
    if x is None:
        level = torch.eye(n, dtype=attn.dtype, device=device).expand(batch, 1, n, n)
    else:
        level = x.unsqueeze(1)  # [B, 1, n, d]
    for layer, (parents, heads) in enumerate(zip(chunk.parents, chunk.heads)):
        parents, heads = parents.to(device), heads.to(device)
        nodes = level[:, parents]  # [B, N, n, m]
        out = nodes.clone()
        for head in heads.unique().tolist():
            if head == SKIP:
                continue
            sel = heads == head
            product = attn[:, layer, head].unsqueeze(1) @ nodes[:, sel]
            if x is not None:
                product = product @ w_v[layer, head] @ w_o[layer, head]
            out[:, sel] = product
        level = out
    leaves = level[:, chunk.leaf_position.to(device)]
    leaf_of_path = tree.leaf_of_path()
    return leaves if leaf_of_path is None else leaves[:, leaf_of_path.to(device)]


def levelwise_ref(attn: Tensor, skip: bool) -> tuple[Tensor, Tensor]:
    """The best plain-PyTorch evaluation of a complete tree: every level as stacked GEMMs,
    materialised, then the norms, one top-level branch at a time.

    attn ``[L, H, n, n]`` -> ``(residual, norm)`` of every path of the complete tree (with the skip
    branch if ``skip``), each ``[M]``, in the engine's order within each branch. The benchmarks'
    baseline (b).
    """
    layers, heads, n = attn.shape[0], attn.shape[1], attn.shape[-1]
    eye = torch.eye(n, dtype=attn.dtype, device=attn.device)
    residuals, norms = [], []
    for first in ([None] if skip else []) + list(range(heads)):
        level = (eye if first is None else attn[0, first]).unsqueeze(0)
        for layer in range(1, layers):
            stacked = torch.matmul(attn[layer].unsqueeze(1), level.unsqueeze(0)).flatten(0, 1)
            level = torch.cat([level, stacked]) if skip else stacked
        residuals.append(residual_norm_ref(level))
        norms.append(composite_norm_ref(level))
    return torch.cat(residuals), torch.cat(norms)


def per_path_loop_ref(attn: Tensor, paths: Tensor) -> list[tuple[Tensor, Tensor]]:
    """One product per path, then its norms: attn ``[L, H, n, n]``, paths ``[M, L]`` ->
    ``[(residual, norm)] * M``. The benchmarks' baseline (a), what a user writes first."""
    n = attn.shape[-1]
    out = []
    for path in paths.tolist():
        m = torch.eye(n, dtype=attn.dtype, device=attn.device)
        for layer, head in enumerate(path):
            if head >= 0:
                m = attn[layer, head] @ m
        out.append((residual_norm_ref(m), composite_norm_ref(m)))
    return out


def _layer_patterns(attn) -> Callable[[int], Tensor]:
    """Layer l's patterns ``[B, H, n, n]`` from ``attn [B, L, H, n, n]``, or ``attn`` itself where it
    is already such a function."""
    return attn if callable(attn) else (lambda layer: attn[:, layer])


def pre_ln_length_sums_ref(
    attn: Tensor | Callable[[int], Tensor],
    norm_scale: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    value_bias: Tensor,
    output_bias: Tensor,
    embedding: Tensor,
    mlp_out: Tensor,
    *,
    centred: bool = True,
    collapse: bool = False,
) -> Tensor:
    """Exact sums by path length of a pre-norm transformer's residual stream, norms frozen, in the
    dtype given (docs/DESIGN.md, "Real transformers"): ``[L+1, B, n, d]``, entry k the sum of the
    paths through k heads; their total is the stream entering the final norm. ``collapse``: only
    that total, ``[1, B, n, d]``, by one stream (``S ← S + Σ_h (A_h D) S (C Γ W_V,h W_O,h) + sources``:
    the sum over k of the recurrence below, since no path is longer than the layers passed), L
    times fewer products.

    attn ``[B, L, H, n, n]`` as the model computed it (rows need not sum to 1), or a function of a
    layer giving its ``[B, H, n, n]`` (so that the whole need not be held in float64); norm_scale
    ``[B, L, n]`` (``1/σ`` of each block's attention-input norm), norm_weight and norm_bias
    ``[L, d]`` (γ, β); w_v ``[L, H, d, d_head]``, w_o ``[L, H, d_head, d]`` (each layer's taken to
    the sums' dtype as it comes: they may be held coarser), value_bias ``[L, H, d_head]``,
    output_bias ``[L, d]``; embedding ``[B, n, d]``, whose dtype the sums take; mlp_out ``[B, L, n, d]``.
    ``centred``: LayerNorm (``C = I − 11ᵀ/d``); False for RMSNorm (``C = I``). Per layer, with
    ``S_k`` the sum of the paths through k heads so far and ``r_h = A_h 1``:

        S_k ← S_k + Σ_h (A_h D) S_{k−1} (C Γ W_V,h W_O,h)                 (the heads, k ≥ 1)
        S_0 ← S_0 + Σ_h r_h (βᵀ W_V,h + b_V,hᵀ) W_O,h + 1 b_Oᵀ + MLP output   (the sources entering)
    """
    layers, patterns = norm_scale.shape[1], _layer_patterns(attn)
    count = 1 if collapse else layers + 1  # the sums kept: every length, or their total
    sums = [embedding] + [torch.zeros_like(embedding) for _ in range(count - 1)]
    for layer in range(layers):
        pattern = patterns(layer)
        value, output = (w[layer].to(embedding.dtype) for w in (w_v, w_o))  # one layer's in the sums' dtype
        before = sums
        sums = [s.clone() for s in before]
        for k in range(0 if collapse else 1, count):
            prev = before[k if collapse else k - 1]
            centred_prev = prev - prev.mean(-1, keepdim=True) if centred else prev
            normed = norm_scale[:, layer, :, None] * centred_prev * norm_weight[layer]  # D x C Γ
            values = torch.einsum("bnd,hde->bhne", normed, value)  # (A D) x = A (D x): no [H, n, n] A D
            sums[k] += torch.einsum("bhij,bhje,hef->bif", pattern, values, output)
        head_rows = torch.einsum("d,hde->he", norm_bias[layer], value) + value_bias[layer]
        constant = torch.einsum("bhi,he,hef->bif", pattern.sum(-1), head_rows, output)
        sums[0] += constant + output_bias[layer] + mlp_out[:, layer]
    return torch.stack(sums)


def post_ln_length_sums_ref(
    attn: Tensor | Callable[[int], Tensor],
    norm_scale: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    value_bias: Tensor,
    output_bias: Tensor,
    embedding: Tensor,
    mlp_out: Tensor,
    *,
    centred: bool = True,
    collapse: bool = False,
) -> Tensor:
    """Exact sums by path length of a post-norm transformer's (BERT's) stream, norms frozen:
    ``[L+1, B, n, d]``, entry k the paths through k heads, their total the last hidden state
    (``collapse``: only the total, ``[1, B, n, d]``, by one stream, as in :func:`pre_ln_length_sums_ref`).

    As :func:`pre_ln_length_sums_ref`, with two norms per layer: norm_scale ``[B, L, 2, n]``,
    norm_weight and norm_bias ``[L, 2, d]`` (after the attention sum, after the MLP sum). A block
    computes ``N₁(x + Σ_h A_h (x W_V,h + 1 b_V,hᵀ) W_O,h + 1 b_Oᵀ)``, then ``N₂(z + m)``; frozen, each
    norm is ``y ↦ D y C Γ + 1 βᵀ``, applied to every branch (the skip included) and source:

        S_k ← D₁ (S_k + Σ_h A_h S_{k−1} W_h) C Γ₁ + [k = 0] (D₁ (Σ_h r_h b_V,hᵀ W_O,h + 1 b_Oᵀ) C Γ₁ + 1 β₁ᵀ)
        S_k ← D₂ S_k C Γ₂ + [k = 0] (D₂ m C Γ₂ + 1 β₂ᵀ)
    """
    layers, patterns = norm_scale.shape[1], _layer_patterns(attn)

    def frozen(t: Tensor, layer: int, which: int) -> Tensor:  # D t C Γ, without β
        scale = norm_scale[:, layer, which, :, None]
        return scale * (t - t.mean(-1, keepdim=True) if centred else t) * norm_weight[layer, which]

    count = 1 if collapse else layers + 1  # the sums kept: every length, or their total
    sums = [embedding] + [torch.zeros_like(embedding) for _ in range(count - 1)]
    for layer in range(layers):
        before, pattern = sums, patterns(layer)
        value, output = (w[layer].to(embedding.dtype) for w in (w_v, w_o))  # one layer's in the sums' dtype
        sums = []
        for k in range(count):
            inner = before[k]
            if k >= 1 or collapse:
                values = torch.einsum("bnd,hde->bhne", before[k if collapse else k - 1], value)
                inner = inner + torch.einsum("bhij,bhje,hef->bif", pattern, values, output)
            sums.append(frozen(inner, layer, 0))
        biases = torch.einsum("bhi,he,hef->bif", pattern.sum(-1), value_bias[layer], output)
        sums[0] = sums[0] + frozen(biases + output_bias[layer], layer, 0) + norm_bias[layer, 0]
        sums = [frozen(s, layer, 1) for s in sums]
        sums[0] = sums[0] + frozen(mlp_out[:, layer], layer, 1) + norm_bias[layer, 1]
    return torch.stack(sums)


def pre_norm_path_attribution_ref(
    attn: Tensor,
    norm_scale: Tensor,
    norm_weight: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    source: Tensor,
    heads: list[int],
    r: Tensor,
    v: Tensor,
    *,
    centred: bool = True,
) -> Tensor:
    """One pre-norm path's attribution ``rᵀ T_k ⋯ T_1 K F_1 ⋯ F_k v`` from its matrices, one
    sequence: attn ``[L, H, n, n]`` as computed, norm_scale ``[L, n]`` and norm_weight ``[L, d]`` of
    the attention-input norms, w_v ``[L, H, d, d_head]``, w_o ``[L, H, d_head, d]``; the source
    ``K [n, d]``; ``heads [L]`` the head taken at each layer (−1: none; the source's layer and
    below are −1); r ``[n]`` and v ``[d]`` the frozen readout. Head h of layer l is
    ``T = A_h D_l``, ``F = C Γ_l W_V,h W_O,h`` (``C = I`` unless ``centred``). The term is
    materialised, ``O(n² d + n d²)`` per head: the plain way, for tests and benchmarks."""
    term = source
    width = source.shape[-1]
    centre = torch.eye(width, dtype=source.dtype, device=source.device)
    if centred:
        centre = centre - 1.0 / width
    for layer, head in enumerate(heads):
        if head >= 0:
            token_map = attn[layer, head] * norm_scale[layer][None, :]
            feature_map = centre @ (norm_weight[layer][:, None] * (w_v[layer, head] @ w_o[layer, head]))
            term = token_map @ term @ feature_map
    return r @ term @ v


def readout_values_ref(rho: Tensor, phi: Tensor, source: Tensor) -> Tensor:
    """``torch.ops.pathkernels._readout_values`` in plain PyTorch: ``rho_i K phi_iᵀ`` per node,
    ``[N, P, R]`` from ``rho [N, P, n]``, ``phi [N, R, d]`` and ``source K [n, d]``."""
    return torch.einsum("npd,nrd->npr", rho @ source, phi)


def readout_heads_ref(
    rho: Tensor, phi: Tensor, token_maps: Tensor, feature_in: Tensor, feature_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``torch.ops.pathkernels._readout_heads`` in plain PyTorch: ``rho_i T_h`` ``[H, N, P, n]`` and
    ``phi_i F_in[h] F_out[h]`` ``[H, N, R, d']`` (``phi_i F_in[h]`` without ``feature_out``)."""
    rho_heads = torch.einsum("npi,hij->hnpj", rho, token_maps)
    phi_heads = torch.einsum("nrd,hde->hnre", phi, feature_in)
    if feature_out is not None:
        phi_heads = torch.einsum("hnre,hed->hnrd", phi_heads, feature_out)
    return rho_heads, phi_heads


def readout_expand_ref(z: Tensor, factor: Tensor) -> Tensor:
    """The readout trie's change of a node's φ from d_head to d coordinates: ``z [N, R, e] @ factor
    [e, d]``."""
    return z @ factor


def triton_leaf_norms_ref(
    attn_centred: Tensor, attn_mean: Tensor, parents: Tensor, parent_means: Tensor, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``triton_leaf_norms`` in float64 on the CPU, from the formula: for parent k and head h, with
    ``R_k = scale_k parents[:, k]`` (attn_centred ``[H, n, n]`` = C(A_h), attn_mean ``[H, n]`` = a_h,
    parents ``[n, c, m]``, parent_means ``[c, m]`` = μ_k, scale ``[c]``), the leaf ``R = C(A_h) R_k``
    and its column mean ``μ = μ_k + R_kᵀ a_h``: ``‖R‖_{1,∞}`` and ``‖1μᵀ + R‖_{1,∞}``, each ``[c, H]``."""
    right = parents.double().cpu()
    if scale is not None:
        right = right * scale.double().cpu()[None, :, None]
    leaves = torch.einsum("hik,kcj->chij", attn_centred.double().cpu(), right)
    means = parent_means.double().cpu()[:, None, :] + torch.einsum("hk,kcj->chj", attn_mean.double().cpu(), right)
    return composite_norm_ref(leaves), composite_norm_ref(leaves + means[:, :, None, :])
