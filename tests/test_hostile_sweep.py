"""A sweep of hostile arguments over every public function of pathkernels.

Each case calls one public function (``pk.*``, ``pk.metrics.*``, ``pk.nn``, ``pk.compat``, the
adapters on a tiny GPT-2 built from a config, the methods of ``PathTree`` and ``PathStatistics``,
and the command line, in process and in a few ``python -m pathkernels`` subprocesses) with one
hostile argument, of one of these classes: NaN or inf, zero, empty, huge, negative, a wrong dtype
(int, bool, complex, half precision, a mix), the meta device, a wrong shape or rank, stride 0
(``expand``) and other layouts, a wrong type (str, None, list, a float for an int), and damaged
files. Every case must end in one of two ways:

- a clear error: ValueError, TypeError or IndexError whose message starts with the public
  function's name (``pathkernels.length_sums:``, ``pathkernels.metrics.stable_rank:``;
  ``pathkernels attribute:`` for the command line) and names the argument;
- a right number: what a float64 reference written here gives (NaN where the function documents
  that NaN propagates), to the input's precision.

The cases form one table (``CASES``), built from small inputs at import, so that the sweep is broad
and quick. A case whose defect lies in a file that others own carries ``owed``: the fix it needs,
and runs as a strict xfail until that fix lands. ``python tests/test_hostile_sweep.py`` prints the
totals by outcome and by class, which docs/RELIABILITY.md ("The hostile sweep") records.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import pathkernels as pk
from pathkernels.core._files import read_sealed, write_sealed
from pathkernels.reference import path_products_ref

NAN, INF = math.nan, math.inf
ERRORS = (ValueError, TypeError, IndexError)


@dataclass(frozen=True)
class Case:
    """One call with one hostile argument.

    ``where``: the name its errors must start with; ``argument``: a word the error must hold (any
    of several); ``kind``: the hostile class; ``expected``: None where it must be refused, else a
    function giving the reference that the result must match by ``compare`` (default
    :func:`close`); ``owed``: the fix a file owned by others needs (the case is then a strict xfail).
    """

    where: str
    argument: str | tuple[str, ...]
    kind: str
    label: str
    call: Callable[[], object]
    expected: Callable[[], object] | None = None
    compare: Callable[[object, object], bool] | None = None
    owed: str | None = None

    @property
    def id(self) -> str:
        return f"{self.where.removeprefix('pathkernels.')}-{self.label}-{self.kind}"


def close(got, expected, *, rtol=1e-9) -> bool:
    """Tensors (or tuples of them, or numbers) equal to ``rtol`` relative to the largest finite
    entry of each; NaN where NaN and inf where inf; shapes equal; results on the CPU."""
    if isinstance(expected, (tuple, list)):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(expected)
            and all(close(g, e, rtol=rtol) for g, e in zip(got, expected))
        )
    if not isinstance(expected, torch.Tensor):
        return got == expected
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.device.type != "cpu":
        return False
    got, expected = got.detach().double(), expected.detach().double()
    if not torch.equal(got.isnan(), expected.isnan()):
        return False
    finite = expected.isfinite()
    if not torch.equal(got[~finite].nan_to_num(), expected[~finite].nan_to_num()):
        return False
    scale = expected[finite].abs().amax().item() if bool(finite.any()) else 0.0
    return bool(((got[finite] - expected[finite]).abs() <= rtol * scale).all())


def loose(rtol):
    return lambda got, expected: close(got, expected, rtol=rtol)


def outcome(case: Case) -> str:
    """What the call does: ``"clear error"`` or ``"right number"``; or a failure: ``"unclear
    error"`` (a refusal that does not start with the function's name or names no argument), ``"raw
    error"`` (any other exception), ``"wrong number"``, ``"number where it must refuse"`` or
    ``"refused a valid input"``."""
    names = (case.argument,) if isinstance(case.argument, str) else case.argument
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = case.call()
    except ERRORS as error:
        message = str(error)
        named = message.startswith(f"{case.where}:") or message.startswith(f"{case.where} (")
        if not (named and any(name in message for name in names)):
            return f"unclear error: {type(error).__name__}: {message[:300]}"
        return "clear error" if case.expected is None else f"refused a valid input: {message[:300]}"
    except Exception as error:  # noqa: BLE001 (what the sweep is for)
        return f"raw error: {type(error).__name__}: {str(error)[:300]}"
    if case.expected is None:
        return "number where it must refuse"
    return "right number" if (case.compare or close)(got, case.expected()) else "wrong number"


def expected_outcome(case: Case) -> str:
    return "clear error" if case.expected is None else "right number"


CASES: list[Case] = []


def refused(where, argument, kind, label, call, owed=None):
    CASES.append(Case(where, argument, kind, label, call, owed=owed))


def gives(where, argument, kind, label, call, expected, compare=None, owed=None):
    CASES.append(Case(where, argument, kind, label, call, expected, compare, owed))


# --- inputs ------------------------------------------------------------------------------------------

_G = torch.Generator().manual_seed(34)
B, L, H, N, D = 2, 2, 2, 3, 2
ATTN = torch.softmax(torch.randn(B, L, H, N, N, generator=_G, dtype=torch.float64), -1)
X = torch.randn(B, N, D, generator=_G, dtype=torch.float64)
W_V = torch.randn(L, H, D, D, generator=_G, dtype=torch.float64)
W_O = torch.randn(L, H, D, D, generator=_G, dtype=torch.float64)
B_O = torch.randn(L, D, generator=_G, dtype=torch.float64)
TREE = pk.PathTree.complete(L, H, skip=True)
MATRICES = torch.randn(2, 4, 3, generator=_G, dtype=torch.float64)  # [..., n, d] for the metrics
HIDDEN = torch.randn(3, 2, 4, 3, generator=_G, dtype=torch.float64)  # [L+1, B, n, d]
FOLDER = Path(tempfile.mkdtemp(prefix="pathkernels-sweep-"))

# Classes of damage every tensor argument must refuse (damaged()).
REFUSED_TENSOR_KINDS = (
    "nan",
    "inf",
    "-inf",
    "int",
    "bool",
    "complex",
    "meta",
    "drop a dim",
    "extra dim",
    "one short",
    "empty",
    "str",
    "list",
    "float",
)
LAYOUTS = ("stride 0", "not contiguous", "requires grad")  # the same values, held otherwise


def damaged(t: torch.Tensor, kind: str):
    """``t`` with one hostile change of class ``kind``."""
    if kind in ("nan", "inf", "-inf"):
        u = t.clone()
        u.view(-1)[u.numel() // 2] = {"nan": NAN, "inf": INF, "-inf": -INF}[kind]
        return u
    return {
        "int": lambda: t.to(torch.int64),
        "bool": lambda: t > 0,
        "complex": lambda: t.to(torch.complex128),
        "meta": lambda: t.to("meta"),
        "drop a dim": lambda: t[..., 0],
        "extra dim": lambda: t.unsqueeze(0),
        "one short": lambda: t[..., :-1],
        "empty": lambda: t[:0],
        "str": lambda: "tensor",
        "list": lambda: t.tolist(),
        "float": lambda: 2.5,
        "None": lambda: None,
    }[kind]()


def same_values(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values (stride 0: every batch element the first one's) in a hostile layout."""
    if kind == "stride 0":
        return t[:1].expand_as(t)
    if kind == "not contiguous":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t.clone().requires_grad_()


def reference_values(t: torch.Tensor, kind: str) -> torch.Tensor:
    return same_values(t, kind).detach()


# --- references ---------------------------------------------------------------------------------------


def matrix_norms_ref(x):
    """``(‖x‖_1, ‖x‖_∞, ‖x‖_{1,∞})`` in float64, the composite as ``sqrt(l1) · sqrt(linf)``, which
    neither overflows nor underflows near the ends of the range (0 for a matrix without columns)."""
    a = x.detach().double().abs()
    if x.shape[-1] == 0:
        zero = a.new_zeros(x.shape[:-2])
        return zero, zero, zero
    l1, linf = a.sum(-2).amax(-1), a.sum(-1).amax(-1)
    return l1, linf, l1.sqrt() * linf.sqrt()


def composite_norm_ref(x):
    return matrix_norms_ref(x)[2]


def residual_norm_ref(x):
    x = x.detach().double()
    return composite_norm_ref(x - x.mean(-2, keepdim=True))


def rows(attn):
    """attn in float64, its rows renormalised (as the library renormalises an upcast pattern)."""
    attn = attn.detach().double()
    return attn / attn.sum(-1, keepdim=True)


def ref_residuals(attn, x=None, w_v=None, w_o=None, tree=TREE):
    operands = [None if t is None else t.detach().double() for t in (x, w_v, w_o)]
    products = path_products_ref(rows(attn), tree.paths(), *operands)
    return residual_norm_ref(products), composite_norm_ref(products)


def ref_statistics(attn, x, w_v, w_o):
    residual, norm = ref_residuals(attn, x, w_v, w_o)
    lengths = TREE.lengths()
    counts = torch.stack([(lengths == k).sum().expand(residual.shape[0]) for k in range(L + 1)], 1)
    sums = torch.stack([residual[:, lengths == k].sum(1) for k in range(L + 1)], 1)
    maxima = torch.stack([norm[:, lengths == k].amax(1) for k in range(L + 1)], 1)
    return counts, sums, maxima


def ref_length_sums(attn, x, w_v, w_o, b_o=None):
    """Σ over the paths of each length of P_p X W_p, and each bias path of layer l: ``1 b_O[l]ᵀ``
    carried through the heads above it, of length 1 + their number (docs/USAGE.md)."""
    attn = rows(attn)
    x, w_v, w_o = (t.detach().double() for t in (x, w_v, w_o))
    layers, heads = attn.shape[1], attn.shape[2]
    paths = pk.PathTree.complete(layers, heads, skip=True).paths()
    products = path_products_ref(attn, paths, x, w_v, w_o)
    lengths = (paths >= 0).sum(1)
    sums = torch.stack([products[:, lengths == k].sum(1) for k in range(layers + 1)])
    if b_o is not None:
        for layer in range(layers):
            above = [[]] if layer + 1 == layers else pk.PathTree.complete(layers - layer - 1, heads, skip=True).paths()
            for path in [list(p) for p in above]:
                m = b_o[layer].detach().double().expand(x.shape[0], x.shape[1], -1)
                for offset, head in enumerate(path):
                    if head >= 0:
                        at = layer + 1 + offset
                        m = attn[:, at, head] @ m @ w_v[at, head] @ w_o[at, head]
                sums[1 + sum(h >= 0 for h in path)] += m
    return sums


