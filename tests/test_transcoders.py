"""Transcoder sets read from small files written here in each published layout (circuit-tracer's
per-layer and cross-layer sets, SAELens's transcoders, sparsify's), checked against literal float64
re-implementations of each format's own forward written from the raw tensors as the files hold
them; and every refusal names what is wrong."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("yaml")
pytest.importorskip("safetensors")

import yaml  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pathkernels.adapters import transcoders as tc  # noqa: E402
from pathkernels.adapters.transcoders import HOOKS, TranscoderSet, load_transcoders  # noqa: E402

D, F, L = 6, 10, 3  # width, features per layer, layers


def randn(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Literal references, from the tensors as the files hold them


def matvec(x, w_rows):
    """x [d] times the matrix whose rows are w_rows [n, d]: [n], one dot product at a time."""
    return torch.tensor([sum(float(a) * float(b) for a, b in zip(x, row)) for row in w_rows], dtype=torch.float64)


def top_k_gate(values, k):
    """1 for the k largest of one row (by a sort of the Python floats), 0 elsewhere."""
    order = sorted(range(len(values)), key=lambda i: -float(values[i]))
    gate = torch.zeros(len(values), dtype=torch.float64)
    gate[order[:k]] = 1
    return gate


def circuit_tracer_encode(raw, x, activation, k=None):
    """circuit-tracer: F.linear(x, W_enc [F, d], b_enc), then relu, x * (x > threshold), or TopK of x."""
    pre = matvec(x, raw["W_enc"]) + raw["b_enc"]
    if activation == "relu":
        return torch.where(pre > 0, pre, torch.zeros_like(pre))
    if activation == "jumprelu":
        return pre * (pre > raw["activation_function.threshold"]).double()
    return pre * top_k_gate(pre, k)


def circuit_tracer_forward(raw, x, activation, k=None):
    acts = circuit_tracer_encode(raw, x, activation, k)
    out = matvec(acts, raw["W_dec"].T) + raw["b_dec"]
    if "W_skip" in raw:
        out = out + matvec(x, raw["W_skip"])  # x @ W_skip.T
    return out


def saelens_forward(raw, cfg, x):
    """SAELens Transcoder: normalise, x @ W_enc [d, F] + b_enc, relu (jumprelu: relu(x) * (x > t)),
    @ W_dec + b_dec, plus x @ W_skip.T for a skip-transcoder (the raw x)."""
    xn = x
    if cfg["normalize_activations"] == "constant_norm_rescale":
        xn = x * math.sqrt(cfg["d_in"]) / math.sqrt(sum(float(v) ** 2 for v in x))
    pre = matvec(xn, raw["W_enc"].T) + raw["b_enc"]
    acts = torch.where(pre > 0, pre, torch.zeros_like(pre))
    if "threshold" in raw:
        acts = acts * (pre > raw["threshold"]).double()
    out = matvec(acts, raw["W_dec"].T) + raw["b_dec"]
    if "W_skip" in raw:
        out = out + matvec(x, raw["W_skip"])
    return acts, out


def sparsify_forward(raw, k, x):
    """sparsify transcoder: relu(F.linear(x, encoder.weight, encoder.bias)), its k largest kept,
    @ W_dec + b_dec, plus x @ W_skip.T."""
    pre = matvec(x, raw["encoder.weight"]) + raw["encoder.bias"]
    pre = torch.where(pre > 0, pre, torch.zeros_like(pre))
    acts = pre * top_k_gate(pre, k)
    out = matvec(acts, raw["W_dec"].T) + raw["b_dec"]
    if "W_skip" in raw:
        out = out + matvec(x, raw["W_skip"])
    return acts, out


# ------------------------------------------------------------------------------------------------
# Writers, one per layout


def write_circuit_tracer(folder, seed=0, layers=L, threshold=False, skip=False, k=None, config=None, dtype=None):
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    raws = {}
    for layer in range(layers):
        raw = {"W_enc": randn(g, F, D), "W_dec": randn(g, F, D), "b_enc": randn(g, F), "b_dec": randn(g, D)}
        if threshold:
            raw["activation_function.threshold"] = randn(g, F).abs() * 0.5
        if skip:
            raw["W_skip"] = randn(g, D, D)
        if k is not None:
            raw["k"] = torch.tensor(k)
        stored = {key: v.to(dtype) if dtype is not None and v.is_floating_point() else v for key, v in raw.items()}
        save_file({key: v.contiguous() for key, v in stored.items()}, str(folder / f"layer_{layer}.safetensors"))
        raws[layer] = {key: v.double() for key, v in stored.items()}
    cfg = {
        "model_kind": "transcoder_set",
        "feature_input_hook": "hook_resid_mid",
        "feature_output_hook": "hook_mlp_out",
        **(config or {}),
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    return raws


def write_clt(folder, seed=1, layers=L, threshold=False):
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    raws = {}
    for i in range(layers):
        enc = {f"W_enc_{i}": randn(g, F, D), f"b_enc_{i}": randn(g, F), f"b_dec_{i}": randn(g, D)}
        if threshold:
            enc[f"threshold_{i}"] = randn(g, F).abs() * 0.5
        dec = {f"W_dec_{i}": randn(g, F, layers - i, D)}
        save_file(enc, str(folder / f"W_enc_{i}.safetensors"))
        save_file(dec, str(folder / f"W_dec_{i}.safetensors"))
        raws[i] = {**enc, **dec}
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "hook_resid_mid"}
    config["feature_output_hook"] = "hook_mlp_out"
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return raws


def write_saelens(
    folder, layer, seed=2, architecture="transcoder", normalize="none", hook="ln2.hook_normalized", width_out=D, **extra
):
    g = torch.Generator().manual_seed(seed + layer)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"W_enc": randn(g, D, F), "b_enc": randn(g, F), "W_dec": randn(g, F, width_out), "b_dec": randn(g, width_out)}
    if architecture == "jumprelu_transcoder":
        raw["threshold"] = randn(g, F) * 0.5  # negative thresholds too: relu(x) * (x > t) differs from x * (x > t)
    if architecture == "skip_transcoder":
        raw["W_skip"] = randn(g, width_out, D)
    save_file(raw, str(folder / "sae_weights.safetensors"))
    cfg = {
        "architecture": architecture,
        "d_in": D,
        "d_sae": F,
        "d_out": width_out,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": False,
        "normalize_activations": normalize,
        "reshape_activations": "none",
        "metadata": {
            "model_name": "tiny",
            "hook_name": f"blocks.{layer}.{hook}",
            "hook_name_out": f"blocks.{layer}.hook_mlp_out",
            "sae_lens_version": "6.18.0",
        },
        **extra,
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return raw, cfg


def write_sparsify(folder, seed=3, k=3, skip=True, **cfg_extra):
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"encoder.weight": randn(g, F, D), "encoder.bias": randn(g, F), "W_dec": randn(g, F, D), "b_dec": randn(g, D)}
    if skip:
        raw["W_skip"] = randn(g, D, D)
    save_file(raw, str(folder / "sae.safetensors"))
    cfg = {
        "activation": "topk",
        "expansion_factor": 32,
        "normalize_decoder": True,
        "num_latents": F,
        "k": k,
        "multi_topk": False,
        "skip_connection": skip,
        "transcode": True,
        "d_in": D,
        **cfg_extra,
    }
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return raw


def inputs(seed=10, n=5):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Each layout against its literal forward


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_circuit_tracer_per_layer_set_matches_its_forward(tmp_path, activation):
    config = {"activation": "topk", "k": 3} if activation == "topk" else {}
    raws = write_circuit_tracer(tmp_path, threshold=activation == "jumprelu", skip=True, config=config)
    ts = load_transcoders(tmp_path, num_layers=L, d_model=D)
    assert ts.layout == "circuit-tracer" and not ts.cross_layer and ts.layers == (0, 1, 2)
    assert (ts.input_hook, ts.output_hook) == ("resid_mid", "mlp_output")
    assert set(ts.activation.values()) == {activation}
    x = inputs()
    for layer in ts.layers:
        raw = raws[layer]
        acts = ts.encode(layer, x)
        for row in range(len(x)):
            expected = circuit_tracer_encode(raw, x[row], activation, 3)
            torch.testing.assert_close(acts[row], expected, rtol=1e-12, atol=1e-12)
            expected = circuit_tracer_forward(raw, x[row], activation, 3)
            torch.testing.assert_close(ts.forward(layer, x)[row], expected, rtol=1e-12, atol=1e-12)
        if activation == "topk":
            assert ((acts != 0).sum(-1) == 3).all()
    assert ts.decode(0, ts.encode(0, x)).keys() == {0}
    assert ts.w_enc[0].shape == (D, F) and ts.w_dec[0][0].shape == (F, D) and ts.w_skip[0].shape == (D, D)


def test_circuit_tracer_topk_k_from_the_file_and_config_list_of_files(tmp_path):
    raws = write_circuit_tracer(tmp_path / "files", k=4, config={"activation": "topk"})
    config = {
        "model_name": "tiny",
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "transcoders": [{"id": f"t{i}", "layer": i, "filepath": f"files/layer_{i}.safetensors"} for i in range(L)],
        "activation": "topk",
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    ts = load_transcoders(tmp_path)
    assert ts.k == {0: 4, 1: 4, 2: 4} and (ts.input_hook, ts.output_hook) == ("mlp_input", "mlp_module_output")
    x = inputs(11)
    for row in range(len(x)):
        expected = circuit_tracer_encode(raws[1], x[row], "topk", 4)
        torch.testing.assert_close(ts.encode(1, x)[row], expected, rtol=1e-12, atol=1e-12)


def test_circuit_tracer_topk_keeps_negative_values_and_sparsify_does_not(tmp_path):
    """circuit-tracer's TopK gates x itself (a negative value among the k largest stays);
    sparsify's takes the k largest of relu(x)."""
    write_circuit_tracer(tmp_path / "ct", k=3, config={"activation": "topk"})
    write_sparsify(tmp_path / "sp" / "layers.0.mlp", k=3)
    ct, sp = load_transcoders(tmp_path / "ct"), load_transcoders(tmp_path / "sp")
    x = -20 * torch.ones(1, D, dtype=torch.float64)
    ct.b_enc[0] = -torch.arange(1.0, F + 1, dtype=torch.float64)  # every pre-activation negative
    ct.w_enc[0] = torch.zeros(D, F, dtype=torch.float64)
    acts = ct.encode(0, x)
    assert acts[0, :3].tolist() == [-1.0, -2.0, -3.0] and (acts[0, 3:] == 0).all()
    sp.w_enc[0], sp.b_enc[0] = ct.w_enc[0], ct.b_enc[0]
    assert (sp.encode(0, x) == 0).all()


