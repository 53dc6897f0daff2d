"""Fuzz: the path functions on hostile inputs.

Each case starts from a valid network and applies none, one or two damages (a dtype the engine
does not take, a shape that is not [B, L, H, n, n], an empty size, NaN or inf, rows that do not
sum to 1, negative weights, the meta device, a tree of the wrong depth). A call must then either
give what an independent float64 reference gives (no damage) or raise ValueError or TypeError
whose message starts with the name of the function called: never a number from damaged input,
never another exception.

``make test`` runs a short profile; ``PATHKERNELS_FUZZ=long`` runs 2,000 cases per function.
"""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pathkernels as pk  # noqa: E402
from pathkernels.core.paths import MAX_SIZE  # noqa: E402
from pathkernels.reference import composite_norm_ref, path_products_ref, residual_norm_ref  # noqa: E402

EXAMPLES = 2000 if os.environ.get("PATHKERNELS_FUZZ") == "long" else 40
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

DAMAGES = (
    "integer dtype",
    "bool dtype",
    "complex dtype",
    "not square",
    "three dims",
    "no batch",
    "no heads",
    "nan",
    "inf",
    "row off by 10%",
    "negative weights",
    "meta device",
    "tree of the wrong depth",
)
FUNCTIONS = ("path_residuals", "decompose", "path_statistics", "length_sums", "rollout")


@st.composite
def cases(draw):
    """(function name, attn, x, w_v, w_o, tree, damages) with a valid network before damage."""
    batch, layers, heads, n, d = (draw(st.integers(1, 3)) for _ in range(5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    attn = torch.softmax(torch.randn(batch, layers, heads, n, n, generator=g, dtype=torch.float64), -1).to(dtype)
    x = torch.randn(batch, n, d, generator=g, dtype=torch.float64).to(dtype)
    w_v = torch.randn(layers, heads, d, d, generator=g, dtype=torch.float64).to(dtype)
    w_o = torch.randn(layers, heads, d, d, generator=g, dtype=torch.float64).to(dtype)
    tree = pk.PathTree.complete(layers, heads, skip=True)
    wanted = draw(st.lists(st.sampled_from(DAMAGES), max_size=2, unique=True))
    if draw(st.booleans()):
        wanted = []  # half the cases valid, so the comparisons run often
    name = draw(st.sampled_from(FUNCTIONS))
    damages = []
    for damage in wanted:
        if not applies(name, damage, attn):
            continue
        damages.append(damage)
        if damage == "integer dtype":
            attn = attn.to(torch.int64)
        elif damage == "bool dtype":
            attn = attn > 0.5
        elif damage == "complex dtype":
            attn = attn.to(torch.complex64)
        elif damage == "not square":
            attn = attn[..., :, : max(1, n - 1)] if n > 1 else attn.expand(*attn.shape[:-1], 2)
        elif damage == "three dims":
            attn = attn.reshape(-1, *attn.shape[-2:])
        elif damage == "no batch":
            attn = attn[:0]
        elif damage == "no heads":
            attn = attn[:, :, :0]
        elif damage in ("nan", "inf"):
            attn = attn.clone()
            attn.view(-1)[draw(st.integers(0, attn.numel() - 1))] = float(damage)
        elif damage == "row off by 10%":
            attn = attn.clone()
            attn[..., 0, :] *= 1.1
        elif damage == "negative weights":
            attn = attn.clone()
            attn[..., 0, 0] = -attn[..., 0, 0] - 0.5  # negative, and the row sums to 0.5 − 2a
        elif damage == "meta device":
            attn = attn.to("meta")
        elif damage == "tree of the wrong depth":
            tree = pk.PathTree.complete(layers + 1, heads, skip=True)
    return name, attn, x, w_v, w_o, tree, damages


def applies(name: str, damage: str, attn) -> bool:
    """Whether ``damage`` makes the call's input invalid: rollout takes no tree and normalises its
    rows itself, length_sums and rollout take no tree; value damages need a floating-point attn
    still holding values."""
    if damage == "tree of the wrong depth":
        return name in ("path_residuals", "decompose", "path_statistics")
    if damage == "row off by 10%" and name == "rollout":
        return False
    if damage in ("integer dtype", "bool dtype"):
        return not attn.is_complex()
    if damage in ("complex dtype", "nan", "inf", "row off by 10%", "negative weights"):
        return attn.is_floating_point() and attn.numel() > 0 and attn.device.type != "meta"
    return True


def call(name, attn, x, w_v, w_o, tree):
    if name == "path_residuals":
        return pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o).residual
    if name == "decompose":
        return pk.decompose(attn, tree=tree).results.residual
    if name == "path_statistics":
        stats = pk.path_statistics(attn, tree)
        return torch.cat([stats.sums["ratio"], stats.maxima["ratio"], stats.counts.double()], dim=1)
    if name == "length_sums":
        return pk.length_sums(attn, x, w_v, w_o)
    return pk.rollout(attn)


def reference(name, attn, x, w_v, w_o, tree):
    """The float64 answer from the formulas, on the inputs as the library computes them (half
    precision rows renormalised after the cast to float32, then to float64)."""
    attn, x, w_v, w_o = (t.double() for t in (attn, x, w_v, w_o))  # exact for every input dtype
    attn = attn / attn.sum(-1, keepdim=True)
    paths = tree.paths()
    if name == "path_residuals":
        return residual_norm_ref(path_products_ref(attn, paths, x, w_v, w_o))
    if name == "decompose":
        return residual_norm_ref(path_products_ref(attn, paths))
    if name == "path_statistics":
        products = path_products_ref(attn, paths)
        ratio = residual_norm_ref(products) / composite_norm_ref(products)
        lengths = tree.lengths()
        levels = range(attn.shape[1] + 1)
        sums = torch.stack([ratio[:, lengths == k].sum(1) for k in levels], dim=1)
        maxima = torch.stack([ratio[:, lengths == k].amax(1) for k in levels], dim=1)
        counts = torch.stack([(lengths == k).sum().double().expand(attn.shape[0]) for k in levels], dim=1)
        return torch.cat([sums, maxima, counts], dim=1)
    if name == "length_sums":
        return torch.stack(
            [path_products_ref(attn, paths[tree.lengths() == k], x, w_v, w_o).sum(1) for k in range(attn.shape[1] + 1)]
        )
    # rollout (mean fusion, residual, nothing discarded): R = Σ_p 2^-L H^-len(p) P_p over every
    # path with skip, the tree these cases draw.
    layers, heads = attn.shape[1], attn.shape[2]
    weights = 0.5**layers * (1.0 / heads) ** tree.lengths().double()
    return torch.einsum("bmij,m->bij", path_products_ref(attn, paths), weights)


TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-4, torch.bfloat16: 2e-4}
# rollout computes in the input's dtype (half precision too) and normalises F + I itself.
ROLLOUT_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@FUZZ
@given(cases())
def test_every_call_gives_the_reference_or_names_itself_in_its_error(case):
    name, attn, x, w_v, w_o, tree, damages = case
    try:
        got = call(name, attn, x, w_v, w_o, tree)
    except (ValueError, TypeError) as error:
        assert str(error).startswith(f"pathkernels.{name}"), (damages, str(error))
        # A valid network is never refused (a half-precision row may round out of 1e-2 only in
        # a pathological case these sizes cannot make).
        assert damages, str(error)
        return
    assert not damages, f"{name} gave a number from damaged input: {damages}"
    expected = reference(name, attn, x, w_v, w_o, tree)
    tolerance = (ROLLOUT_TOLERANCE if name == "rollout" else TOLERANCE)[attn.dtype]
    scale = expected.abs().amax().clamp_min(1.0)
    assert got.dtype in (torch.float32, torch.float64) or name == "rollout"
    assert got.shape == expected.shape, (got.shape, expected.shape)
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance * scale)