def ref_rollout(attn):
    """Mean fusion, with the skip, nothing discarded: ``Σ_p 2^-L H^-len(p) P_p`` over every path."""
    batched = attn if attn.dim() == 5 else attn.unsqueeze(0)
    layers, heads = batched.shape[1], batched.shape[2]
    tree = pk.PathTree.complete(layers, heads, skip=True)
    weights = 0.5**layers * (1.0 / heads) ** tree.lengths().double()
    out = torch.einsum("bmij,m->bij", path_products_ref(rows(batched), tree.paths()), weights)
    return out if attn.dim() == 5 else out[0]


def ref_rollout_of_rows(attn):
    """rollout of rows that need not sum to 1: per layer ``(mean_h A + I)``, each row divided by its
    sum, multiplied from the first layer up."""
    fused = attn.detach().double().mean(2) + torch.eye(attn.shape[-1], dtype=torch.float64)
    fused = fused / fused.sum(-1, keepdim=True)
    out = fused[:, 0]
    for layer in range(1, fused.shape[1]):
        out = fused[:, layer] @ out
    return out


def centred(x):
    x = x.detach().double()
    return x - x.mean(-2, keepdim=True)


def effective_rank_ref(x):
    s = torch.linalg.svdvals(x.double())
    p = s / s.sum(-1, keepdim=True)
    return (-torch.special.xlogy(p, p).sum(-1)).exp()


def cosine_ref(x):
    u = x.double() / x.double().norm(dim=-1, keepdim=True)
    n = x.shape[-2]
    gram = u @ u.transpose(-1, -2)
    return (gram.sum((-2, -1)) - gram.diagonal(dim1=-2, dim2=-1).sum(-1)) / (n * (n - 1))


def escalation_ref(h):
    share = centred(h).square().sum((-2, -1)) / h.double().square().sum((-2, -1))
    return (share[1:] / share[:-1]).to(h.dtype if h.dtype == torch.float64 else torch.float32)


METRIC_REFERENCES = {
    "residual_ratio": lambda x: residual_norm_ref(x) / composite_norm_ref(x),
    "token_similarity": lambda x: (
        x.double().mean(-2).square().sum(-1) * x.shape[-2] / x.double().square().sum((-2, -1))
    ),
    "token_diversity": lambda x: centred(x).square().sum((-2, -1)) / x.double().square().sum((-2, -1)),
    "effective_rank": effective_rank_ref,
    "stable_rank": lambda x: (lambda s: (s / s[..., :1]).square().sum(-1))(torch.linalg.svdvals(x.double())),
    "rank1_residual": lambda x: (lambda s: s[..., 1:].square().sum(-1).sqrt() / s.square().sum(-1).sqrt())(
        torch.linalg.svdvals(x.double())
    ),
    "token_cosine_similarity": cosine_ref,
    "dobrushin": lambda p: 0.5 * (p.double().unsqueeze(-2) - p.double().unsqueeze(-3)).abs().sum(-1).amax((-2, -1)),
}


# --- the engine and the sums ----------------------------------------------------------------------------


ENGINE = {
    "pathkernels.path_residuals": (
        lambda attn, x, w_v, w_o, tree=TREE, **kw: (lambda r: (r.residual, r.norm))(
            pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, **kw)
        ),
        ref_residuals,
    ),
    "pathkernels.decompose": (
        lambda attn, x, w_v, w_o, **kw: (lambda r: (r.results.residual, r.results.norm))(
            pk.decompose(attn, x=x, w_v=w_v, w_o=w_o, **kw)
        ),
        ref_residuals,
    ),
    "pathkernels.path_statistics": (
        lambda attn, x, w_v, w_o, tree=TREE, **kw: (lambda s: (s.counts, s.sums["residual"], s.maxima["norm"]))(
            pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o, **kw)
        ),
        ref_statistics,
    ),
    "pathkernels.length_sums": (
        lambda attn, x, w_v, w_o, **kw: pk.length_sums(attn, x, w_v, w_o, **kw),
        ref_length_sums,
    ),
}


def engine_cases(where, call, reference):
    """Every hostile tensor, tree, budget, mask and flag of one engine function, with path outputs."""
    valid = {"attn": ATTN, "x": X, "w_v": W_V, "w_o": W_O}

    def add(kind, label, argument, args, number, extra=None, compare=None):
        run = lambda: call(**args, **(extra or {}))
        if number:
            gives(where, argument, kind, label, run, lambda: reference(**args), compare)
        else:
            refused(where, argument, kind, label, run)

    for name in valid:
        # A shape that no longer matches may be reported on the operand it is checked against.
        words = {"attn": ("attn", "attention"), "x": ("x", "w_v"), "w_v": ("w_v", "w_o"), "w_o": ("w_o",)}[name]
        for kind in REFUSED_TENSOR_KINDS:
            add(kind, name, words, dict(valid, **{name: damaged(valid[name], kind)}), False)
        for kind in LAYOUTS:
            add(kind, name, name, dict(valid, **{name: same_values(valid[name], kind)}), True)
        add("None", name, (*words, "x, w_v and w_o"), dict(valid, **{name: None}), False)
        if name != "attn":
            add("empty", f"{name} without columns", words, dict(valid, **{name: valid[name][..., :0]}), False)
            for kind, factor in (("zero", 0.0), ("huge", 1e100), ("tiny", 1e-100), ("negative", -1.0)):
                add(kind, name, name, dict(valid, **{name: valid[name] * factor}), True)
    add("zero", "attn", ("attn", "attention"), dict(valid, attn=torch.zeros_like(ATTN)), False)
    add("huge", "attn", ("attn", "attention"), dict(valid, attn=ATTN * 1e200), False)
    add("negative", "attn signed, rows summing to 1", "attn", dict(valid, attn=2 * ATTN - 1 / N), True)
    add("half", "float16 operands", "attn", {k: v.half() for k, v in valid.items()}, True, compare=loose(2e-2))
    add("half", "bfloat16 operands", "attn", {k: v.bfloat16() for k, v in valid.items()}, True, compare=loose(6e-2))
    add("half", "x alone", ("x", "dtype"), dict(valid, x=X.half()), False)
    add("dtype mix", "x in float32", ("x", "dtype"), dict(valid, x=X.float()), False)
    if where != "pathkernels.length_sums":
        for kind, label, tree in (
            ("shape", "tree of 3 layers", pk.PathTree.complete(3, 2, skip=True)),
            ("shape", "tree of 3 heads", pk.PathTree.complete(2, 3, skip=True)),
            ("str", "tree", "tree"),
            ("list", "tree", [[0, 1]]),
        ):
            add(kind, label, "tree", valid, False, extra={"tree": tree})
        if where != "pathkernels.decompose":
            add("None", "tree", "tree", valid, False, extra={"tree": None})
        for kind, value in (("negative", -1), ("zero", 0), ("float", 1e9), ("str", "1GB"), ("None", None)):
            add(kind, "memory_budget", "memory_budget", valid, False, extra={"memory_budget": value})
        add("huge", "memory_budget", "memory_budget", valid, True, extra={"memory_budget": 2**80})
    for kind, mask in (
        ("zero", torch.zeros(B, N)),
        ("nan", torch.full((B, N), NAN)),
        ("shape", torch.ones(B, N + 1)),
        ("meta", torch.ones(B, N, device="meta")),
        ("str", "all"),
        ("list", [[1] * N] * B),
        ("negative", -torch.ones(B, N)),
        ("complex", torch.ones(B, N, dtype=torch.complex64)),
    ):
        add(kind, "token_mask", "token_mask", valid, False, extra={"token_mask": mask})
    ones = torch.ones(B, N, dtype=torch.bool)
    add("bool", "token_mask of ones", "token_mask", valid, True, extra={"token_mask": ones})
    flag = "skip" if where in ("pathkernels.length_sums", "pathkernels.decompose") else "progress"
    for kind, value in (("str", "no"), ("int", 1), ("None", None)):
        add(kind, flag, flag, valid, False, extra={flag: value})


for _where, (_call, _reference) in ENGINE.items():
    engine_cases(_where, _call, _reference)


def length_sums_cases():
    where = "pathkernels.length_sums"
    with_bias = lambda b_o: pk.length_sums(ATTN, X, W_V, W_O, b_o=b_o)
    for kind in ("nan", "inf", "int", "bool", "complex", "meta", "drop a dim", "extra dim", "one short", "str", "list"):
        refused(where, "b_o", kind, "b_o", lambda k=kind: with_bias(damaged(B_O, k)))
    for kind, b_o in (
        ("zero", B_O * 0),
        ("huge", B_O * 1e100),
        ("negative", -B_O),
        ("stride 0", B_O[:1].expand_as(B_O)),
    ):
        gives(
            where, "b_o", kind, "b_o", lambda b=b_o: with_bias(b), lambda b=b_o: ref_length_sums(ATTN, X, W_V, W_O, b)
        )
    # Work beyond memory, held in a few bytes by stride 0: refused by the estimate, before any pass
    # over the values (the finiteness check allocated 32 GiB).
    big = torch.zeros(1, 1, 1, 1, 1, dtype=torch.float64).expand(1, 1, 1, 1 << 16, 1 << 16)
    x, w_v, w_o = (torch.zeros([1] * k, dtype=torch.float64) for k in (3, 4, 4))
    refused(
        where,
        "sums need",
        "huge",
        "stride-0 attn of 2^32 entries",
        lambda: pk.length_sums(big, x.expand(1, 1 << 16, 1), w_v.expand(1, 1, 1, 1), w_o.expand(1, 1, 1, 1)),
    )
    wide = torch.zeros(1, 1, dtype=torch.float64).expand(N, 1 << 31)
    refused(
        where,
        "sums need",
        "huge",
        "stride-0 x of 2^31 columns",
        lambda: pk.length_sums(ATTN[0], wide, w_v.expand(L, H, 1 << 31, 1), w_o.expand(L, H, 1, 1 << 31)),
    )
    where = "pathkernels.truncated_output"
    sums = pk.length_sums(ATTN, X, W_V, W_O)
    for kind, value in (("negative", -1), ("float", 1.5), ("str", "2"), ("None", None), ("bool", True)):
        refused(where, "max_length", kind, "max_length", lambda v=value: pk.truncated_output(sums, v))
    gives(where, "max_length", "huge", "max_length", lambda: pk.truncated_output(sums, 10**30), lambda: sums.sum(0))
    gives(where, "max_length", "zero", "max_length", lambda: pk.truncated_output(sums, 0), lambda: sums[0])
    for kind in ("nan", "inf", "int", "bool", "complex", "meta", "str", "list", "empty", "extra dim"):
        refused(where, "sums", kind, "sums", lambda k=kind: pk.truncated_output(damaged(sums, k), 1))
    refused(where, "sums", "drop a dim", "sums of 2 dims", lambda: pk.truncated_output(sums[0, 0], 1))
    gives(
        where, "sums", "half", "sums", lambda: pk.truncated_output(sums.half(), 1), lambda: sums[:2].sum(0), loose(2e-3)
    )
    strided = sums[:, :1].expand_as(sums)
    gives(where, "sums", "stride 0", "sums", lambda: pk.truncated_output(strided, 2), lambda: strided.sum(0))
    huge = sums * 1e300
    gives(
        where, "sums", "huge", "sums", lambda: pk.truncated_output(huge, 2), lambda: sums.sum(0) * 1e300, loose(1e-12)
    )