def test_jumprelu_gates_are_strict_and_saelens_rectifies(tmp_path):
    """Both formats keep x where x > threshold, not x >= threshold (integers: no round-off); SAELens
    then applies relu (relu(x) * (x > t)), circuit-tracer does not (x * (x > t))."""
    write_circuit_tracer(tmp_path / "ct", threshold=True, layers=1)
    write_saelens(tmp_path / "sl", 0, architecture="jumprelu_transcoder")
    ct, sl = load_transcoders(tmp_path / "ct"), load_transcoders(tmp_path / "sl")
    w = torch.zeros(D, F, dtype=torch.float64)
    w[0] = torch.tensor([1, 2, -1, 3, 0, 1, -2, 1, 1, 0], dtype=torch.float64)
    x = torch.zeros(1, D, dtype=torch.float64)
    x[0, 0] = 2
    pre = torch.tensor([2, 4, -2, 6, 0, 2, -4, 2, 2, 0], dtype=torch.float64)
    threshold = torch.tensor([2, 3, -3, 6, -1, 1, -5, 3, 2.5, 0], dtype=torch.float64)
    for ts in (ct, sl):
        ts.w_enc[0], ts.b_enc[0], ts.threshold[0] = w, torch.zeros(F, dtype=torch.float64), threshold
        assert torch.equal(ts.pre_activations(0, x)[0], pre)
    strict = pre * (pre > threshold).double()
    assert torch.equal(ct.encode(0, x)[0], strict)
    assert torch.equal(sl.encode(0, x)[0], strict.clamp_min(0))
    assert ct.encode(0, x)[0, 2] == -2 and sl.encode(0, x)[0, 2] == 0  # x=-2 > t=-3
    assert ct.encode(0, x)[0, 0] == 0 and ct.encode(0, x)[0, 3] == 0  # x == t: off


