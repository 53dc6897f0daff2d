"""The readout engine's ops (csrc/readout/readout.h): one step of the top-down readout trie.

``_readout_values`` gives each node's attribution through a source, ``rho_i K phi_iᵀ``;
``_readout_heads`` its children through each head, ``rho_i T_h`` and ``phi_i F_in[h] F_out[h]``.
Checked against float64 einsums of the formulas on random shapes, empty batches included; on the
CPU the bits must not depend on how the nodes are batched (path_attribution's chunks and top_paths'
batches rely on it); bad inputs are refused by name.
"""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pathkernels  # noqa: E402, F401  (registers the ops)

values_op = torch.ops.pathkernels._readout_values
heads_op = torch.ops.pathkernels._readout_heads
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_step(nodes, positions, readouts, tokens, features, heads, head_dim, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    rho, phi = draw(nodes, positions, tokens), draw(nodes, readouts, features)
    source, maps = draw(tokens, features), draw(heads, tokens, tokens)
    return rho, phi, source, maps, draw(heads, features, head_dim), draw(heads, head_dim, features)


shapes = st.tuples(
    st.integers(0, 300),  # nodes
    st.integers(1, 3),  # positions
    st.integers(1, 3),  # readouts
    st.integers(1, 20),  # tokens
    st.integers(1, 80),  # features
    st.integers(1, 4),  # heads
    st.integers(0, 12),  # head_dim (0: heads that write nothing)
    st.integers(0, 2**31 - 1),  # seed
)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_the_ops_compute_their_formulas(shape):
    rho, phi, source, maps, f_in, f_out = random_step(*shape)
    values = values_op(rho, phi, source)
    expected = torch.einsum("npi,id,nrd->npr", rho, source, phi)
    scale = torch.einsum("npi,id,nrd->npr", rho.abs(), source.abs(), phi.abs())  # what rounding is relative to
    assert values.shape == expected.shape and values.dtype == torch.float64
    assert bool(((values - expected).abs() <= 1e-13 * scale + 1e-300).all())
    rho_heads, phi_heads = heads_op(rho, phi, maps, f_in, f_out)
    torch.testing.assert_close(rho_heads, torch.einsum("npi,hij->hnpj", rho, maps), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(phi_heads, torch.einsum("nrd,hde,hef->hnrf", phi, f_in, f_out), rtol=1e-12, atol=1e-11)
    rho_alone, narrow = heads_op(rho, phi, maps, f_in)  # without feature_out: phi F_in[h]
    assert torch.equal(rho_alone, rho_heads)
    torch.testing.assert_close(narrow, torch.einsum("nrd,hde->hnre", phi, f_in), rtol=1e-12, atol=1e-12)


def test_heads_without_dimensions_write_zeros():
    """head_dim = 0 with feature_out: phi F_in[h] F_out[h] is an empty sum, 0. An empty feature_out
    has a null data pointer, which the kernel took for "no feature_out" and left the output
    unwritten (whatever memory held). Many calls, so that reused memory shows."""
    for seed in range(20):
        rho, phi, _, maps, f_in, f_out = random_step(5, 2, 3, 4, 6, 3, 0, seed)
        torch.randn(3 * 5 * 3 * 6, dtype=torch.float64).exp()  # leave non-zero memory behind
        rho_heads, phi_heads = heads_op(rho, phi, maps, f_in, f_out)
        assert phi_heads.shape == (3, 5, 3, 6) and torch.equal(phi_heads, torch.zeros_like(phi_heads))
        torch.testing.assert_close(rho_heads, torch.einsum("npi,hij->hnpj", rho, maps), rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(shapes, st.data())
def test_the_bits_do_not_depend_on_the_batch(shape, data):
    """Every node alone, or in any slice of the batch, gets the same bits as in the whole batch."""
    rho, phi, source, maps, f_in, f_out = random_step(*shape)
    values = values_op(rho, phi, source)
    rho_heads, phi_heads = heads_op(rho, phi, maps, f_in, f_out)
    start = data.draw(st.integers(0, rho.shape[0]))
    stop = data.draw(st.integers(start, rho.shape[0]))
    part = slice(start, stop)
    assert torch.equal(values_op(rho[part], phi[part], source), values[part])
    part_rho, part_phi = heads_op(rho[part], phi[part], maps, f_in, f_out)
    assert torch.equal(part_rho, rho_heads[:, part]) and torch.equal(part_phi, phi_heads[:, part])


@settings(max_examples=20, deadline=None)
@given(shapes, st.booleans())
def test_the_aten_form_other_devices_run_agrees_with_the_cpu_kernel(shape, with_output_factor):
    """The ops' ATen form (what CUDA runs, through cuBLAS) called on CPU tensors by redispatching
    to its dispatch key: the same results as the CPU kernel, to rounding."""
    rho, phi, source, maps, f_in, f_out = random_step(*shape)
    f_out = f_out if with_output_factor else None
    aten = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    values = values_op.default.redispatch(aten, rho, phi, source)
    scale = torch.einsum("npi,id,nrd->npr", rho.abs(), source.abs(), phi.abs())
    assert bool(((values - values_op(rho, phi, source)).abs() <= 1e-13 * scale + 1e-300).all())
    for got, expected in zip(
        heads_op.default.redispatch(aten, rho, phi, maps, f_in, f_out), heads_op(rho, phi, maps, f_in, f_out)
    ):
        assert got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_agrees_with_the_cpu():
    cpu = random_step(500, 2, 2, 16, 96, 6, 16, seed=1)
    cuda = [t.cuda() for t in cpu]
    torch.testing.assert_close(values_op(*cuda[:3]).cpu(), values_op(*cpu[:3]), rtol=1e-12, atol=1e-12)
    for got, expected in zip(heads_op(cuda[0], cuda[1], *cuda[3:]), heads_op(cpu[0], cpu[1], *cpu[3:])):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-12, atol=1e-12)


def test_opcheck_and_meta():
    rho, phi, source, maps, f_in, f_out = random_step(7, 2, 3, 5, 11, 3, 4, seed=0)
    torch.library.opcheck(values_op, (rho, phi, source))
    torch.library.opcheck(heads_op, (rho, phi, maps, f_in, f_out))
    meta = [t.to("meta") for t in (rho, phi, source, maps, f_in, f_out)]
    assert values_op(*meta[:3]).shape == (7, 2, 3)
    assert [t.shape for t in heads_op(meta[0], meta[1], *meta[3:])] == [(3, 7, 2, 5), (3, 7, 3, 11)]


DAMAGES = ["none", "float32", "int64", "bool", "complex", "meta", "shape", "rank", "non-contiguous"]


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(["values", "heads"]), st.integers(0, 5), st.sampled_from(DAMAGES))
def test_hostile_inputs_give_the_formula_or_an_error_naming_the_op(shape, op, which, damage):
    """One operand damaged at a time: each call either gives the float64 formula (a transposed,
    non-contiguous view is a valid input) or raises a ValueError / TypeError that names the op."""
    rho, phi, source, maps, f_in, f_out = random_step(*shape)
    operands = [rho, phi, source] if op == "values" else [rho, phi, maps, f_in, f_out]
    index = which % len(operands)
    t = operands[index]
    operands[index] = {
        "none": lambda: t,
        "float32": lambda: t.float(),
        "int64": lambda: t.long(),
        "bool": lambda: t > 0,
        "complex": lambda: t.to(torch.complex128),
        "meta": lambda: t.to("meta"),
        "shape": lambda: torch.cat([t, t[..., :1]], dim=-1),
        "rank": lambda: t[None],
        "non-contiguous": lambda: t.transpose(-1, -2).contiguous().transpose(-1, -2),
    }[damage]()
    name = "_readout_values" if op == "values" else "_readout_heads"
    # Valid: no damage, a strided view, or a wider feature_out (its d' is free).
    valid = damage in ("none", "non-contiguous") or (damage == "shape" and op == "heads" and index == 4)
    try:
        got = (values_op if op == "values" else heads_op)(*operands)
    except (ValueError, TypeError) as error:
        assert f"pathkernels.{name}: expected" in str(error), str(error)
        assert not valid, str(error)
        return
    assert valid, f"{name} accepted {damage} operand {index}"
    if op == "values":
        rho, phi, source = operands
        torch.testing.assert_close(got, torch.einsum("npi,id,nrd->npr", rho, source, phi), rtol=1e-10, atol=1e-10)
    else:
        rho, phi, maps, f_in, f_out = operands
        torch.testing.assert_close(got[0], torch.einsum("npi,hij->hnpj", rho, maps), rtol=1e-10, atol=1e-10)
        expected = torch.einsum("nrd,hde,hef->hnrf", phi, f_in, f_out)
        torch.testing.assert_close(got[1], expected, rtol=1e-10, atol=1e-9)


def test_bad_inputs_are_refused_by_name():
    rho, phi, source, maps, f_in, f_out = random_step(4, 1, 1, 5, 6, 2, 3, seed=0)
    cases = [
        (lambda: values_op(rho.float(), phi, source), TypeError, "_readout_values: expected rho in torch.float64"),
        (lambda: values_op(rho, phi[:3], source), ValueError, r"expected phi \[N, R, d\] with N = 4"),
        (lambda: values_op(rho, phi, source.T), ValueError, r"expected source \[n, d\] = \[5, 6\]"),
        (lambda: values_op(rho, phi, source.to("meta")), ValueError, "source and rho on the same device"),
        (lambda: heads_op(rho, phi, maps[:, :4], f_in, f_out), ValueError, r"expected token_maps \[H, n, n\]"),
        (lambda: heads_op(rho, phi, maps, f_in[:1], f_out), ValueError, r"expected feature_in \[H, d, e\] with H = 2"),
        (
            lambda: heads_op(rho, phi, maps, f_in, f_out[:, :2]),
            ValueError,
            r"feature_out \[H, e, d'\] with H = 2 and e = 3",
        ),
        (lambda: heads_op(rho[0], phi, maps, f_in, f_out), ValueError, r"expected rho \[N, P, n\]"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def real_model(family: str):
    """A model of test_real_models (which needs transformers; the op tests above do not)."""
    pytest.importorskip("transformers")
    import test_real_models

    return {
        "gpt2": lambda: test_real_models.gpt2(4, 4, 32),
        "llama": test_real_models.llama,
        "bert": test_real_models.bert,
    }[family]()


def canonical_order(result, heads: int):
    """The kept paths sorted by (heads as base-(H+1) digits, source): the walks visit them in
    different orders."""
    digits = (result.paths + 1) @ (heads + 1) ** torch.arange(result.paths.shape[1])
    return torch.argsort(digits * len(result.source_names) + result.path_sources)


@pytest.mark.parametrize("max_length", [None, 2])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_walk_on_the_engine_is_the_walk_in_plain_pytorch(family, max_length):
    """path_attribution on the engine (pre-norm: φ kept in each head's d_head coordinates) against
    the same trie in plain PyTorch with φ in d coordinates: every path's attribution, the sums and
    the top paths agree. With max_length = 2 some head children keep d coordinates and some low-rank
    nodes expand for their heads (too few share a basis): every branch of the walker runs."""
    from pathkernels.adapters.residual import capture_huggingface_residual
    from pathkernels.analysis.attribution import attribute, read_out
    from pathkernels.analysis.readout_trie import ReadoutSteps
    from pathkernels.reference import readout_expand_ref, readout_heads_ref, readout_values_ref

    model = real_model(family)
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 9)))
    readout = torch.randn(32, 2, dtype=torch.float64)
    setup = read_out(stack, readout, [3, 8], 0, max_length, "test")
    engine = attribute(setup, 7, 1 << 26)
    plain_steps = ReadoutSteps(readout_values_ref, readout_heads_ref, readout_expand_ref)
    plain = attribute(setup, 7, 1 << 26, steps=plain_steps, low_rank=False)
    engine_order, plain_order = canonical_order(engine, stack.num_heads), canonical_order(plain, stack.num_heads)
    assert torch.equal(engine.paths[engine_order], plain.paths[plain_order])
    scale = plain.attribution.abs().max()
    torch.testing.assert_close(
        engine.attribution[engine_order], plain.attribution[plain_order], rtol=0, atol=1e-12 * scale
    )
    torch.testing.assert_close(engine.by_source_length, plain.by_source_length, rtol=0, atol=1e-11 * scale)
    torch.testing.assert_close(engine.top_values, plain.top_values, rtol=0, atol=1e-12 * scale)
    torch.testing.assert_close(engine.bottom_values, plain.bottom_values, rtol=0, atol=1e-12 * scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_on_the_gpu_attributes_as_on_the_cpu():
    """path_attribution and top_paths walk on the capture's device (the ops' ATen form) and fold
    on the CPU: both give what the CPU model gives."""
    import pathkernels as pk
    from pathkernels.adapters.residual import capture_huggingface_residual

    model = real_model("gpt2")
    ids = torch.randint(0, 50, (1, 9))
    on_cpu, _ = capture_huggingface_residual(model, input_ids=ids)
    on_gpu, _ = capture_huggingface_residual(model.cuda(), input_ids=ids.cuda())
    readout = pk.logit_diff(model, 1, 2)
    cpu, gpu = pk.path_attribution(on_cpu, readout), pk.path_attribution(on_gpu, readout)
    torch.testing.assert_close(gpu.by_source_length, cpu.by_source_length, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(gpu.value, cpu.value, rtol=1e-9, atol=1e-9)
    assert torch.equal(gpu.top_paths, cpu.top_paths)
    found = pk.top_paths(on_gpu, readout, 5)
    assert found.certified and torch.equal(found.paths, cpu.top_paths[:5, 0, 0])