length_sums_cases()


def decompose_and_statistics_cases():
    where = "pathkernels.decompose"
    for name, values in {
        "num_samples": (("negative", -1), ("zero", 0), ("float", 2.5), ("str", "3"), ("bool", True), ("nan", NAN)),
        "samples_per_length": (
            ("negative", -1),
            ("float", 2.5),
            ("str", "3"),
            ("bool", True),
            ("list", [1, 2]),
            ("nan", NAN),
            ("negative", {1: -2}),
            ("float", {1: 2.5}),
            ("huge", {7: 2}),
            ("str", {"1": 2}),
        ),
        "max_length": (("negative", -1), ("float", 1.5), ("str", "1"), ("bool", True)),
        "max_result_bytes": (("negative", -1), ("float", 1e9), ("str", "1GB")),
        "max_paths": (("negative", -1), ("zero", 0), ("float", 1e10), ("str", "10")),
        "generator": (("str", "seed"), ("int", 0)),
        "memory_budget": (("negative", -1), ("float", 1e9), ("str", "1GB")),
    }.items():
        for kind, value in values:
            refused(where, name, kind, name, lambda n=name, v=value: pk.decompose(ATTN, **{n: v}))
    every = lambda: ref_residuals(ATTN)[0]
    gives(
        where, "max_length", "huge", "max_length", lambda: pk.decompose(ATTN, max_length=10**6).results.residual, every
    )
    # a sample of more paths than there are is every path, exactly (documented)
    gives(
        where,
        "num_samples",
        "huge",
        "num_samples",
        lambda: pk.decompose(ATTN, num_samples=10**30).results.residual,
        every,
    )
    where = "pathkernels.path_statistics"
    for name, values in {
        "top_k": (("negative", -1), ("float", 2.5), ("str", "2"), ("bool", True), ("None", None)),
        "bins_per_decade": (("negative", -1), ("zero", 0), ("huge", 10**6), ("float", 10.0), ("nan", NAN)),
        "checkpoint_every": (("negative", -1.0), ("nan", NAN), ("str", "soon")),
        "max_paths": (("negative", -1), ("float", 1e10), ("None", None)),
        "checkpoint": (("int", 3), ("list", ["folder"])),
    }.items():
        for kind, value in values:
            refused(where, name, kind, name, lambda n=name, v=value: pk.path_statistics(ATTN, TREE, **{n: v}))
    for label, content in (("truncated", b"pathkernels sealed file 1\n"), ("random bytes", bytes(range(256)))):
        refused(where, "checkpoint", "file", f"{label} checkpoint", lambda c=content: statistics_resumed_from(c))
    intact = statistics_checkpoint()
    state = read_sealed(intact, "", "", "")
    state["statistics"]["histograms"]["ratio"][0, 1, 5] += 1
    buffer = FOLDER / "edited"
    buffer.mkdir()
    write_sealed(buffer / "rank0-of-1.pt", state)
    edited = (buffer / "rank0-of-1.pt").read_bytes()
    refused(where, "histograms", "file", "checkpoint edited and sealed again", lambda: statistics_resumed_from(edited))


def statistics_checkpoint() -> Path:
    folder = Path(tempfile.mkdtemp(dir=FOLDER))
    pk.path_statistics(ATTN, TREE, checkpoint=folder)
    return folder / "rank0-of-1.pt"


def statistics_resumed_from(content: bytes):
    folder = Path(tempfile.mkdtemp(dir=FOLDER))
    (folder / "rank0-of-1.pt").write_bytes(content)
    return pk.path_statistics(ATTN, TREE, checkpoint=folder)


decompose_and_statistics_cases()


def rollout_cases():
    where = "pathkernels.rollout"
    for kind in REFUSED_TENSOR_KINDS + ("None",):
        refused(where, ("attn", "attention"), kind, "attn", lambda k=kind: pk.rollout(damaged(ATTN, k)))
    refused(where, ("attn", "attention"), "negative", "attn", lambda: pk.rollout(2 * ATTN - 1 / N))
    for kind in LAYOUTS:
        gives(
            where,
            "attn",
            kind,
            "attn",
            lambda k=kind: pk.rollout(same_values(ATTN, k)),
            lambda k=kind: ref_rollout(reference_values(ATTN, k)),
        )
    gives(where, "attn", "half", "attn", lambda: pk.rollout(ATTN.half()), lambda: ref_rollout(ATTN), loose(1e-2))
    gives(
        where,
        "attn",
        "zero",
        "attn",
        lambda: pk.rollout(torch.zeros_like(ATTN)),
        lambda: torch.eye(N, dtype=torch.float64).expand(B, N, N),
    )
    huge = ATTN * 1e300
    gives(where, "attn", "huge", "attn", lambda: pk.rollout(huge), lambda: ref_rollout_of_rows(huge), loose(1e-12))
    for name, values in {
        "head_fusion": (("str", "median"), ("None", None), ("list", ["mean"]), ("int", 0)),
        "discard_ratio": (
            ("negative", -0.1),
            ("huge", 1.0),
            ("nan", NAN),
            ("str", "0.5"),
            ("None", None),
            ("complex", 0.5j),
        ),
        "residual": (("str", "no"), ("int", 0)),
    }.items():
        for kind, value in values:
            refused(where, name, kind, name, lambda n=name, v=value: pk.rollout(ATTN, **{n: v}))
    for kind, mask in (
        ("zero", torch.zeros(B, N)),
        ("meta", torch.ones(B, N, device="meta")),
        ("shape", torch.ones(3)),
    ):
        refused(where, "token_mask", kind, "token_mask", lambda m=mask: pk.rollout(ATTN, token_mask=m))
    refused(
        where,
        "row",
        "zero",
        "zero attention without the skip",
        lambda: pk.rollout(torch.zeros_like(ATTN), residual=False),
    )


rollout_cases()


# --- the norm ops and pk.compat ------------------------------------------------------------------------


def scaled(reference, factor):
    """``reference(MATRICES · factor)`` from ``reference(MATRICES)``: the norms are homogeneous."""
    value = reference(MATRICES)
    return tuple(t * abs(factor) for t in value) if isinstance(value, tuple) else value * abs(factor)


def shapes(value):
    return tuple(t.shape for t in value) if isinstance(value, tuple) else value.shape


def norm_cases():
    x = MATRICES
    ops = {
        "pathkernels.composite_norm": (pk.composite_norm, composite_norm_ref),
        "pathkernels.residual_norm": (pk.residual_norm, residual_norm_ref),
        "pathkernels.matrix_norms": (lambda x: tuple(pk.matrix_norms(x)), matrix_norms_ref),
        "pathkernels.compat.composite_norm": (pk.compat.composite_norm, composite_norm_ref),
        "pathkernels.compat.l1_matrix_norm": (pk.compat.l1_matrix_norm, lambda x: matrix_norms_ref(x)[0]),
        "pathkernels.compat.linf_matrix_norm": (pk.compat.linf_matrix_norm, lambda x: matrix_norms_ref(x)[1]),
    }
    for where, (op, reference) in ops.items():
        refused(where, "x", "drop a dim", "x of one dim", lambda o=op: o(x[0, 0]))
        for kind in ("int", "bool", "complex", "str", "list", "float", "None"):
            refused(where, "x", kind, "x", lambda o=op, k=kind: o(damaged(x, k)))
        refused(where, ("x", "rows"), "empty", "x without rows", lambda o=op: o(x[..., :0, :]))
        gives(where, "x", "empty", "an empty batch", lambda o=op: o(x[:0]), lambda r=reference: r(x[:0]))
        gives(where, "x", "empty", "x without columns", lambda o=op: o(x[..., :0]), lambda r=reference: r(x[..., :0]))
        for kind in ("nan", "inf", "-inf"):  # NaN and inf propagate, as in torch (docs/USAGE.md)
            bad = damaged(x, kind)
            gives(where, "x", kind, "x", lambda o=op, b=bad: o(b), lambda r=reference, b=bad: r(b))
        for kind, factor in (("zero", 0.0), ("huge", 1e300), ("tiny", 1e-300), ("negative", -1.0)):
            gives(
                where,
                "x",
                kind,
                "x",
                lambda o=op, f=factor: o(x * f),
                lambda r=reference, f=factor: scaled(r, f),
                loose(1e-13),
            )
        for kind in LAYOUTS:
            gives(
                where,
                "x",
                kind,
                "x",
                lambda o=op, k=kind: o(same_values(x, k)),
                lambda r=reference, k=kind: r(reference_values(x, k)),
            )
        gives(where, "x", "half", "x", lambda o=op: o(x.half()), lambda r=reference: r(x.half()), loose(2e-3))
        gives(
            where,
            "x",
            "meta",
            "x (shapes, as torch's ops)",
            lambda o=op: shapes(o(x.to("meta"))),
            lambda r=reference: shapes(r(x)),
        )
    for kind, value in (("str", "no"), ("int", 1), ("None", None)):
        refused(
            "pathkernels.residual_norm",
            "return_norm",
            kind,
            "return_norm",
            lambda v=value: pk.residual_norm(x, return_norm=v),
        )
        refused(
            "pathkernels.matrix_norms", "residual", kind, "residual", lambda v=value: pk.matrix_norms(x, residual=v)
        )
    where = "pathkernels.compat.sample_path"
    for name, values in {
        "depth": (("negative", -1), ("huge", 5), ("float", 1.5), ("str", "1"), ("None", None)),
        "num_layers": (("negative", -1), ("float", 3.0), ("str", "3")),
        "num_heads": (("zero", 0), ("float", 2.0), ("str", "2")),
    }.items():
        for kind, value in values:
            args = {"depth": 1, "num_layers": 3, "num_heads": 2, name: value}
            refused(where, name, kind, name, lambda a=args: pk.compat.sample_path(**a))
    where = "pathkernels.compat.sample_P_matrix"
    attentions = ATTN.transpose(0, 1)  # [L, S, H, t, t]
    for kind in ("drop a dim", "str", "None", "list", "meta", "int", "complex"):
        refused(
            where, "attentions", kind, "attentions", lambda k=kind: pk.compat.sample_P_matrix(damaged(attentions, k), 1)
        )
    for kind, value in (("negative", -1), ("huge", 3), ("float", 1.0), ("str", "1")):
        refused(where, "depth", kind, "depth", lambda v=value: pk.compat.sample_P_matrix(attentions, v))
    identity = torch.eye(N, dtype=torch.float64)
    gives(where, "depth", "zero", "depth", lambda: pk.compat.sample_P_matrix(attentions, 0), lambda: identity)