def test_circuit_tracer_cross_layer_set_writes_into_every_later_layer(tmp_path):
    raws = write_clt(tmp_path, threshold=True)
    ts = load_transcoders(tmp_path, num_layers=L, d_model=D)
    assert ts.cross_layer and ts.activation == {0: "jumprelu", 1: "jumprelu", 2: "jumprelu"}
    assert {layer: sorted(ts.w_dec[layer]) for layer in ts.layers} == {0: [0, 1, 2], 1: [1, 2], 2: [2]}
    xs = {layer: inputs(20 + layer, 4) for layer in range(L)}
    for target in range(L):
        out = ts.forward(target, xs)
        for row in range(4):
            expected = raws[target][f"b_dec_{target}"].clone()
            for i in range(target + 1):
                raw = {
                    "W_enc": raws[i][f"W_enc_{i}"],
                    "b_enc": raws[i][f"b_enc_{i}"],
                    "activation_function.threshold": raws[i][f"threshold_{i}"],
                }
                acts = circuit_tracer_encode(raw, xs[i][row], "jumprelu")
                expected += matvec(acts, raws[i][f"W_dec_{i}"][:, target - i, :].T)
            torch.testing.assert_close(out[row], expected, rtol=1e-12, atol=1e-12)
    stacked = torch.stack([xs[i] for i in range(L)])
    torch.testing.assert_close(ts.forward(2, stacked), ts.forward(2, xs), rtol=0, atol=0)
    writes = ts.decode(1, ts.encode(1, xs[1]))
    assert sorted(writes) == [1, 2]