NORM_DAMAGES = ("one dim", "integer dtype", "bool dtype", "complex dtype", "no rows")
NORMS = {
    "residual_norm": (lambda x: pk.residual_norm(x), lambda x: residual_norm_ref(x.double())),
    "composite_norm": (lambda x: pk.composite_norm(x), lambda x: composite_norm_ref(x.double())),
}


@st.composite
def norm_cases(draw):
    """(op name, x, damages): x [..., n, m] with hostile values that are not damages (NaN and inf
    propagate, as in torch) and up to one damage that must be refused."""
    lead = draw(st.lists(st.integers(0, 3), max_size=2))
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = (torch.randn(*lead, n, m, generator=g, dtype=torch.float64) * 10 ** draw(st.integers(-3, 3))).to(dtype)
    if x.numel() and draw(st.booleans()):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), 0.0]))
    damages = draw(st.lists(st.sampled_from(NORM_DAMAGES), max_size=1))
    for damage in damages:
        if damage == "one dim":
            x = x.reshape(-1)
        elif damage == "integer dtype":
            x = x.nan_to_num().to(torch.int64)
        elif damage == "bool dtype":
            x = x > 0
        elif damage == "complex dtype":
            x = x.to(torch.complex64)
        else:
            x = x[..., :0, :]
    return draw(st.sampled_from(sorted(NORMS))), x, damages


@FUZZ
@given(norm_cases())
def test_the_norms_give_the_reference_or_name_themselves_in_their_error(case):
    name, x, damages = case
    op, ref = NORMS[name]
    try:
        got = op(x)
    except (ValueError, TypeError) as error:
        assert damages and str(error).startswith(f"pathkernels.{name}"), (damages, str(error))
        return
    assert not damages, f"{name} gave a number from damaged input: {damages}"
    expected = ref(x).to(got.dtype).double()  # rounded to the result's dtype, as the op rounds its float64 sums
    torch.testing.assert_close(got.double(), expected, equal_nan=True, **pk.testing.tolerance(got.dtype))