norm_cases()


# --- the metrics and pk.nn ------------------------------------------------------------------------------


def metric_cases(name, reference):
    """Every hostile matrix and mask of one metric."""
    where = f"pathkernels.metrics.{name}"
    metric = getattr(pk.metrics, name)
    x = ATTN if name == "dobrushin" else MATRICES
    argument = "p" if name == "dobrushin" else "x"
    words = (argument, "tensor", "sequence")
    for kind in REFUSED_TENSOR_KINDS + ("None",):
        if kind in ("extra dim", "one short"):  # another batch dim, or one token or column fewer: valid
            other = damaged(x, kind)
            gives(
                where, argument, kind, argument, lambda o=other: metric(o), lambda o=other: reference(o), loose(1e-10)
            )
        elif kind == "drop a dim":
            refused(where, words, kind, argument, lambda: metric(x.reshape(-1)))
        elif kind == "list":  # a list of matrices is a sequence of tensors, stacked
            gives(
                where,
                argument,
                "list",
                "a list of matrices",
                lambda: metric(list(x)),
                lambda: reference(x),
                loose(1e-10),
            )
            refused(where, words, "list", "nested lists", lambda: metric(x.tolist()))
        elif kind == "empty":  # an empty batch: an empty result
            gives(where, argument, kind, "an empty batch", lambda: metric(x[:0]), lambda: reference(x[:0]))
        else:
            refused(where, words, kind, argument, lambda k=kind: metric(damaged(x, k)))
    refused(where, (argument, "column"), "empty", f"{argument} without columns", lambda: metric(x[..., :0]))
    for kind, factor in (("huge", 1e200), ("tiny", 1e-200), ("negative", -1.0)):
        scale = abs(factor) if name == "dobrushin" else 1.0  # τ₁(cP) = |c| τ₁(P); the others are scale-free
        gives(
            where,
            argument,
            kind,
            argument,
            lambda f=factor: metric(x * f),
            lambda c=scale: reference(x) * c,
            loose(1e-10),
        )
    zero = {"token_similarity": 1.0}.get(name, 0.0)  # the documented values of a zero matrix
    zeros = lambda: torch.full(x.shape[:-2], zero, dtype=torch.float64)
    gives(where, argument, "zero", argument, lambda: metric(torch.zeros_like(x)), zeros)
    for kind in LAYOUTS:
        gives(
            where,
            argument,
            kind,
            argument,
            lambda k=kind: metric(same_values(x, k)),
            lambda k=kind: reference(reference_values(x, k)),
            loose(1e-10),
        )
    for half in (torch.float16, torch.bfloat16):
        gives(
            where,
            argument,
            "half",
            f"{argument} in {half}",
            lambda h=half: metric(x.to(h)),
            lambda h=half: reference(x.to(h)),
            loose(1e-5),
        )
    mask = torch.ones(x.shape[:-1]) if name != "dobrushin" else torch.ones(B, 1, 1, N)
    for kind, bad in (
        ("zero", torch.zeros_like(mask)),
        ("shape", torch.ones(7)),
        ("str", "all"),
        ("nan", torch.full_like(mask, NAN)),
        ("meta", mask.to("meta")),
    ):
        refused(where, "token_mask", kind, "token_mask", lambda b=bad: metric(x, token_mask=b))


for _name, _reference in METRIC_REFERENCES.items():
    metric_cases(_name, _reference)


def other_metric_and_module_cases():
    where = "pathkernels.metrics.escalation_rate"
    rate = pk.metrics.escalation_rate
    for kind, hidden in (
        ("negative", -HIDDEN),
        ("huge", HIDDEN * 1e200),
        ("stride 0", HIDDEN[:, :1].expand_as(HIDDEN)),
    ):
        base = HIDDEN[:, :1].expand_as(HIDDEN) if kind == "stride 0" else HIDDEN
        gives(
            where,
            "hidden_states",
            kind,
            "hidden_states",
            lambda h=hidden: rate(h),
            lambda b=base: escalation_ref(b),
            loose(1e-10),
        )
    gives(
        where,
        "hidden_states",
        "half",
        "hidden_states",
        lambda: rate(HIDDEN.half()),
        lambda: escalation_ref(HIDDEN.half()),
        loose(1e-5),
    )
    for kind in ("nan", "inf", "int", "bool", "complex", "meta", "str", "float", "None"):
        refused(where, "hidden_states", kind, "hidden_states", lambda k=kind: rate(damaged(HIDDEN, k)))
    refused(where, "layers", "shape", "one layer", lambda: rate(HIDDEN[:1]))
    where = "pathkernels.metrics.rank1_residual"
    for kind, value in (("str", "spectral"), ("None", None), ("int", 2)):
        refused(where, "norm", kind, "norm", lambda v=value: pk.metrics.rank1_residual(MATRICES, norm=v))
    where = "pathkernels.metrics.token_cosine_similarity"
    for kind, value in (("negative", -1.0), ("nan", NAN), ("str", "tiny"), ("None", None), ("zero", 0.0), ("inf", INF)):
        refused(where, "eps", kind, "eps", lambda v=value: pk.metrics.token_cosine_similarity(MATRICES, eps=v))
    refused(
        where, ("tokens", "x"), "shape", "one token", lambda: pk.metrics.token_cosine_similarity(MATRICES[..., :1, :])
    )
    where = "pathkernels.nn.DeEscalation"
    for kind, value in (("nan", NAN), ("inf", INF), ("str", "1"), ("None", None), ("bool", True), ("complex", 1j)):
        refused(where, "tau", kind, "tau", lambda v=value: pk.nn.DeEscalation(tau=v))
    module = pk.nn.DeEscalation(tau=1.0)
    for kind in ("int", "bool", "complex", "str", "None", "list"):
        refused(where, "x", kind, "x", lambda k=kind: module(damaged(MATRICES, k)))
    refused(where, "x", "drop a dim", "x", lambda: module(MATRICES[0, 0]))
    refused(where, ("x", "tokens"), "empty", "x without rows", lambda: module(MATRICES[..., :0, :]))
    # A module computes as torch's do: NaN and inf propagate, the meta device gives shapes.
    for kind in ("nan", "inf"):
        bad = damaged(MATRICES, kind)
        gives(where, "x", kind, "x", lambda b=bad: module(b), lambda b=bad: centred(b))
    gives(where, "x", "meta", "x", lambda: module(MATRICES.to("meta")).shape, lambda: MATRICES.shape)
    for kind, value in (
        ("zero", MATRICES * 0),
        ("huge", MATRICES * 1e300),
        ("negative", -MATRICES),
        ("stride 0", MATRICES[:1].expand_as(MATRICES)),
        ("empty", MATRICES[:0]),
    ):
        gives(where, "x", kind, "x", lambda v=value: module(v), lambda v=value: centred(v), loose(1e-14))
    gives(where, "x", "half", "x", lambda: module(MATRICES.half()), lambda: centred(MATRICES.half()), loose(2e-3))


other_metric_and_module_cases()


# --- trees and counts ------------------------------------------------------------------------------------


def tree_cases():
    bad_sizes = (
        ("negative", -1),
        ("zero", 0),
        ("float", 2.0),
        ("str", "2"),
        ("None", None),
        ("bool", True),
        ("huge", 2**31),
        ("nan", NAN),
    )
    calls = {
        "pathkernels.count_paths": lambda **kw: pk.count_paths(**{"num_layers": 3, "num_heads": 2, **kw}),
        "pathkernels.count_by_length": lambda **kw: pk.count_by_length(**{"num_layers": 3, "num_heads": 2, **kw}),
        "pathkernels.PathTree.complete": lambda **kw: pk.PathTree.complete(**{"num_layers": 3, "num_heads": 2, **kw}),
        "pathkernels.sample_paths": lambda **kw: pk.sample_paths(
            **{"num_layers": 3, "num_heads": 2, "num_samples": 4, **kw}
        ),
    }
    for where, call in calls.items():
        for name in ("num_layers", "num_heads"):
            for kind, value in bad_sizes:
                refused(where, name, kind, name, lambda c=call, n=name, v=value: c(**{n: v}))
        for kind, value in (("str", "no"), ("int", 1), ("None", None)):
            refused(where, "skip", kind, "skip", lambda c=call, v=value: c(skip=v))
        if where != "pathkernels.sample_paths":
            for kind, value in (("negative", -1), ("float", 1.5), ("str", "1")):
                refused(where, "max_length", kind, "max_length", lambda c=call, v=value: c(max_length=v))
    where = "pathkernels.count_paths"
    gives(where, "num_layers", "huge", "num_layers", lambda: pk.count_paths(1000, 1000, skip=True), lambda: 1001**1000)
    gives(
        where,
        "max_length",
        "huge",
        "max_length",
        lambda: pk.count_paths(3, 2, skip=True, max_length=10**30),
        lambda: 27,
    )
    gives(where, "max_length", "zero", "max_length", lambda: pk.count_paths(3, 2, skip=True, max_length=0), lambda: 1)
    refused(
        where,
        "num_layers",
        "huge",
        "a count too large to hold",
        lambda: pk.count_paths(2**31 - 1, 2**31 - 1, skip=True),
    )
    # counting 10^4 layers of 10^4 heads by length took 80 s for 1.3·10^9 bits of numbers
    refused(
        "pathkernels.count_by_length",
        "num_layers",
        "huge",
        "counts too large to hold",
        lambda: pk.count_by_length(10**4, 10**4, skip=True),
    )
    where = "pathkernels.PathTree.complete"
    refused(where, "paths", "huge", "a tree beyond int64 leaves", lambda: pk.PathTree.complete(100, 100, skip=True))
    skips = lambda: torch.full((1, 3), -1)
    gives(
        where,
        "max_length",
        "zero",
        "max_length",
        lambda: pk.PathTree.complete(3, 2, skip=True, max_length=0).paths(),
        skips,
    )
    where = "pathkernels.sample_paths"
    for name, values in {
        "num_samples": (("negative", -1), ("float", 2.5), ("str", "3"), ("None", None), ("huge", 10**15)),
        "length": (("negative", -1), ("huge", 4), ("float", 1.0), ("str", "1")),
        "generator": (("str", "seed"), ("int", 0), ("list", [0])),
        "replace": (("str", "no"), ("int", 0)),
    }.items():
        for kind, value in values:
            args = {"num_layers": 3, "num_heads": 2, "num_samples": 4, "skip": True, name: value}
            refused(where, name, kind, name, lambda a=args: pk.sample_paths(**a))
    refused(
        where,
        "num_samples",
        "huge",
        "more distinct paths than there are",
        lambda: pk.sample_paths(3, 2, 28, skip=True, replace=False),
    )
    gives(where, "num_samples", "zero", "num_samples", lambda: pk.sample_paths(3, 2, 0).shape, lambda: (0, 3))
    where = "pathkernels.PathTree.from_paths"
    for kind, value in (
        ("empty", []),
        ("empty", torch.zeros(0, 3, dtype=torch.long)),
        ("float", torch.zeros(2, 3)),
        ("bool", torch.zeros(2, 3, dtype=torch.bool)),
        ("complex", torch.zeros(2, 3, dtype=torch.complex64)),
        ("negative", torch.tensor([[-2, 0, 1]])),
        ("drop a dim", torch.tensor([0, 1, 2])),
        ("str", "paths"),
        ("None", None),
        ("list", [[0, 1], [0]]),
        ("meta", torch.zeros(2, 3, dtype=torch.long, device="meta")),
    ):
        refused(where, ("paths", "heads"), kind, "paths", lambda v=value: pk.PathTree.from_paths(v))
    for kind, value in (("negative", -1), ("float", 2.0), ("str", "3"), ("zero", 0)):
        refused(where, "num_heads", kind, "num_heads", lambda v=value: pk.PathTree.from_paths([[0, 1]], num_heads=v))
    refused(where, "heads", "huge", "a head beyond num_heads", lambda: pk.PathTree.from_paths([[0, 5]], num_heads=2))
    listed = torch.tensor([[0, -1], [1, 1]])
    gives(
        where,
        "paths",
        "list",
        "paths as lists",
        lambda: pk.PathTree.from_paths(listed.tolist()).paths(),
        lambda: listed,
    )
    repeated = torch.tensor([[0, 1]]).expand(3, 2)
    gives(
        where, "paths", "stride 0", "paths", lambda: pk.PathTree.from_paths(repeated).paths(), lambda: repeated.clone()
    )
    where = "pathkernels.PathTree.leaf_paths"
    for kind, value in (
        ("float", torch.tensor([0.0])),
        ("negative", torch.tensor([-1])),
        ("huge", torch.tensor([9])),
        ("str", "0"),
        ("list", [0]),
        ("drop a dim", torch.tensor(0)),
    ):
        refused(where, "leaves", kind, "leaves", lambda v=value: TREE.leaf_paths(v))