@pytest.mark.parametrize("architecture", ["transcoder", "skip_transcoder", "jumprelu_transcoder"])
def test_saelens_transcoders_match_their_forward(tmp_path, architecture):
    raws = {}
    for layer in range(L):
        raws[layer] = write_saelens(tmp_path / f"blocks.{layer}.ln2", layer, architecture=architecture)
    ts = load_transcoders(tmp_path, num_layers=L, d_model=D)
    assert ts.layout == "saelens" and ts.layers == (0, 1, 2) and ts.model_name == "tiny"
    assert (ts.input_hook, ts.output_hook) == ("mlp_input_before_gain", "mlp_output")
    x = inputs(30)
    for layer in ts.layers:
        raw, cfg = raws[layer]
        for row in range(len(x)):
            acts, out = saelens_forward(raw, cfg, x[row])
            torch.testing.assert_close(ts.encode(layer, x)[row], acts, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ts.forward(layer, x)[row], out, rtol=1e-12, atol=1e-12)


def test_saelens_constant_norm_rescale_applies_to_the_input_only(tmp_path):
    raw, cfg = write_saelens(tmp_path, 1, architecture="skip_transcoder", normalize="constant_norm_rescale")
    ts = load_transcoders(tmp_path)
    assert ts.layers == (1,) and ts.input_normalization == "constant_norm_rescale"
    x = 7 * inputs(31)
    for row in range(len(x)):
        acts, out = saelens_forward(raw, cfg, x[row])
        torch.testing.assert_close(ts.forward(1, x)[row], out, rtol=1e-12, atol=1e-12)


def test_sparsify_topk_skip_transcoders_match_their_forward(tmp_path):
    raws = {layer: write_sparsify(tmp_path / f"layers.{layer}.mlp", seed=40 + layer, k=3) for layer in range(L)}
    ts = load_transcoders(tmp_path, model=SimpleNamespace(cfg=SimpleNamespace(n_layers=L, d_model=D)))
    assert ts.layout == "sparsify" and ts.k == {0: 3, 1: 3, 2: 3}
    assert (ts.input_hook, ts.output_hook) == ("mlp_input", "mlp_module_output")
    x = inputs(41)
    for layer in ts.layers:
        for row in range(len(x)):
            acts, out = sparsify_forward(raws[layer], 3, x[row])
            torch.testing.assert_close(ts.encode(layer, x)[row], acts, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ts.forward(layer, x)[row], out, rtol=1e-12, atol=1e-12)


def test_hooks_a_file_does_not_name_are_given(tmp_path):
    raw, cfg = write_saelens(tmp_path, 0)
    del cfg["metadata"]["hook_name_out"]
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    ts = load_transcoders(tmp_path, output_hook="mlp_output")
    assert (ts.input_hook, ts.output_hook, ts.source_hooks) == (
        "mlp_input_before_gain",
        "mlp_output",
        ("blocks.{l}.ln2.hook_normalized", None),
    )


def test_float32_files_are_read_in_the_dtype_asked_for(tmp_path):
    raws = write_circuit_tracer(tmp_path, dtype=torch.float32)
    ts = load_transcoders(tmp_path)
    assert ts.dtype == torch.float64 and torch.equal(ts.w_enc[2], raws[2]["W_enc"].T)
    assert load_transcoders(tmp_path, dtype=torch.float32).dtype == torch.float32


def test_repr_is_one_line_and_hooks_are_described(tmp_path):
    write_circuit_tracer(tmp_path, threshold=True, skip=True)
    text = repr(load_transcoders(tmp_path))
    assert "\n" not in text and "circuit-tracer" in text and "jumprelu" in text and "skip" in text, text
    assert "resid_mid -> mlp_output" in text
    assert set(tc._TL_HOOKS.values()) <= set(HOOKS)
    assert isinstance(load_transcoders(tmp_path), TranscoderSet)