HOSTILE_INTS = st.one_of(
    st.integers(-3, 6),
    st.sampled_from([True, 2.0, "3", None, 10**30, float("nan")]),
)


@FUZZ
@given(
    st.sampled_from(["count_paths", "count_by_length", "PathTree.complete", "sample_paths"]),
    HOSTILE_INTS,
    HOSTILE_INTS,
    st.one_of(st.none(), HOSTILE_INTS),
    st.sampled_from([True, False, "no", 1]),
)
def test_tree_functions_count_exactly_or_name_themselves(name, layers, heads, max_length, skip):
    """Path counts and trees from hostile sizes: exact (checked by brute force where small) or a
    ValueError/TypeError in the function's own name, never a wrong count."""
    import itertools
    import math

    valid_size = lambda v: isinstance(v, int) and not isinstance(v, bool) and v <= MAX_SIZE  # noqa: E731
    valid = (
        valid_size(layers)
        and valid_size(heads)
        and layers >= 1
        and heads >= 1
        and (
            max_length is None or (isinstance(max_length, int) and not isinstance(max_length, bool) and max_length >= 0)
        )
        and isinstance(skip, bool)
    )
    try:
        if name == "count_paths":
            got = pk.count_paths(layers, heads, skip=skip, max_length=max_length)
        elif name == "count_by_length":
            got = pk.count_by_length(layers, heads, skip=skip, max_length=max_length)
        elif name == "PathTree.complete":
            got = pk.PathTree.complete(layers, heads, skip=skip, max_length=max_length)
        else:
            got = pk.sample_paths(layers, heads, 5, skip=skip, length=max_length)
    except (ValueError, TypeError) as error:
        assert str(error).startswith(f"pathkernels.{name}"), str(error)
        # Valid sizes are refused only for what they mean: no path, or too many to list or draw.
        assert not valid or name in ("PathTree.complete", "sample_paths"), str(error)
        return
    assert valid, f"{name} accepted {layers!r}, {heads!r}, {max_length!r}, {skip!r}"
    if name in ("count_paths", "count_by_length"):
        top = layers if max_length is None else min(max_length, layers)
        by_length = [
            (math.comb(layers, k) * heads**k if skip else (heads**layers if k == layers else 0)) if k <= top else 0
            for k in range(layers + 1)
        ]
        assert got == (sum(by_length) if name == "count_paths" else by_length)
        if layers <= 4 and heads <= 3:
            choices = ([-1] if skip else []) + list(range(heads))
            brute = [p for p in itertools.product(choices, repeat=layers) if sum(h >= 0 for h in p) <= top]
            assert sum(by_length) == len(brute)
    elif name == "PathTree.complete":
        assert got.num_paths == pk.count_paths(layers, heads, skip=skip, max_length=max_length)
        if layers <= 4 and heads <= 3:  # every path with at most max_length heads, in lexicographic order
            choices = ([-1] if skip else []) + list(range(heads))
            top = layers if max_length is None else max_length
            brute = [p for p in itertools.product(choices, repeat=layers) if sum(h >= 0 for h in p) <= top]
            assert got.paths().tolist() == [list(p) for p in brute]
    elif name == "sample_paths":
        assert got.shape == (5, layers) and int(got.max()) < heads and int(got.min()) >= (-1 if skip else 0)


def _integer_options() -> list[tuple[str, str, str, int, int | None]]:
    """(command, option, the type's wording, minimum, maximum or None) of every integer option of
    the command line (their types are named "an integer >= m" or "an integer in [m, M]")."""
    import argparse
    import re

    from pathkernels.app.cli import build_parser

    found = []
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                for option in sub._actions:
                    name = getattr(option.type, "__name__", "")
                    if match := re.fullmatch(r"an integer >= (-?\d+)", name):
                        found.append((command, option.option_strings[0], name, int(match[1]), None))
                    elif match := re.fullmatch(r"an integer in \[(-?\d+), (-?\d+)\]", name):
                        found.append((command, option.option_strings[0], name, int(match[1]), int(match[2])))
    assert len(found) >= 10, f"the command line's integer options were not found: {found}"
    return found


@FUZZ
@given(
    option=st.sampled_from(_integer_options()),
    text=st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(str),
        st.text(max_size=6),
    ),
)
def test_the_command_line_parses_an_integer_option_or_names_it(option, text):
    """Any text for an integer option either parses to an int at or above its minimum, or exits with
    status 2 and a message naming the option and the minimum (never a traceback)."""
    import contextlib
    import io

    from pathkernels.app.cli import build_parser

    command, flag, expected, minimum, maximum = option
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            required = {"graph": ["--transcoders", "."]}.get(command, [])  # a command's required options
            args = build_parser().parse_args([command, *required, f"{flag}={text}"])
    except SystemExit as exit:
        assert exit.code == 2
        assert f"{flag}: expected {expected}" in stderr.getvalue(), stderr.getvalue()
        return
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    assert isinstance(value, int) and value >= minimum and value == int(text)
    assert maximum is None or value <= maximum