tree_cases()


# --- results' methods and files -----------------------------------------------------------------------


def result_cases():
    stats = pk.path_statistics(ATTN, TREE, top_k=2)
    where = "pathkernels.PathStatistics.top"
    for name, values in {
        "k": (("negative", -1), ("huge", 3), ("float", 1.0), ("str", "1")),
        "length": (("negative", -1), ("huge", 3), ("float", 1.0), ("str", "1")),
        "batch_element": (("negative", -1), ("huge", 2), ("float", 0.0), ("str", "0")),
    }.items():
        for kind, value in values:
            refused(where, name, kind, name, lambda n=name, v=value: stats.top(**{n: v}))
    gives(where, "k", "zero", "k", lambda: stats.top(0), lambda: [])
    refused("pathkernels.PathStatistics.quantiles", "histograms", "str", "measure", lambda: stats.quantiles("norm"))
    where = "pathkernels.PathStatistics.load"
    good = FOLDER / "stats.pt"
    stats.save(good)
    intact = good.read_bytes()
    for label, content in (
        ("truncated", intact[: len(intact) // 2]),
        ("a flipped bit", intact[:-10] + bytes([intact[-10] ^ 1]) + intact[-9:]),
        ("empty", b""),
        ("not sealed", b"\x80\x04K\x01."),
    ):
        path = FOLDER / f"{label}.pt"
        path.write_bytes(content)
        refused(where, "cannot be used", "file", label, lambda p=path: pk.PathStatistics.load(p))
    refused(where, "cannot read", "file", "missing file", lambda: pk.PathStatistics.load(FOLDER / "missing.pt"))
    refused(where, "cannot read", "file", "a folder", lambda: pk.PathStatistics.load(FOLDER))
    resealed = FOLDER / "resealed.pt"
    state = read_sealed(good, "", "", "")
    state["counts"] = state["counts"] * 2
    write_sealed(resealed, state)
    # Doubled counts contradict the sums, the histograms and the top: whichever is checked first.
    refused(
        where,
        ("counts", "sums", "histograms"),
        "file",
        "counts doubled and sealed again",
        lambda: pk.PathStatistics.load(resealed),
    )
    gives(where, "file", "file", "intact", lambda: pk.PathStatistics.load(good).counts, lambda: stats.counts)
    for where, method in (
        ("pathkernels.PathStatistics.plot", lambda p: stats.plot(path=p)),
        ("pathkernels.PathDecomposition.plot", lambda p: pk.decompose(ATTN).plot(path=p)),
    ):
        refused(where, "path", "int", "path", lambda m=method: m(3))
    where = "pathkernels.PathStatistics.merge"
    refused(
        where,
        "batch",
        "shape",
        "statistics of another batch",
        lambda: stats.merge(pk.path_statistics(ATTN[:1], TREE, top_k=2)),
    )
    refused(
        where,
        "top_k",
        "shape",
        "statistics of another top_k",
        lambda: stats.merge(pk.path_statistics(ATTN, TREE, top_k=1)),
    )
    refused(where, "other", "str", "other", lambda: stats.merge("stats"))


result_cases()


def argument_and_file_cases():
    """Arguments that were taken as valid, counts and ranges beyond use, and statistics files edited
    consistently (refused now by recomputing their recorded paths)."""
    # decompose: two arguments that contradict each other, and refusals in its own name
    where = "pathkernels.decompose"
    skip_tree = pk.PathTree.complete(L, H, skip=True)
    refused(
        where,
        ("max_length", "tree"),
        "shape",
        "tree with max_length",
        lambda: pk.decompose(ATTN, tree=skip_tree, max_length=1),
    )
    refused(
        where,
        ("skip", "tree"),
        "bool",
        "skip=False with a skip tree",
        lambda: pk.decompose(ATTN, skip=False, tree=skip_tree),
    )
    refused(
        where,
        ("max_length", "skip"),
        "zero",
        "skip=False, max_length=1",
        lambda: pk.decompose(ATTN, skip=False, max_length=1),
    )
    refused(
        where,
        ("max_length", "skip"),
        "zero",
        "skip=False, max_length=1, strata",
        lambda: pk.decompose(ATTN, skip=False, max_length=1, samples_per_length=2),
    )
    refused(
        where, "samples_per_length", "empty", "samples_per_length={}", lambda: pk.decompose(ATTN, samples_per_length={})
    )
    refused(where, "skip", "huge", "skip=10**5000", lambda: pk.decompose(ATTN, skip=10**5000))
    big = torch.softmax(torch.zeros(1, 12, 12, 3, 3, dtype=torch.float64), -1)
    refused(
        where,
        "num_samples",
        "huge",
        "a sample beyond memory (named sample_paths)",
        lambda: pk.decompose(big, num_samples=10**12, max_paths=10**13),
    )
    bare = pk.PathTree.complete(L, H)
    gives(
        where,
        "tree",
        "bool",
        "skip=False with a tree without skips",
        lambda: pk.decompose(ATTN, skip=False, tree=bare).results.residual,
        lambda: ref_residuals(ATTN, tree=bare)[0],
    )
    # counts: consistent, quick, and their messages written whatever their size
    where = "pathkernels.count_paths"
    gives(where, "max_length", "zero", "no skip, max_length < L", lambda: pk.count_paths(3, 2, max_length=1), lambda: 0)
    refused(where, "num_layers", "huge", "6·10^7 layers of 3 heads", lambda: pk.count_paths(6 * 10**7, 3))
    refused(where, "num_layers", "huge", "num_layers=10**5000", lambda: pk.count_paths(10**5000, 2))
    gives(
        where,
        "max_length",
        "huge",
        "2^31 - 1 layers, max_length=1",
        lambda: pk.count_paths(2**31 - 1, 3, skip=True, max_length=1),
        lambda: 1 + 3 * (2**31 - 1),
    )
    refused(
        "pathkernels.count_by_length",
        "num_layers",
        "huge",
        "a list of 2^31 counts",
        lambda: pk.count_by_length(2**31 - 1, 3, skip=True, max_length=1),
    )
    refused("pathkernels.PathTree.complete", "paths", "huge", "10^6000 paths", lambda: pk.PathTree.complete(3000, 100))
    gives(
        "pathkernels.PathTree.complete",
        "num_heads",
        "huge",
        "2^31 - 1 heads, max_length=0",
        lambda: pk.PathTree.complete(3, 2**31 - 1, skip=True, max_length=0).paths(),
        lambda: torch.full((1, 3), -1),
    )
    refused(
        "pathkernels.sample_paths",
        "num_samples",
        "huge",
        "num_samples=10**5000",
        lambda: pk.sample_paths(3, 2, 10**5000),
    )
    # ranges of a tree
    tree = pk.PathTree.complete(3, 2, skip=True)
    for method in ("path_range", "leaf_range", "leaf_lengths"):
        where = f"pathkernels.PathTree.{method}"
        call = getattr(tree, method)
        for kind, (start, stop), argument in (
            ("huge", (0, 10**6), "stop"),
            ("negative", (-3, 2), "start"),
            ("float", (0.5, 2), "start"),
            ("None", (0, None), "stop"),
            ("bool", (True, 2), "start"),
        ):
            refused(where, argument, kind, f"{method}({start!r}, {stop!r})", lambda c=call, a=start, b=stop: c(a, b))
    gives(
        "pathkernels.PathTree.path_range",
        "stop",
        "zero",
        "an empty range",
        lambda: tree.path_range(3, 3).shape,
        lambda: (0, 3),
    )
    where = "pathkernels.PathTree.from_paths"
    refused(where, "heads", "huge", "a head of 2^62", lambda: pk.PathTree.from_paths([[2**62, 0]]))
    refused(where, "num_heads", "huge", "num_heads=2^62", lambda: pk.PathTree.from_paths([[1, 0]], num_heads=2**62))
    # statistics' methods
    stats = pk.path_statistics(ATTN, TREE, top_k=2)
    where = "pathkernels.PathStatistics.quantiles"
    for kind, q in (("huge", [1.5]), ("negative", [-0.1]), ("nan", [NAN]), ("str", "0.5"), ("None", [None])):
        refused(where, "q", kind, "q", lambda v=q: stats.quantiles(q=v))
    for method in ("measured", "mean", "std"):
        refused(
            f"pathkernels.PathStatistics.{method}",
            "measure",
            "str",
            "measure",
            lambda m=method: getattr(stats, m)("bogus"),
        )
        refused(
            f"pathkernels.PathStatistics.{method}",
            "measure",
            "None",
            "measure",
            lambda m=method: getattr(stats, m)(None),
        )
    refused(
        "pathkernels.PathStatistics.merge",
        "skip",
        "bool",
        "statistics of a tree without skip",
        lambda: stats.merge(pk.path_statistics(ATTN, pk.PathTree.complete(L, H), top_k=2)),
    )
    for method in ("by_length", "plot"):
        for kind, value in (("huge", 5), ("negative", -1), ("float", 1.0), ("str", "0")):
            refused(
                f"pathkernels.PathStatistics.{method}",
                "batch_element",
                kind,
                "batch_element",
                lambda m=method, v=value: getattr(stats, m)(batch_element=v),
            )
    refused("pathkernels.PathStatistics.to", "device", "str", "device", lambda: stats.to("bogus"))
    where = "pathkernels.PathStatistics.save"
    for kind, path in (
        ("empty", ""),
        ("file", FOLDER),
        ("file", FOLDER / "missing" / "s.pt"),
        ("int", 3),
        ("None", None),
    ):
        refused(where, "path", kind, f"path {str(path)[-12:]!r}", lambda p=path: stats.save(p))
    refused("pathkernels.PathStatistics.load", "path", "None", "path", lambda: pk.PathStatistics.load(None))
    # statistics checked against their inputs: a loaded file, verify, a resumed checkpoint
    other = torch.softmax(torch.randn(B, L, H, N, N, generator=_G, dtype=torch.float64), -1)
    saved_stats = FOLDER / "verified.pt"
    stats.save(saved_stats)
    gives(
        "pathkernels.PathStatistics.load",
        "attn",
        "file",
        "with its own inputs",
        lambda: pk.PathStatistics.load(saved_stats, ATTN).top_values,
        lambda: stats.top_values,
    )
    refused(
        "pathkernels.PathStatistics.load",
        "argmin",
        "file",
        "with another input",
        lambda: pk.PathStatistics.load(saved_stats, other),
    )
    refused(
        "pathkernels.PathStatistics.verify",
        ("argmin", "argmax", "top_values"),
        "file",
        "another input",
        lambda: stats.verify(other),
    )
    refused("pathkernels.PathStatistics.verify", ("attn", "attention"), "str", "attn", lambda: stats.verify("attn"))
    where = "pathkernels.path_statistics"
    for label, edit in (
        ("minima × 0.99", lambda statistics: [v.mul_(0.99) for v in statistics["minima"].values()]),
        (
            "another input's statistics",
            lambda statistics: statistics.update(pk.path_statistics(other, TREE, top_k=2).state()),
        ),
    ):
        refused(
            where,
            ("argmin", "argmax", "top_values"),
            "file",
            f"checkpoint with {label}",
            lambda e=edit: statistics_resumed_edited(e),
        )
    existing = FOLDER / "a-file"
    existing.write_bytes(b"x")
    for kind, label, checkpoint in (
        ("empty", "checkpoint ''", ""),
        ("file", "checkpoint an existing file", existing),
        ("file", "checkpoint under a file", existing / "sub"),
        ("file", "checkpoint unwritable", "/proc/pathkernels-sweep"),
    ):
        refused(where, "checkpoint", kind, label, lambda c=checkpoint: pk.path_statistics(ATTN, TREE, checkpoint=c))
    refused(where, "top_k", "huge", "top_k beyond memory", lambda: pk.path_statistics(ATTN, TREE, top_k=10**12))
    # the metrics, and a stack's w_path
    gives(
        "pathkernels.metrics.token_cosine_similarity",
        "eps",
        "huge",
        "eps=0.5 below a token's norm",
        lambda: pk.metrics.token_cosine_similarity(
            torch.tensor([[3.0, 0.0], [1.6, 0.0]], dtype=torch.float64), eps=0.5
        ),
        lambda: torch.tensor(1.0, dtype=torch.float64),
    )
    from pathkernels.adapters.stack import AttentionStack

    stack = AttentionStack(attn=ATTN, w_v=W_V, w_o=W_O, b_o=B_O)
    where = "pathkernels.AttentionStack.w_path"
    for kind, path in (
        ("float", [0.5, -1]),
        ("bool", [True, -1]),
        ("str", ["1", -1]),
        ("float", torch.tensor([0.0, 1.0])),
    ):
        refused(where, "path", kind, "path", lambda p=path: stack.w_path(p))
    refused(where, "path", "huge", "a head beyond the heads", lambda: stack.w_path([0, 2]))
    # float64 attention rows must sum to 1 within 1e-8 (a row off by 1e-5 is refused)
    off = ATTN.clone()
    off[1, 1, 0, 2] *= 1 + 1e-5
    for where, call in (
        ("pathkernels.path_residuals", lambda: pk.path_residuals(off, TREE)),
        ("pathkernels.length_sums", lambda: pk.length_sums(off, X, W_V, W_O)),
    ):
        refused(where, "attention rows", "huge", "a float64 row summing to 1 + 1e-5", call)


def statistics_resumed_edited(edit):
    """A finished checkpoint of ATTN's statistics (top 2), its statistics edited and sealed again,
    resumed."""
    folder = Path(tempfile.mkdtemp(dir=FOLDER))
    pk.path_statistics(ATTN, TREE, top_k=2, checkpoint=folder)
    state = read_sealed(folder / "rank0-of-1.pt", "", "", "")
    edit(state["statistics"])
    write_sealed(folder / "rank0-of-1.pt", state)
    return pk.path_statistics(ATTN, TREE, top_k=2, checkpoint=folder)


argument_and_file_cases()


# --- the adapters and the analysis on a tiny GPT-2 ----------------------------------------------------------

try:
    import transformers
except ImportError:  # the adapter cases are left out
    transformers = None


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=8, vocab_size=20, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).double().eval()


def adapter_cases():
    if transformers is None:
        return
    model = tiny_gpt2()
    ids = torch.tensor([[1, 5, 7, 3]])
    words = ("input_ids", "token", "positions")
    for where, adapter in (
        ("pathkernels.adapters.from_huggingface", pk.adapters.from_huggingface),
        ("pathkernels.adapters.capture_huggingface_residual", pk.adapters.capture_huggingface_residual),
    ):
        for kind, value in (
            ("negative", torch.tensor([[1, -2, 3]])),
            ("huge", torch.tensor([[1, 20, 3]])),
            ("float", torch.tensor([[1.0, 2.0]])),
            ("bool", torch.tensor([[True, False]])),
            ("empty", torch.zeros(1, 0, dtype=torch.long)),
            ("extra dim", ids.unsqueeze(0)),
            ("str", "hello"),
            ("list", [[1, 2, 3]]),
            ("huge", torch.zeros(1, 9, dtype=torch.long)),  # beyond n_positions
        ):
            refused(where, words, kind, "input_ids", lambda a=adapter, v=value: a(model, input_ids=v))
        refused(where, words, "meta", "input_ids", lambda a=adapter: a(model, input_ids=ids.to("meta")))
        for kind, value in (
            ("zero", torch.zeros(1, 4, dtype=torch.long)),
            ("shape", torch.ones(1, 5, dtype=torch.long)),
            ("nan", torch.full((1, 4), NAN)),
        ):
            call = lambda a=adapter, v=value: a(model, input_ids=ids, attention_mask=v)
            refused(where, ("attention_mask", "token_mask"), kind, "attention_mask", call)
        refused(
            where,
            "attention_mask",
            "str",
            "attention_mask",
            lambda a=adapter: a(model, input_ids=ids, attention_mask="all"),
        )
        refused(where, ("inputs", "input_ids"), "None", "no inputs", lambda a=adapter: a(model))
        refused(where, "model", "str", "model", lambda a=adapter: a("gpt2", input_ids=ids))
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids)
    logits = model(input_ids=ids).logits.detach()[0]
    where = "pathkernels.logit_diff"
    for name in ("a", "b"):
        for kind, value in (
            ("negative", -1),
            ("huge", 20),
            ("float", 1.0),
            ("str", "1"),
            ("None", None),
            ("bool", True),
        ):
            args = {"a": 1, "b": 2, name: value}
            refused(where, name, kind, name, lambda a=args: pk.logit_diff(model, **a))
    refused(where, "model", "str", "model", lambda: pk.logit_diff("gpt2", 1, 2))
    where = "pathkernels.to_single_token"
    refused(where, "text", "str", "text", lambda: pk.to_single_token(model, " the"))  # no tokenizer
    refused(where, "text", "int", "text", lambda: pk.to_single_token(model, 5))
    where = "pathkernels.logit"
    for kind, value in (("negative", -1), ("huge", 20), ("float", 1.0), ("str", "1")):
        refused(where, "token", kind, "token", lambda v=value: pk.logit(model, v))
    readout = pk.logit_diff(model, 1, 2)
    attribution = pk.path_attribution(stack, readout, top_k=3)
    for kind, k in (("negative", -1), ("zero", 0), ("float", 2.0)):
        refused("pathkernels.PathAttribution.plot", "k", kind, "k", lambda v=k: attribution.plot(v))
    for method in ("table", "to_frame"):
        for kind, value in (("huge", 1), ("negative", -1), ("float", 0.0)):
            refused(
                f"pathkernels.PathAttribution.{method}",
                "position",
                kind,
                "position",
                lambda m=method, v=value: getattr(attribution, m)(position=v),
            )
    where = "pathkernels.batch_attribution"
    gives(
        where,
        "readout",
        "list",
        "one readout per element",
        lambda: pk.batch_attribution(stack, [readout], top_k=2).mean.value[0, 0],
        lambda: logits[-1, 1] - logits[-1, 2],
    )
    for name, values in {
        "readout": (("list", [readout, readout]), ("str", "logit"), ("None", None)),
        "batch": (("huge", [1]), ("negative", [-1]), ("empty", []), ("int", 0), ("str", "all")),
        "positions": (("huge", [[4]]), ("list", [[1], [2]]), ("str", "1")),
        "top_k": (("negative", -1), ("float", 2.0)),
        "memory_budget": (("zero", 0), ("float", 1e9)),
    }.items():
        for kind, bad in values:
            call = (
                (lambda b=bad: pk.batch_attribution(stack, b))
                if name == "readout"
                else (lambda n=name, b=bad: pk.batch_attribution(stack, readout, **{n: b}))
            )
            refused(where, name, kind, name, call)
    where = "pathkernels.path_attribution"
    value = lambda r: r.value[0, 0]
    own = lambda: logits[-1, 1] - logits[-1, 2]
    gives(
        where,
        "positions",
        "negative",
        "positions=-1",
        lambda: value(pk.path_attribution(stack, readout, positions=-1)),
        own,
    )
    for name, values in {
        "positions": (("huge", 4), ("negative", -5), ("float", 1.0), ("str", "1")),
        "batch": (("huge", 1), ("negative", -1), ("float", 0.0)),
        "max_length": (("huge", 3), ("negative", -1), ("float", 1.0)),
        "top_k": (("negative", -1), ("float", 2.0), ("str", "3")),
        "memory_budget": (("zero", 0), ("negative", -1), ("float", 1e9)),
        "progress": (("str", "yes"), ("int", 1)),
        "tree": (("str", "tree"), ("shape", pk.PathTree.complete(3, 2, skip=True))),
    }.items():
        for kind, bad in values:
            refused(where, name, kind, name, lambda n=name, b=bad: pk.path_attribution(stack, readout, **{n: b}))
    for kind, direction in (
        ("nan", torch.full((8,), NAN, dtype=torch.float64)),
        ("shape", torch.ones(7, dtype=torch.float64)),
        ("complex", torch.ones(8, dtype=torch.complex128)),
        ("str", "logit"),
        ("None", None),
    ):
        refused(where, "readout", kind, "readout", lambda d=direction: pk.path_attribution(stack, d))
    meta = torch.ones(8, dtype=torch.float64, device="meta")
    refused(where, "readout", "meta", "readout", lambda: pk.path_attribution(stack, meta))
    ones = torch.ones(8, dtype=torch.float64)
    integer = lambda: value(pk.path_attribution(stack, torch.ones(8, dtype=torch.long)))
    gives(
        where,
        "readout",
        "int",
        "integer direction (exact in float64)",
        integer,
        lambda: value(pk.path_attribution(stack, ones)),
    )
    plain = pk.adapters.from_huggingface(model, input_ids=ids)
    refused(where, "residual_capture", "type", "a stack without a capture", lambda: pk.path_attribution(plain, readout))
    where = "pathkernels.top_paths"
    for name, values in {
        "k": (("zero", 0), ("negative", -1), ("float", 2.0), ("str", "3")),
        "position": (("huge", 4), ("list", [1, 2]), ("float", 1.0)),
        "time_limit": (("negative", -1), ("zero", 0), ("nan", NAN), ("str", "5")),
        "batch_nodes": (("zero", 0), ("float", 10.0)),
        "bound": (("str", "tight"), ("None", None)),
        "largest": (("str", "no"),),
    }.items():
        for kind, bad in values:
            refused(where, name, kind, name, lambda n=name, b=bad: pk.top_paths(stack, readout, **({"k": 3} | {n: b})))
    gives(where, "k", "huge", "k beyond the paths", lambda: len(pk.top_paths(stack, readout, 10**6).values), lambda: 17)
    where = "pathkernels.attribution_graph"
    transcoders = pk.adapters.random_transcoders(model.config.n_layer, model.config.n_embd, 6)
    replaced, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    for name, values in {
        "position": (("huge", 99), ("float", 1.0), ("str", "1")),
        "batch": (("negative", -1), ("huge", 5)),
        "max_logits": (("zero", 0), ("float", 2.0)),
        "desired_logit_prob": (("zero", 0.0), ("nan", NAN), ("huge", 2.0), ("str", "0.9")),
        "max_feature_nodes": (("negative", -1), ("float", 1.5)),
        "memory_budget": (("zero", 0), ("negative", -5)),
        "logits": (("negative", [-1]), ("huge", [10**6]), ("empty", []), ("float", [1.5])),
    }.items():
        for kind, bad in values:
            refused(where, name, kind, name, lambda n=name, b=bad: pk.attribution_graph(replaced, **{n: b}))
    refused(where, "transcoders", "type", "a stack captured without transcoders", lambda: pk.attribution_graph(stack))
    where = "pathkernels.path_terms"
    embedding = lambda: pk.path_terms(stack, [[-1, -1]], [0])
    gives(
        where, "sources", "str", "sources by name", lambda: pk.path_terms(stack, [[-1, -1]], ["embedding"]), embedding
    )
    for name, values in {
        "paths": (
            ("huge", [[5, -1]]),
            ("negative", [[-3, -1]]),
            ("float", [[0.5, -1.0]]),
            ("shape", [[0]]),
            ("str", "paths"),
        ),
        "sources": (("huge", [99]), ("negative", [-1]), ("str", ["no such source"]), ("shape", [0, 0]), ("None", None)),
        "batch": (("huge", 1), ("negative", -1), ("float", 0.0)),
        "tokens": (("huge", [9]), ("float", [0.5]), ("str", "all")),
        "memory_budget": (("zero", 0), ("float", 1e9)),
    }.items():
        for kind, bad in values:
            args = {"paths": [[-1, -1]], "sources": [0], name: bad}
            words = ("sources", "source") if name == "sources" else name
            refused(where, words, kind, name, lambda a=args: pk.path_terms(stack, **a))
    # A term split where it passes a transcoder step (every path must take one there).
    for kind, bad in (("huge", 9), ("negative", -1), ("float", 0.5), ("str", "0"), ("no step", 0)):
        refused(
            where,
            "split_at",
            kind,
            "split_at",
            lambda b=bad: pk.path_terms(replaced, [[-1] * (2 * model.config.n_layer)], [0], split_at=b),
        )
    refused(
        where,
        "split_at",
        "type",
        "a capture without transcoders",
        lambda: pk.path_terms(stack, [[-1, -1]], [0], split_at=0),
    )
    # The causal check of a path into a feature.
    into = lambda **a: pk.causal_check(  # noqa: E731
        model, replaced, {"input_ids": ids}, [[-1] * (2 * model.config.n_layer)], [0], side="feature", layer=1, **a
    )
    for name, values in {
        "feature": (("huge", 10**6), ("negative", -1), ("float", 1.5), ("str", "0")),
        "token": (("huge", 9), ("float", 1.0)),
    }.items():
        for kind, bad in values:
            refused("pathkernels.causal_check", name, kind, name, lambda n=name, b=bad: into(**{"feature": 0, n: b}))
    scored, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids, query_key=True)
    refused(
        "pathkernels.adapters.capture_huggingface_residual",
        "query_key",
        "str",
        "query_key",
        lambda: pk.adapters.capture_huggingface_residual(model, input_ids=ids, query_key="yes"),
    )
    scores = {
        "pathkernels.score_decomposition": lambda **a: pk.score_decomposition(scored, **({"layer": 1, "head": 0} | a)),
        "pathkernels.score_decompositions": lambda **a: pk.score_decompositions(scored, **({"layer": 1} | a)),
        "pathkernels.score_pairs": lambda **a: pk.score_pairs(scored, **({"layer": 1, "head": 0, "key": 1} | a)),
        "pathkernels.score_attribution": lambda **a: pk.score_attribution(
            scored, **({"layer": 1, "head": 0, "key": 1} | a)
        ),
        "pathkernels.score_top_paths": lambda **a: pk.score_top_paths(
            scored, **({"layer": 1, "head": 0, "key": 1} | a)
        ),
        "pathkernels.top_score_pairs": lambda **a: pk.top_score_pairs(
            scored, **({"layer": 1, "head": 0, "key": 1} | a)
        ),
    }
    for where, call in scores.items():
        bad_values = {
            "layer": (("huge", 2), ("negative", -1), ("float", 1.0), ("str", "1")),
            "batch": (("huge", 1), ("float", 0.0)),
            "query": (("huge", 4), ("float", 3.0), ("list", [1, 2])),
        }
        if where != "pathkernels.score_decompositions":
            bad_values["head"] = (("huge", 2), ("negative", -3), ("None", None))
        else:
            bad_values["heads"] = (("huge", [0, 2]), ("str", "all"), ("empty", []))
        if where in (
            "pathkernels.score_pairs",
            "pathkernels.score_attribution",
            "pathkernels.score_top_paths",
            "pathkernels.top_score_pairs",
        ):
            bad_values["key"] = (("huge", 9), ("float", 1.5), ("None", None))
        if where in ("pathkernels.score_pairs", "pathkernels.score_attribution"):
            bad_values["top_k"] = (("negative", -1), ("str", "5"))
        if where == "pathkernels.score_top_paths":
            bad_values |= {
                "k": (("zero", 0), ("str", "3")),
                "time_limit": (("negative", -1), ("nan", NAN)),
                "bound": (("str", "tight"),),
                "side": (("str", "both"),),
                "max_length": (("huge", 3), ("negative", -1)),
            }

        if where in ("pathkernels.score_decomposition", "pathkernels.score_decompositions"):
            bad_values["keys"] = (("huge", [9]), ("empty", []), ("str", "all"))
        if where == "pathkernels.score_attribution":
            bad_values["side"] = (("str", "value"), ("None", None))
        if where == "pathkernels.top_score_pairs":
            bad_values |= {
                "k": (("zero", 0), ("float", 2.0)),
                "time_limit": (("negative", -1), ("nan", NAN), ("str", "5")),
                "bound": (("str", "node"), ("None", None)),
                "memory_budget": (("zero", 0),),
                "batch_nodes": (("zero", 0),),
                "largest": (("str", "no"),),
            }
        for name, values in bad_values.items():
            words = ("heads", "head") if name == "heads" else name
            for kind, bad in values:
                refused(where, words, kind, name, lambda c=call, n=name, b=bad: c(**{n: b}))
    gives(
        "pathkernels.score_decomposition",
        "keys",
        "tensor",
        "keys as a tensor",
        lambda: pk.score_decomposition(scored, 1, 0, keys=torch.tensor([0, 2])).scores,
        lambda: pk.score_decomposition(scored, 1, 0, keys=[0, 2]).model_scores,
    )
    gives(
        "pathkernels.score_pairs",
        "query",
        "negative",
        "the last token as -1",
        lambda: torch.tensor(pk.score_pairs(scored, 1, 1, query=-1, key=0).score),
        lambda: torch.tensor(pk.score_pairs(scored, 1, 1, query=3, key=0).model_score),
    )
    refused(
        "pathkernels.score_decomposition",
        "stack",
        "type",
        "a stack without queries and keys",
        lambda: pk.score_decomposition(stack, 1, 0),
    )
    where = "pathkernels.causal_check"
    check = lambda **a: pk.causal_check(  # noqa: E731
        model,
        scored,
        a.pop("inputs", {"input_ids": ids}),
        a.pop("paths", [[0, -1]]),
        a.pop("sources", [0]),
        **({"layer": 1, "head": 0, "key": 1} | a),
    )
    for name, values in {
        "side": (("str", "value"), ("None", None)),
        "layer": (("huge", 2), ("negative", -1), ("float", 1.0)),
        "head": (("huge", 2), ("str", "0")),
        "key": (("huge", 9), ("float", 1.0)),
        "query": (("huge", 9),),
        "batch": (("huge", 1), ("float", 0.0)),
        "frozen": (("str", "yes"),),
        "position": (("huge", 9), ("float", 2.0)),
        "paths": (("huge", [[5, -1]]), ("shape", [[0]]), ("above", [[-1, 1]])),
        "sources": (("str", ["no such source"]), ("huge", [99])),
        "readout": (("shape", torch.ones(3, dtype=torch.float64)), ("nan", torch.full((8,), NAN))),
        "inputs": (("type", ids),),
    }.items():
        for kind, bad in values:
            words = ("sources", "source") if name == "sources" else ("paths", "path") if name == "paths" else name
            if name == "position":
                call = lambda b=bad: check(position=b, readout=torch.ones(8, dtype=torch.float64))  # noqa: E731
            else:
                call = lambda n=name, b=bad: check(**{n: b})  # noqa: E731
            refused(where, words, kind, name, call)