def test_fits_hugging_face_and_transformer_lens_models(tmp_path):
    write_circuit_tracer(tmp_path)
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=L, n_embd=D, n_head=2)
    load_transcoders(tmp_path, model=config)
    ts = load_transcoders(tmp_path, model=SimpleNamespace(config=config))
    with pytest.raises(ValueError, match=r"model: .*layer_0\.safetensors reads d_in=6 wide vectors; .*width is 8"):
        ts.check_fits(transformers.GPT2Config(n_layer=L, n_embd=8, n_head=2))
    with pytest.raises(ValueError, match=r"model: .*layers \[3\] have none"):
        ts.check_fits(SimpleNamespace(cfg=SimpleNamespace(n_layers=4, d_model=D)))
    ts.check_fits(num_layers=4, d_model=D, require_all_layers=False)
    with pytest.raises(ValueError, match="model: cannot read its layer count"):
        ts.check_fits(object())


# ------------------------------------------------------------------------------------------------
# Refusals, each by name, before any weight is read


@pytest.fixture
def no_weights_read(monkeypatch):
    def refuse(self, entry):
        raise AssertionError(f"a weight was read: {entry.key}")

    monkeypatch.setattr(tc._Reader, "__call__", refuse)


def test_a_set_that_does_not_fit_is_refused_before_any_weight_is_read(tmp_path, no_weights_read):
    write_circuit_tracer(tmp_path / "ct")
    write_clt(tmp_path / "clt")
    with pytest.raises(ValueError, match=r"d_model: .*layer_0\.safetensors reads d_in=6 .*width is 7"):
        load_transcoders(tmp_path / "ct", d_model=7)
    with pytest.raises(ValueError, match=r"num_layers/d_model: .*layer_2\.safetensors is for layer 2; the model has 2"):
        load_transcoders(tmp_path / "ct", num_layers=2)
    with pytest.raises(ValueError, match=r"layers \[3, 4\] have none .*require_all_layers=False"):
        load_transcoders(tmp_path / "ct", num_layers=5)
    with pytest.raises(ValueError, match=r"W_enc_0\.safetensors .*cross-layer set of 3 layers; the model has 4"):
        load_transcoders(tmp_path / "clt", num_layers=4, require_all_layers=False)


def test_an_output_width_that_does_not_fit_is_refused(tmp_path, no_weights_read):
    write_saelens(tmp_path, 0, architecture="skip_transcoder", width_out=D + 2)
    with pytest.raises(
        ValueError, match=r"d_model: .*sae_weights\.safetensors writes d_out=8 wide vectors; .*width is 6"
    ):
        load_transcoders(tmp_path, d_model=D)