adapter_cases()


# --- the command line -------------------------------------------------------------------------------

SMALL = ["--layers", "1", "--heads", "1", "--width", "8", "--tokens", "3"]
# (command, option, kind, argv, builds a model); in process, but for the first two. The cases that get as
# far as building a model need the packages that attribute imports, and are skipped where they are missing.
CLI = [
    ("attribute", "--time-limit", "nan", ["attribute", "--time-limit", "nan"], False),
    ("paths", "--model", "file", ["paths", "--model", "{damaged config}"], False),
    ("attribute", "--target", "huge", ["attribute", *SMALL, "--target", "1000"], True),
    ("attribute", "--layers", "zero", ["attribute", "--layers", "0"], False),
    ("attribute", "--time-limit", "negative", ["attribute", "--time-limit", "-1"], False),
    ("attribute", "--time-limit", "inf", ["attribute", "--time-limit", "inf"], False),
    ("attribute", "--position", "huge", ["attribute", *SMALL, "--position", "9"], True),
    ("attribute", "--versus", "str", ["attribute", *SMALL, "--versus", "word"], True),
    ("attribute", "--model", "file", ["attribute", "--model", "/nonexistent/model"], True),
    ("attribute", "--layers", "huge", ["attribute", "--layers", "4000", "--width", "8192"], False),
    ("paths", "--tokens", "float", ["paths", "--tokens", "2.5"], False),
    ("paths", "--tokens", "huge", ["paths", "--tokens", "100000", "--layers", "2", "--heads", "1"], False),
    ("paths", "--model", "file", ["paths", "--model", "{empty folder}"], False),
    ("collapse", "--width", "negative", ["collapse", "--width", "-8"], False),
    ("collapse", "--out", "file", ["collapse", "--out", "/proc/x"], False),
    ("bench", "--out", "file", ["bench", "--out", "/"], False),
    ("scores", "--layer", "huge", ["scores", "--layer", "99"], False),
    ("scores", "--head", "negative", ["scores", "--head", "-1"], False),
    ("scores", "--key", "huge", ["scores", *SMALL, "--key", "7"], False),
    ("scores", "--versus", "str", ["scores", *SMALL, "--versus", "first"], False),
    ("graph", "--transcoders", "file", ["graph", "--model", "gpt2_4l", "--transcoders", "/nonexistent"], False),
    (
        "graph",
        "--node-threshold",
        "huge",
        ["graph", "--model", "gpt2_4l", "--transcoders", ".", "--node-threshold", "2"],
        False,
    ),
    ("graph", "--transcoders", "None", ["graph", "--model", "gpt2_4l"], False),
]


def cli_argv(argv):
    damaged_config = FOLDER / "config.json"
    damaged_config.write_text('{"model_type": "gpt2", "n_layer": ')
    empty = FOLDER / "empty-model"
    empty.mkdir(exist_ok=True)
    return [{"{damaged config}": str(damaged_config), "{empty folder}": str(empty)}.get(a, a) for a in argv]


def run_cli(argv, subprocess_run: bool, builds_model: bool = False):
    """The command line's refusal (exit code 2, one line on stderr) raised as a ValueError of that
    line; anything else as a RuntimeError."""
    if builds_model:
        for package in ("pandas", "transformers"):
            pytest.importorskip(package)
    argv = cli_argv(argv)
    if subprocess_run:
        python = [sys.executable, *(["-S"] if sys.flags.no_site else [])]  # as this interpreter runs
        run = subprocess.run([*python, "-m", "pathkernels", *argv], capture_output=True, text=True, timeout=120)
        code, err = run.returncode, run.stderr
    else:
        from pathkernels.app.cli import main

        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code
        err = stderr.getvalue()
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    if code == 2 and len(lines) == 1:
        raise ValueError(lines[0])
    raise RuntimeError(f"exit code {code}: {err[-500:]}")


for _i, (_command, _option, _kind, _argv, _builds) in enumerate(CLI):
    refused(f"pathkernels {_command}", _option, _kind, _option, lambda a=_argv, s=_i < 2, b=_builds: run_cli(a, s, b))