def test_missing_keys_files_and_layers_are_named(tmp_path, no_weights_read):
    write_circuit_tracer(tmp_path / "a")
    save_file(
        {"W_enc": torch.zeros(F, D), "W_dec": torch.zeros(F, D), "b_dec": torch.zeros(D)},
        str(tmp_path / "a" / "layer_1.safetensors"),
    )
    with pytest.raises(ValueError, match=r"folder: .*layer_1\.safetensors has no 'b_enc' \(encoder bias\)"):
        load_transcoders(tmp_path / "a")
    write_circuit_tracer(tmp_path / "b")
    (tmp_path / "b" / "layer_1.safetensors").unlink()
    with pytest.raises(ValueError, match=r"transcoders for layers \[0, 2\]; layers \[1\] have none"):
        load_transcoders(tmp_path / "b")
    write_clt(tmp_path / "c")
    (tmp_path / "c" / "W_dec_1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"W_dec_1\.safetensors does not exist"):
        load_transcoders(tmp_path / "c")
    with pytest.raises(ValueError, match="holds no transcoder set: looked for config.yaml"):
        load_transcoders(tmp_path / "a" / "..")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_transcoders(tmp_path / "nowhere")


def test_shapes_dtypes_and_orientation_are_named(tmp_path, no_weights_read):
    raws = write_circuit_tracer(tmp_path / "a", layers=1)
    save_file(
        {**{k: v.contiguous() for k, v in raws[0].items()}, "W_enc": raws[0]["W_enc"].T.contiguous()},
        str(tmp_path / "a" / "layer_0.safetensors"),
    )
    with pytest.raises(
        ValueError,
        match=r"layer_0\.safetensors: W_enc is \[6, 10\], expected \[F, d_in\] with F = 10 \(the length of b_enc\): "
        r"transposed\?",
    ):
        load_transcoders(tmp_path / "a")
    write_circuit_tracer(tmp_path / "b", layers=1)
    save_file(
        {**{k: v.contiguous() for k, v in raws[0].items()}, "b_dec": torch.zeros(D, dtype=torch.int64)},
        str(tmp_path / "b" / "layer_0.safetensors"),
    )
    with pytest.raises(ValueError, match=r"layer_0\.safetensors: b_dec has dtype I64, expected a floating-point dtype"):
        load_transcoders(tmp_path / "b")
    write_circuit_tracer(tmp_path / "c", layers=1)
    save_file(
        {**{k: v.contiguous() for k, v in raws[0].items()}, "W_gate": torch.zeros(2)},
        str(tmp_path / "c" / "layer_0.safetensors"),
    )
    with pytest.raises(ValueError, match=r"holds \['W_gate'\], which a circuit-tracer transcoder does not have"):
        load_transcoders(tmp_path / "c")
    with pytest.raises(ValueError, match="dtype: expected a floating-point torch dtype"):
        load_transcoders(tmp_path / "c", dtype=torch.int32)
    write_sparsify(tmp_path / "d" / "layers.0.mlp", k=F + 1)
    with pytest.raises(ValueError, match=r"TopK needs an int k in 1\.\.F=10, got 11"):
        load_transcoders(tmp_path / "d")


def test_configs_are_refused_by_name(tmp_path, no_weights_read):
    write_circuit_tracer(tmp_path / "a", config={"feature_input_hook": "blocks.0.mlp.hook_post"})
    with pytest.raises(ValueError, match=r"feature_input_hook names hook 'blocks\.0\.mlp\.hook_post'"):
        load_transcoders(tmp_path / "a")
    write_circuit_tracer(tmp_path / "b")
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump({"feature_output_hook": "hook_mlp_out"}))
    with pytest.raises(ValueError, match=r"config\.yaml has no 'feature_input_hook'"):
        load_transcoders(tmp_path / "b")
    config = {
        "feature_input_hook": "hook_resid_mid",
        "feature_output_hook": "hook_mlp_out",
        "transcoders": ["hf://org/repo/layer_0.safetensors"],
    }
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"transcoders\[0\] is on the hub .*no hub is reached here"):
        load_transcoders(tmp_path / "b")
    write_circuit_tracer(tmp_path / "c", config={"activation": "topk"})
    with pytest.raises(ValueError, match="TopK .* neither config.yaml nor the file gives k"):
        load_transcoders(tmp_path / "c")
    write_saelens(tmp_path / "d", 0, architecture="standard")
    with pytest.raises(ValueError, match=r"cfg\.json architecture is 'standard', .*not a transcoder"):
        load_transcoders(tmp_path / "d")
    write_saelens(tmp_path / "e", 0, apply_b_dec_to_input=True)
    with pytest.raises(ValueError, match=r"cfg\.json sets apply_b_dec_to_input"):
        load_transcoders(tmp_path / "e")
    write_saelens(tmp_path / "f", 0, d_out=D + 1)
    with pytest.raises(ValueError, match=r"cfg\.json says d_out=7, .*sae_weights\.safetensors holds 6"):
        load_transcoders(tmp_path / "f")
    raw, cfg = write_saelens(tmp_path / "g", 0)
    del cfg["metadata"]["hook_name_out"]
    (tmp_path / "g" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"hook_name_out \(or pass output_hook=\) names no hook"):
        load_transcoders(tmp_path / "g")
    write_sparsify(tmp_path / "h" / "layers.0.mlp", transcode=False)
    with pytest.raises(ValueError, match="transcode false: a sparsify autoencoder"):
        load_transcoders(tmp_path / "h")
    write_sparsify(tmp_path / "i" / "embed_tokens")
    with pytest.raises(ValueError, match=r"named 'embed_tokens'; sparsify names a folder by the module"):
        load_transcoders(tmp_path / "i")
    write_sparsify(tmp_path / "j" / "layers.0.mlp")
    with pytest.raises(ValueError, match=r"layout: 'sae' is not one of"):
        load_transcoders(tmp_path / "j", layout="sae")
    with pytest.raises(ValueError, match=r"input_hook: 'mlp_in' is not one of"):
        load_transcoders(tmp_path / "j", input_hook="mlp_in")