# --- the tests ---------------------------------------------------------------------------------------


def test_the_sweep_covers_every_public_function_and_every_class():
    called = {case.where for case in CASES}
    public = {f"pathkernels.{name}" for name in pk.__all__ if callable(getattr(pk, name)) and name[0].islower()}
    public -= {"pathkernels.build_info"}
    public |= {f"pathkernels.metrics.{name}" for name in (*METRIC_REFERENCES, "escalation_rate")}
    public |= {f"pathkernels.compat.{name}" for name in pk.compat.__all__}
    public |= {"pathkernels.nn.DeEscalation", "pathkernels.PathTree.complete", "pathkernels.PathTree.from_paths"}
    public |= {f"pathkernels {command}" for command in ("attribute", "paths", "collapse", "scores", "bench", "graph")}
    if transformers is None:  # their cases need a captured model
        captured = ("path_attribution", "top_paths", "logit", "logit_diff", "path_terms", "causal_check")
        captured += ("to_single_token", "batch_attribution")
        captured += ("score_attribution", "score_decomposition", "score_decompositions", "score_pairs")
        captured += ("score_top_paths", "top_score_pairs", "attribution_graph")
        public -= {f"pathkernels.{name}" for name in captured}
    else:
        public |= {f"pathkernels.adapters.{name}" for name in ("from_huggingface", "capture_huggingface_residual")}
    assert public <= called, sorted(public - called)
    kinds = Counter(case.kind for case in CASES)
    for kind in ("nan", "inf", "zero", "empty", "huge", "negative", "int", "bool", "complex", "half", "meta"):
        assert kinds[kind] >= 10, kind
    for kind in ("stride 0", "drop a dim", "extra dim", "str", "None", "list", "float", "file"):
        assert kinds[kind] >= 10, kind
    assert len({case.id for case in CASES}) > 900


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=case.owed)) if case.owed else case
        for case in CASES
    ],
    ids=[f"{case.id}-{i}" for i, case in enumerate(CASES)],
)
def test_a_hostile_argument_gives_a_clear_error_or_the_right_number(case):
    assert outcome(case) == expected_outcome(case)


def test_a_missing_optional_package_is_named_with_the_extra_that_installs_it(monkeypatch, capsys):
    """attribute imports pandas and transformers when it runs; where one is missing (None in
    sys.modules blocks its import as absence does) the error names it and the extra of pyproject.toml
    that installs it, instead of an unexpected ModuleNotFoundError. Other modules stay unexpected."""
    from pathkernels.app.cli import OPTIONAL_PACKAGES, main

    argv = ["attribute", *SMALL]
    missing = [("pandas", "analysis")]
    try:
        import pandas  # noqa: F401

        missing.append(("transformers", "adapters"))  # reached only once pandas imports
    except ImportError:
        pass
    for package, extra in missing:
        assert OPTIONAL_PACKAGES[package] == (package, extra)
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, package, None)
            assert main(argv) == 1
        assert capsys.readouterr().err.splitlines() == [
            f"pathkernels attribute: needs the package {package}, which is not installed in this environment "
            f'(pip install {package}; pyproject.toml lists it in the extra "{extra}")'
        ]
    # The demo checks its packages before any work: a missing transformers (section 6) at once
    # (or whichever of its packages this environment lacks first: CI's CUDA venv has no pandas).
    import importlib.util

    from pathkernels.app.cli.demo import DEMO_PACKAGES

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "transformers" else real_find_spec(name, *args)

    missing = next(package for package in DEMO_PACKAGES if find_spec(package) is None)
    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", find_spec)
        started = time.perf_counter()
        assert main(["demo", "--quick", "--out", str(FOLDER / "demo")]) == 1
        assert time.perf_counter() - started < 10
    name, extra = OPTIONAL_PACKAGES[missing]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pathkernels demo: needs the package {missing}, which is not installed in this environment "
        f'(pip install {name}; pyproject.toml lists it in the extra "{extra}")'
    )


def totals() -> tuple[Counter, Counter]:
    """The sweep's outcomes: ``(by outcome, by (class, outcome))``."""
    by_outcome, by_kind = Counter(), Counter()
    for case in CASES:
        result = outcome(case).split(":")[0]
        by_outcome[result] += 1
        by_kind[case.kind, result] += 1
        if os.environ.get("PATHKERNELS_SWEEP_VERBOSE") and result != expected_outcome(case):
            sys.stdout.write(f"{case.id}: {outcome(case)}\n")
    return by_outcome, by_kind


if __name__ == "__main__":  # the totals for docs/RELIABILITY.md
    by_outcome, by_kind = totals()
    sys.stdout.write(f"{len(CASES)} cases: {dict(by_outcome)}\n")
    for kind in sorted({k for k, _ in by_kind}):
        sys.stdout.write(f"  {kind}: {dict((o, n) for (k, o), n in by_kind.items() if k == kind)}\n")
