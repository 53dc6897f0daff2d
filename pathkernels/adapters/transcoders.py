"""Transcoder sets as users hold them, read from a local folder into one :class:`TranscoderSet`.

A transcoder replaces an MLP by sparse features: it reads the MLP's input at layer ``l``, encodes
it into ``F_l`` features (ReLU, JumpReLU or TopK), and decodes them into the MLP's output; a
skip-transcoder adds a linear map of its input (``W_skip``), and a cross-layer transcoder's
feature of layer ``l`` writes into the MLP output of every layer ``t >= l``.

Three layouts, each read from its published source code (no hub is reached: a user passes a
folder), and detected from the files present (``layout=`` forces one):

- ``"circuit-tracer"`` (safety-research/circuit-tracer: ``circuit_tracer/transcoder/
  single_layer_transcoder.py``, ``cross_layer_transcoder.py``, ``activation_functions.py``,
  ``utils/hf_utils.py``, ``utils/caching.py``, ``configs/README.md``): a ``config.yaml`` naming
  ``feature_input_hook`` and ``feature_output_hook`` (TransformerLens hook names), ``model_kind``
  (``transcoder_set`` or ``cross_layer_transcoder``), optionally ``activation`` and ``k``, and
  ``transcoders`` (a list of files, or of ``{layer, filepath}``) or else ``layer_{i}.safetensors``.
  A per-layer file holds ``W_enc [F, d_in]`` (applied as ``F.linear``), ``W_dec [F, d_out]``,
  ``b_enc [F]``, ``b_dec [d_out]``, optionally ``activation_function.threshold`` (or
  ``threshold``) ``[F]`` (JumpReLU: ``x * (x > threshold)``), ``W_skip [d_out, d_in]`` (added as
  ``x @ W_skip.T``) and ``k`` (TopK: the ``k`` largest pre-activations kept, signs and all).
  Gemma Scope's ``params.npz`` (``W_enc [d_in, F]``, ``threshold``) and Gemma Scope 2's lower-case
  ``w_enc [d_in, F]``, ``w_dec``, ``threshold``, ``affine_skip_connection [d_in, d_out]`` are read
  as circuit-tracer's own loaders read them (always JumpReLU). A cross-layer set is split per
  layer: ``W_enc_{i}.safetensors`` with ``W_enc_{i} [F, d_in]``, ``b_enc_{i}``, ``b_dec_{i}`` (the
  bias of output layer ``i``) and optionally ``threshold_{i}``; ``W_dec_{i}.safetensors`` with
  ``W_dec_{i} [F, n_layers - i, d_out]`` (layer ``i``'s features into layers ``i..n_layers-1``).
- ``"saelens"`` (jbloomAus/SAELens: ``sae_lens/saes/transcoder.py``, ``sae_lens/saes/sae.py``,
  ``sae_lens/constants.py``, ``sae_lens/loading/pretrained_sae_loaders.py``): one folder per layer
  (or the folder itself) with ``cfg.json`` (``architecture`` one of ``transcoder``,
  ``skip_transcoder``, ``jumprelu_transcoder``; ``d_in``, ``d_sae``, ``d_out``;
  ``normalize_activations``; ``metadata.hook_name`` and ``metadata.hook_name_out``, or the same
  keys at the top level as older configs have them) and ``sae_weights.safetensors`` with
  ``W_enc [d_in, F]``, ``b_enc``, ``W_dec [F, d_out]``, ``b_dec [d_out]``, ``threshold [F]``
  (JumpReLU: ``relu(x) * (x > threshold)``) and ``W_skip [d_out, d_in]`` (``x @ W_skip.T``).
  SAELens refuses ``apply_b_dec_to_input`` for transcoders, and so does this reader.
- ``"sparsify"`` (EleutherAI/sparsify: ``sparsify/sparse_coder.py``, ``sparsify/config.py``,
  ``sparsify/fused_encoder.py``, ``sparsify/trainer.py``): one folder per hookpoint, named by the
  module it replaced (``layers.5.mlp``, ``h.5.mlp``, ...), with ``cfg.json`` (``d_in``, ``k``,
  ``num_latents`` or ``expansion_factor``, ``activation``, ``transcode``, ``skip_connection``) and
  ``sae.safetensors`` with ``encoder.weight [F, d_in]``, ``encoder.bias [F]``, ``W_dec [F, d_in]``,
  ``b_dec [d_in]`` and ``W_skip [d_in, d_in]`` (``x @ W_skip.T``). TopK of the rectified
  pre-activations; a transcoder (``transcode: true``) does not subtract ``b_dec`` from its input.

Every tensor is checked from the files' headers (names, shapes, dtypes) and, given a model (or
``num_layers`` and ``d_model``), against it, before any weight is read: a set that does not fit is
refused with a ValueError naming the argument, the file and what was expected against what was
found.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

LAYOUTS = ("circuit-tracer", "saelens", "sparsify")
ACTIVATIONS = ("relu", "jumprelu", "topk")

#: The normalised descriptions of where a transcoder reads and writes.
HOOKS = {
    "resid_pre": "the residual stream entering the block",
    "resid_mid": "the residual stream after attention, before the MLP's norm",
    "mlp_input": "the MLP's argument: its norm's output, the norm's weight and bias applied",
    "mlp_input_before_gain": (
        "the MLP's normalised input before its norm's weight and bias (TransformerLens's "
        "ln2.hook_normalized; the MLP's argument where the norm's weights are folded)"
    ),
    "mlp_output": "what the MLP sublayer adds to the residual stream (after a post-MLP norm, if any)",
    "mlp_module_output": "the MLP module's own output, before any post-MLP norm",
    "resid_post": "the residual stream leaving the block",
}

# TransformerLens hook names (the part after "blocks.{l}.") and what they are.
_TL_HOOKS = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_mlp_in": "resid_mid",  # TransformerLens fires it on resid_mid, before ln2
    "ln2.hook_normalized": "mlp_input_before_gain",
    "mlp.hook_in": "mlp_input",
    "hook_mlp_out": "mlp_output",
    "mlp.hook_out": "mlp_module_output",
    "hook_resid_post": "resid_post",
}
_SAELENS_ARCHITECTURES = {"transcoder": "relu", "skip_transcoder": "relu", "jumprelu_transcoder": "jumprelu"}
_SAELENS_NORMALISATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
_SAELENS_DTYPES = {"float32", "float64", "float16", "bfloat16"}
_SAELENS_DTYPES |= {f"torch.{name}" for name in _SAELENS_DTYPES}
_FLOAT_CODES = {"F16", "BF16", "F32", "F64", "float16", "float32", "float64"}


# ------------------------------------------------------------------------------------------------
# The set


@dataclass(eq=False)
class TranscoderSet:
    """Transcoders for some of a model's layers, in one orientation whatever the file's.

    For each source layer ``l`` in :attr:`layers` (``F_l`` features, ``d_in``/``d_out`` wide):

    - ``w_enc[l]``: ``[d_in, F_l]``; ``b_enc[l]``: ``[F_l]``; ``threshold[l]``: ``[F_l]`` or None;
    - ``w_dec[l][t]``: ``[F_l, d_out]``, for each target layer ``t`` the features write into: ``t ==
      l`` alone for a per-layer set, every ``t >= l`` of the set for a cross-layer one;
    - ``b_dec[t]``: ``[d_out]``, the decoder bias of output layer ``t`` (once per target, however
      many layers write into it);
    - ``w_skip[l]``: ``[d_in, d_out]`` or None (the skip term is ``x @ w_skip[l]``);
    - ``activation[l]`` in ``ACTIVATIONS`` and ``k[l]`` (TopK) or None.

    ``rectify``: the format clamps activations at 0 after the gate (SAELens's JumpReLU
    ``relu(x) * (x > threshold)``, sparsify's TopK of ``relu(x)``), or not (circuit-tracer's
    ``x * (x > threshold)`` and TopK of ``x``). ``input_normalization``: SAELens's
    ``normalize_activations`` applied to the input before encoding (``"none"`` elsewhere;
    ``"expected_average_only_in"`` is the identity, as in SAELens's own forward of a set loaded
    from disk). ``input_hook``/``output_hook``: keys of ``HOOKS``; ``source_hooks``: the names the
    files gave. ``sources[l]``: the file layer ``l`` came from. ``layout``: one of ``LAYOUTS``.
    No supported transcoder subtracts a bias from its input (SAELens refuses
    ``apply_b_dec_to_input`` for transcoders; sparsify subtracts ``b_dec`` from autoencoders only).
    """

    layout: str
    layers: tuple[int, ...]
    w_enc: dict[int, torch.Tensor]
    b_enc: dict[int, torch.Tensor]
    w_dec: dict[int, dict[int, torch.Tensor]]
    b_dec: dict[int, torch.Tensor]
    threshold: dict[int, torch.Tensor | None]
    w_skip: dict[int, torch.Tensor | None]
    activation: dict[int, str]
    k: dict[int, int | None]
    rectify: bool
    input_normalization: str
    input_hook: str
    output_hook: str
    source_hooks: tuple[str, str]
    cross_layer: bool
    sources: dict[int, str]
    model_name: str | None = None

    @property
    def d_in(self) -> int:
        return int(self.w_enc[self.layers[0]].shape[0])

    @property
    def d_out(self) -> int:
        return int(self.b_dec[self.layers[0]].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.w_enc[self.layers[0]].dtype

    def num_features(self, layer: int) -> int:
        return int(self.b_enc[self._layer(layer)].shape[0])

    def _layer(self, layer: int) -> int:
        if layer not in self.w_enc:
            raise ValueError(f"layer: this set has transcoders for layers {list(self.layers)}, not {layer!r}")
        return layer

    def _input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape[-1:] != (self.d_in,):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: layer {layer}'s transcoder reads [..., d_in={self.d_in}], got {shape}")
        return x.to(dtype=self.dtype, device=self.w_enc[layer].device)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_normalization == "constant_norm_rescale":
            return x * (self.d_in**0.5 / x.norm(dim=-1, keepdim=True))
        if self.input_normalization == "layer_norm":
            centred = x - x.mean(dim=-1, keepdim=True)
            return centred / (centred.std(dim=-1, keepdim=True) + 1e-5)
        return x

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[..., F]``: the encoder's affine map of the (normalised) input, before the gate."""
        layer = self._layer(layer)
        return self._normalise(self._input(layer, x)) @ self.w_enc[layer] + self.b_enc[layer]

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[..., F]``: the features' activations for ``x [..., d_in]`` read at layer ``layer``."""
        return self.activate(layer, self.pre_activations(layer, x))

    def activate(self, layer: int, pre: torch.Tensor) -> torch.Tensor:
        """``[..., F]``: the activations of pre-activations ``pre [..., F]`` at layer ``layer`` (the
        gate: ReLU, JumpReLU's threshold, TopK's k largest; then the format's clamp at 0). Every
        active feature passes its pre-activation unchanged: ``a_f = pre_f`` or 0."""
        layer = self._layer(layer)
        activation = self.activation[layer]
        if activation == "relu":
            return pre.clamp_min(0)
        if activation == "jumprelu":
            acts = pre * (pre > self.threshold[layer]).to(pre.dtype)
        else:
            values, indices = pre.topk(self.k[layer], dim=-1)
            acts = torch.zeros_like(pre).scatter(-1, indices, values)
        return acts.clamp_min(0) if self.rectify else acts

    def decode(self, layer: int, activations: torch.Tensor) -> dict[int, torch.Tensor]:
        """``{t: [..., d_out]}``: what layer ``layer``'s features write into each output layer
        ``t`` (the decoder weights only: :meth:`forward` adds the biases and the skip term)."""
        layer = self._layer(layer)
        return {target: activations.to(self.dtype) @ w for target, w in self.w_dec[layer].items()}

    def forward(self, layer: int, x) -> torch.Tensor:
        """``[..., d_out]``: the transcoders' output at layer ``layer``, as the format computes it.

        A per-layer set takes ``x [..., d_in]`` (its input at ``layer``); a cross-layer set the
        inputs of every layer up to ``layer`` (a mapping ``{layer: x}``, or a sequence or tensor
        indexed by layer), since every earlier layer's features write into it."""
        layer = self._layer(layer)
        inputs = x if isinstance(x, Mapping) or not isinstance(x, torch.Tensor) or self.cross_layer else {layer: x}
        sources = [s for s in self.layers if layer in self.w_dec[s]]
        out = self.b_dec[layer].clone()
        for source in sources:
            try:
                x_source = inputs[source]
            except (KeyError, IndexError) as error:
                raise ValueError(f"x: the output at layer {layer} needs the input of layer {source}") from error
            out = out + self.decode(source, self.encode(source, x_source))[layer]
        if self.w_skip[layer] is not None:
            out = out + self._input(layer, inputs[layer]) @ self.w_skip[layer]
        return out

    def check_fits(
        self, model: Any = None, *, num_layers: int | None = None, d_model: int | None = None, require_all_layers=True
    ) -> None:
        """Refuse (ValueError) a set that does not fit ``model`` (a Hugging Face model or config, a
        TransformerLens model or config) or ``num_layers``/``d_model``: its width, its layers."""
        _check_fits(
            self.layers, self.d_in, self.d_out, self.cross_layer, self.sources, model, num_layers, d_model,
            require_all_layers,
        )  # fmt: skip

    def __repr__(self) -> str:
        layers = self.layers
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        if list(layers) != list(range(layers[0], layers[-1] + 1)):
            span = ",".join(map(str, layers))
        widths = sorted({self.num_features(layer) for layer in layers})
        features = "/".join(map(str, widths))
        activations = sorted(set(self.activation.values()))
        ks = sorted({k for k in self.k.values() if k is not None})
        gate = "/".join(activations) + (f" k={'/'.join(map(str, ks))}" if ks else "")
        skip = ", skip" if any(w is not None for w in self.w_skip.values()) else ""
        norm = f", input {self.input_normalization}" if self.input_normalization != "none" else ""
        kind = "cross-layer" if self.cross_layer else "per-layer"
        return (
            f"TranscoderSet({self.layout}, {kind}, layers {span}, {features} features, {gate}{skip}{norm}, "
            f"{self.input_hook} -> {self.output_hook}, d_in={self.d_in} d_out={self.d_out}, "
            f"{str(self.dtype).replace('torch.', '')})"
        )


# ------------------------------------------------------------------------------------------------
# Fit to a model


def model_dimensions(model: Any = None, *, num_layers: int | None = None, d_model: int | None = None):
    """``(num_layers, d_model)`` of a Hugging Face model or config, a TransformerLens model or
    config, or the numbers given (which win over the model's)."""
    layers, width = None, None
    if model is not None:
        cfg = getattr(model, "cfg", None)
        config = getattr(model, "config", None) or model
        if cfg is not None and hasattr(cfg, "n_layers") and hasattr(cfg, "d_model"):
            layers, width = cfg.n_layers, cfg.d_model
        else:
            if hasattr(config, "get_text_config"):
                config = config.get_text_config()
            layers = _first(config, ("num_hidden_layers", "n_layers", "n_layer", "num_layers"))
            width = _first(config, ("hidden_size", "d_model", "n_embd"))
        if layers is None or width is None:
            raise ValueError(
                f"model: cannot read its layer count and width from a {type(model).__name__} (give a Hugging Face "
                "or TransformerLens model or config, or num_layers= and d_model=)"
            )
    layers = num_layers if num_layers is not None else layers
    width = d_model if d_model is not None else width
    return (None if layers is None else int(layers)), (None if width is None else int(width))


def _first(config: Any, names: Sequence[str]):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_fits(layers, d_in, d_out, cross_layer, sources, model, num_layers, d_model, require_all_layers):
    n_layers, width = model_dimensions(model, num_layers=num_layers, d_model=d_model)
    argument = "model" if model is not None else "num_layers/d_model"
    first = sources[layers[0]]
    if width is not None:
        if d_in != width:
            raise ValueError(f"{argument}: {first} reads d_in={d_in} wide vectors; the model's width is {width}")
        if d_out != width:
            raise ValueError(f"{argument}: {first} writes d_out={d_out} wide vectors; the model's width is {width}")
    if n_layers is None:
        return
    beyond = [layer for layer in layers if layer >= n_layers]
    if beyond:
        raise ValueError(
            f"{argument}: {sources[beyond[0]]} is for layer {beyond[0]}; "
            f"the model has {n_layers} layers (0-{n_layers - 1})"
        )
    if cross_layer:
        spans = len(layers)
        if spans != n_layers:
            raise ValueError(f"{argument}: {first} is a cross-layer set of {spans} layers; the model has {n_layers}")
    missing = sorted(set(range(n_layers)) - set(layers))
    if require_all_layers and missing:
        raise ValueError(
            f"{argument}: the set has transcoders for layers {list(layers)}; the model's layers {missing} have none "
            "(require_all_layers=False accepts a partial set)"
        )


# ------------------------------------------------------------------------------------------------
# File headers: names, shapes and dtypes read before any weight


@dataclass(frozen=True)
class _Entry:
    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str
    array: Any = None  # an npz file's array, read with its header

    def where(self) -> str:
        return f"{self.file}: {self.key}"


def _header(path: Path) -> dict[str, _Entry]:
    if not path.is_file():
        raise FileNotFoundError(f"folder: {path} does not exist")
    try:
        if path.suffix == ".npz":
            import numpy as np

            with np.load(path) as arrays:
                return {
                    key: _Entry(path, key, tuple(arrays[key].shape), str(arrays[key].dtype), arrays[key])
                    for key in arrays.files
                }
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            entries = {}
            for key in handle.keys():
                part = handle.get_slice(key)
                entries[key] = _Entry(path, key, tuple(part.get_shape()), part.get_dtype())
            return entries
    except FileNotFoundError:
        raise
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"folder: {path} cannot be read as {path.suffix[1:]}: {error}") from error


def _need(entries: dict[str, _Entry], path: Path, key: str, why: str) -> _Entry:
    if key not in entries:
        raise ValueError(f"folder: {path} has no {key!r} ({why}); it holds {sorted(entries)}")
    return entries[key]


def _unexpected(entries: dict[str, _Entry], known: set[str], path: Path, layout: str) -> None:
    extra = sorted(set(entries) - known)
    if extra:
        raise ValueError(
            f"folder: {path} holds {extra}, which a {layout} transcoder does not have "
            f"(expected some of {sorted(known)})"
        )


def _shape(entry: _Entry, expected: tuple[int, ...], names: str) -> None:
    if entry.shape != expected:
        raise ValueError(f"folder: {entry.where()} is {list(entry.shape)}, expected {names} = {list(expected)}")


def _float(entry: _Entry) -> None:
    if entry.dtype not in _FLOAT_CODES:
        raise ValueError(f"folder: {entry.where()} has dtype {entry.dtype}, expected a floating-point dtype")


# ------------------------------------------------------------------------------------------------
# One layer's plan: which tensor of which file, in which orientation


@dataclass
class _Plan:
    layer: int
    source: str
    w_enc: _Entry
    enc_transposed: bool  # the file holds [F, d_in]
    b_enc: _Entry
    w_dec: dict[int, tuple[_Entry, int | None]]  # target -> (entry, index along dim 1 of a CLT decoder)
    b_dec: _Entry | None
    threshold: _Entry | None
    w_skip: _Entry | None
    skip_transposed: bool  # the file holds [d_out, d_in]
    activation: str
    k: int | None = None
    k_entry: _Entry | None = None

    def check(self) -> tuple[int, int, int]:
        """``(F, d_in, d_out)`` once every shape and dtype agrees."""
        for entry in self.entries():
            _float(entry)
        (features,) = self.b_enc.shape if len(self.b_enc.shape) == 1 else (None,)
        if features is None:
            raise ValueError(f"folder: {self.b_enc.where()} is {list(self.b_enc.shape)}, expected [F]")
        if len(self.w_enc.shape) != 2:
            raise ValueError(f"folder: {self.w_enc.where()} is {list(self.w_enc.shape)}, expected a matrix")
        f_axis = 0 if self.enc_transposed else 1
        if self.w_enc.shape[f_axis] != features:
            names = "[F, d_in]" if self.enc_transposed else "[d_in, F]"
            hint = ": transposed?" if self.w_enc.shape[1 - f_axis] == features else ""
            raise ValueError(
                f"folder: {self.w_enc.where()} is {list(self.w_enc.shape)}, expected {names} with F = {features} "
                f"(the length of {self.b_enc.key}){hint}"
            )
        d_in = self.w_enc.shape[1 - f_axis]
        first, _ = next(iter(self.w_dec.values()))
        d_out = first.shape[-1] if first.shape else 0
        for entry, index in self.w_dec.values():
            if index is None:
                _shape(entry, (features, d_out), "[F, d_out]")
            else:
                _shape(entry, (features, len(self.w_dec), d_out), "[F, n_layers - layer, d_out]")
        if self.b_dec is not None:
            _shape(self.b_dec, (d_out,), "[d_out]")
        if self.threshold is not None:
            _shape(self.threshold, (features,), "[F]")
        if self.w_skip is not None:
            _shape(
                self.w_skip,
                (d_out, d_in) if self.skip_transposed else (d_in, d_out),
                "[d_out, d_in]" if self.skip_transposed else "[d_in, d_out]",
            )
        if self.activation == "jumprelu" and self.threshold is None:
            raise ValueError(f"folder: {self.source} is JumpReLU but holds no threshold")
        if self.activation == "topk" and not (isinstance(self.k, int) and 0 < self.k <= features):
            raise ValueError(f"folder: {self.source}: TopK needs an int k in 1..F={features}, got {self.k!r}")
        return features, d_in, d_out

    def entries(self) -> list[_Entry]:
        found = [self.w_enc, self.b_enc, *(entry for entry, _ in self.w_dec.values())]
        found += [e for e in (self.b_dec, self.threshold, self.w_skip) if e is not None]
        return found


class _Reader:
    """Reads each file's tensors once, converted to ``dtype`` on ``device``."""

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device, self.cache = dtype, device, {}

    def __call__(self, entry: _Entry) -> torch.Tensor:
        key = (entry.file, entry.key)
        if key not in self.cache:
            if entry.array is not None:
                tensor = torch.from_numpy(entry.array)
            else:
                from safetensors import safe_open

                with safe_open(str(entry.file), framework="pt") as handle:
                    tensor = handle.get_tensor(entry.key)
            self.cache[key] = tensor.to(dtype=self.dtype, device=self.device)
        return self.cache[key]


# ------------------------------------------------------------------------------------------------
# The readers


def _tl_hook(name: Any, where: str) -> str:
    if not isinstance(name, str):
        raise ValueError(f"folder: {where} names no hook (got {name!r})")
    short = re.sub(r"^blocks\.\d+\.", "", name)
    if short not in _TL_HOOKS:
        raise ValueError(f"folder: {where} names hook {name!r}; known: {sorted(_TL_HOOKS)} (after 'blocks.{{l}}.')")
    return _TL_HOOKS[short]


def _circuit_tracer(folder: Path) -> tuple[list[_Plan], dict]:
    import yaml

    config_path = folder / "config.yaml"
    try:
        config = yaml.safe_load(config_path.read_text())
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"folder: {config_path} does not exist (circuit-tracer sets name their hooks there)"
        ) from error
    if not isinstance(config, dict):
        raise ValueError(f"folder: {config_path} is not a mapping")
    for key in ("feature_input_hook", "feature_output_hook"):
        if key not in config:
            raise ValueError(f"folder: {config_path} has no {key!r}")
    hooks = (config["feature_input_hook"], config["feature_output_hook"])
    meta = {
        "input_hook": _tl_hook(hooks[0], f"{config_path} feature_input_hook"),
        "output_hook": _tl_hook(hooks[1], f"{config_path} feature_output_hook"),
        "source_hooks": hooks,
        "model_name": config.get("model_name"),
        "rectify": False,
        "input_normalization": "none",
    }
    kind = config.get("model_kind")
    if kind is None:
        kind = "cross_layer_transcoder" if (folder / "W_enc_0.safetensors").exists() else "transcoder_set"
    if kind == "cross_layer_transcoder":
        return _circuit_tracer_clt(folder), {**meta, "cross_layer": True}
    if kind != "transcoder_set":
        raise ValueError(
            f"folder: {config_path} model_kind is {kind!r}, expected 'transcoder_set' or 'cross_layer_transcoder'"
        )
    activation, k = config.get("activation"), config.get("k")
    if activation not in (None, "relu", "topk", "jumprelu", "jump_relu"):
        raise ValueError(f"folder: {config_path} activation is {activation!r}, expected 'relu', 'jumprelu' or 'topk'")
    plans = [
        _circuit_tracer_layer(layer, path, activation, k)
        for layer, path in _circuit_tracer_files(folder, config, config_path)
    ]
    return plans, {**meta, "cross_layer": False}


def _circuit_tracer_files(folder: Path, config: dict, config_path: Path) -> list[tuple[int, Path]]:
    if "transcoders" in config:
        files = []
        for index, item in enumerate(config["transcoders"] or []):
            layer, path = (item.get("layer"), item.get("filepath")) if isinstance(item, dict) else (index, item)
            if not isinstance(layer, int) or not isinstance(path, str):
                raise ValueError(
                    f"folder: {config_path} transcoders[{index}] is {item!r}, expected a path or {{layer, filepath}}"
                )
            if path.startswith("hf://"):
                raise ValueError(
                    f"folder: {config_path} transcoders[{index}] is on the hub ({path}); no hub is reached here: "
                    "download it and name the local file"
                )
            files.append((layer, (folder / path) if not Path(path).is_absolute() else Path(path)))
    else:
        files = []
        for path in folder.glob("layer_*.safetensors"):
            match = re.fullmatch(r"layer_(\d+)\.safetensors", path.name)
            if match:
                files.append((int(match.group(1)), path))
        if not files:
            raise ValueError(
                f"folder: {folder} has a config.yaml but neither 'transcoders' in it nor layer_{{i}}.safetensors"
            )
    layers = [layer for layer, _ in files]
    if len(set(layers)) != len(layers):
        raise ValueError(f"folder: {config_path} names layer {max(layers, key=layers.count)} twice")
    if sorted(layers) != list(range(len(layers))):
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        raise ValueError(f"folder: {folder} has transcoders for layers {sorted(layers)}; layers {missing} have none")
    return sorted(files)


def _circuit_tracer_layer(layer: int, path: Path, activation, k) -> _Plan:
    entries = _header(path)
    if path.suffix == ".npz":  # Gemma Scope's params.npz: W_enc [d_in, F], always JumpReLU
        _unexpected(entries, {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"}, path, "Gemma Scope")
        get = partial(_need, entries, path)
        return _Plan(
            layer, str(path), get("W_enc", "encoder"), False, get("b_enc", "encoder bias"),
            {layer: (get("W_dec", "decoder"), None)}, get("b_dec", "decoder bias"), get("threshold", "JumpReLU"),
            None, False, "jumprelu",
        )  # fmt: skip
    if "w_enc" in entries:  # Gemma Scope 2: lower-case keys, w_enc [d_in, F], always JumpReLU
        _unexpected(
            entries, {"w_enc", "w_dec", "b_enc", "b_dec", "threshold", "affine_skip_connection"}, path, "Gemma Scope 2"
        )
        get = partial(_need, entries, path)
        return _Plan(
            layer, str(path), get("w_enc", "encoder"), False, get("b_enc", "encoder bias"),
            {layer: (get("w_dec", "decoder"), None)}, get("b_dec", "decoder bias"), get("threshold", "JumpReLU"),
            entries.get("affine_skip_connection"), False, "jumprelu",
        )  # fmt: skip
    known = {"W_enc", "W_dec", "b_enc", "b_dec", "W_skip", "activation_function.threshold", "threshold", "k"}
    _unexpected(entries, known, path, "circuit-tracer")
    get = partial(_need, entries, path)
    threshold = entries.get("activation_function.threshold", entries.get("threshold"))
    k_entry = entries.get("k")
    if activation == "topk":
        if k is None and k_entry is not None:
            k = int(_read_scalar(k_entry))
        if k is None:
            raise ValueError(
                f"folder: {path} is TopK (config.yaml activation) but neither config.yaml nor the file gives k"
            )
        gate = "topk"
    elif activation == "relu":
        gate = "relu"
    else:
        gate = "jumprelu" if threshold is not None else "relu"
    return _Plan(
        layer, str(path), get("W_enc", "encoder"), True, get("b_enc", "encoder bias"),
        {layer: (get("W_dec", "decoder"), None)}, get("b_dec", "decoder bias"),
        threshold if gate == "jumprelu" else None,
        entries.get("W_skip"), True, gate, k if gate == "topk" else None,
    )  # fmt: skip


def _read_scalar(entry: _Entry):
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as handle:
        tensor = handle.get_tensor(entry.key)
    if tensor.numel() != 1:
        raise ValueError(f"folder: {entry.where()} is {list(tensor.shape)}, expected one number (TopK's k)")
    return tensor.item()


def _circuit_tracer_clt(folder: Path) -> list[_Plan]:
    numbers = sorted(
        int(m.group(1))
        for p in folder.glob("W_enc_*.safetensors")
        if (m := re.fullmatch(r"W_enc_(\d+)\.safetensors", p.name))
    )
    if not numbers:
        raise ValueError(f"folder: {folder} is a cross-layer set (config.yaml) but holds no W_enc_{{i}}.safetensors")
    n = len(numbers)
    if numbers != list(range(n)):
        raise ValueError(
            f"folder: {folder} has W_enc_{{i}}.safetensors for layers {numbers}; "
            f"layers {sorted(set(range(max(numbers) + 1)) - set(numbers))} have none"
        )
    plans, thresholds = [], []
    for i in range(n):
        enc_path, dec_path = folder / f"W_enc_{i}.safetensors", folder / f"W_dec_{i}.safetensors"
        enc, dec = _header(enc_path), _header(dec_path)
        _unexpected(
            enc, {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", f"threshold_{i}"}, enc_path, "circuit-tracer cross-layer"
        )
        _unexpected(dec, {f"W_dec_{i}"}, dec_path, "circuit-tracer cross-layer")
        w_dec = _need(dec, dec_path, f"W_dec_{i}", "decoder")
        threshold = enc.get(f"threshold_{i}")
        thresholds.append(threshold is not None)
        plans.append(
            _Plan(
                i,
                f"{enc_path} and {dec_path.name}",
                _need(enc, enc_path, f"W_enc_{i}", "encoder"),
                True,
                _need(enc, enc_path, f"b_enc_{i}", "encoder bias"),
                {t: (w_dec, t - i) for t in range(i, n)},
                _need(enc, enc_path, f"b_dec_{i}", f"decoder bias of output layer {i}"),
                threshold,
                None,
                False,
                "jumprelu" if threshold is not None else "relu",
            )  # fmt: skip
        )
    if len(set(thresholds)) > 1:
        has = [i for i, t in enumerate(thresholds) if t]
        raise ValueError(
            f"folder: {folder}: only layers {has} of {n} hold threshold_{{i}} (JumpReLU in some layers only)"
        )
    return plans


def _saelens(folders: list[Path], input_hook, output_hook) -> tuple[list[_Plan], dict]:
    plans, hooks, names, norms = [], set(), set(), set()
    for folder in folders:
        cfg_path = folder / "cfg.json"
        cfg = _json(cfg_path)
        meta = cfg.get("metadata") or {}
        architecture = cfg.get("architecture")
        if architecture not in _SAELENS_ARCHITECTURES:
            raise ValueError(
                f"folder: {cfg_path} architecture is {architecture!r}, "
                f"expected one of {sorted(_SAELENS_ARCHITECTURES)} "
                "(a SAELens SAE reconstructs its own input: it is not a transcoder)"
            )
        for key in ("d_in", "d_sae", "d_out"):
            if not isinstance(cfg.get(key), int):
                raise ValueError(f"folder: {cfg_path} has no int {key!r} (got {cfg.get(key)!r})")
        if cfg.get("apply_b_dec_to_input", False):
            raise ValueError(f"folder: {cfg_path} sets apply_b_dec_to_input, which SAELens refuses for transcoders")
        if cfg.get("reshape_activations", "none") not in ("none", None):
            raise ValueError(
                f"folder: {cfg_path} reshape_activations is {cfg['reshape_activations']!r}; only 'none' is read"
            )
        if cfg.get("dtype", "float32") not in _SAELENS_DTYPES:
            raise ValueError(f"folder: {cfg_path} dtype is {cfg['dtype']!r}, expected one of {sorted(_SAELENS_DTYPES)}")
        norm = cfg.get("normalize_activations", "none")
        norm = {False: "none", True: "expected_average_only_in", None: "none"}.get(norm, norm)
        if norm not in _SAELENS_NORMALISATIONS:
            raise ValueError(
                f"folder: {cfg_path} normalize_activations is {norm!r}, expected one of {_SAELENS_NORMALISATIONS}"
            )
        norms.add(norm)
        hook_in = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
        hook_out = meta.get("hook_name_out") or cfg.get("hook_name_out")
        layer = _block(hook_in)
        if layer is None:
            layer = meta.get("hook_layer", cfg.get("hook_layer"))
        if not isinstance(layer, int):
            raise ValueError(f"folder: {cfg_path} gives no layer (neither hook_name 'blocks.{{l}}.…' nor hook_layer)")
        hooks.add(
            (
                input_hook or _tl_hook(hook_in, f"{cfg_path} hook_name"),
                output_hook or _tl_hook(hook_out, f"{cfg_path} hook_name_out (or pass output_hook=)"),
                _any_layer(hook_in),
                _any_layer(hook_out),
            )
        )
        names.add(meta.get("model_name") or cfg.get("model_name"))
        weights = folder / "sae_weights.safetensors"
        entries = _header(weights)
        skip = architecture == "skip_transcoder"
        known = {"W_enc", "b_enc", "W_dec", "b_dec"} | (
            {"threshold"} if architecture == "jumprelu_transcoder" else set()
        )
        _unexpected(entries, known | ({"W_skip"} if skip else set()), weights, f"SAELens {architecture}")
        get = partial(_need, entries, weights)
        plan = _Plan(
            layer, str(weights), get("W_enc", "encoder"), False, get("b_enc", "encoder bias"),
            {layer: (get("W_dec", "decoder"), None)}, get("b_dec", "decoder bias"),
            get("threshold", "JumpReLU") if architecture == "jumprelu_transcoder" else None,
            get("W_skip", "skip connection") if skip else None, True, _SAELENS_ARCHITECTURES[architecture],
        )  # fmt: skip
        features, d_in, d_out = plan.check()
        for key, value in (("d_sae", features), ("d_in", d_in), ("d_out", d_out)):
            if cfg[key] != value:
                raise ValueError(f"folder: {cfg_path} says {key}={cfg[key]}, {weights} holds {value}")
        plans.append(plan)
    if len(hooks) > 1 or len(norms) > 1:
        raise ValueError(
            f"folder: its transcoders read and write at different points: {sorted(map(str, hooks | norms))}"
        )
    hook_in, hook_out, raw_in, raw_out = hooks.pop()
    meta = {
        "input_hook": hook_in, "output_hook": hook_out, "source_hooks": (raw_in, raw_out), "rectify": True,
        "input_normalization": norms.pop(), "cross_layer": False,
        "model_name": next(iter(names)) if len(names) == 1 else None,
    }  # fmt: skip
    return plans, meta


def _any_layer(hook: Any) -> Any:
    return re.sub(r"^blocks\.\d+\.", "blocks.{l}.", hook) if isinstance(hook, str) else hook


def _block(hook: Any) -> int | None:
    match = re.match(r"blocks\.(\d+)\.", hook) if isinstance(hook, str) else None
    return int(match.group(1)) if match else None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise FileNotFoundError(f"folder: {path} does not exist") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"folder: {path} is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"folder: {path} is not a JSON object")
    return value


def _sparsify_hookpoint(name: str, where: Path) -> tuple[int, str, str]:
    match = re.search(r"(?:^|\.)(?:layers|h|layer|blocks)[._](\d+)(\.mlp)?$", name)
    if match is None:
        raise ValueError(
            f"folder: {where} is named {name!r}; sparsify names a folder by the module it replaced "
            "('layers.5.mlp' for an MLP, 'layers.5' for a whole block), or pass input_hook= and output_hook="
        )
    if match.group(2):
        return int(match.group(1)), "mlp_input", "mlp_module_output"
    return int(match.group(1)), "resid_pre", "resid_post"


def _sparsify(folders: list[Path], input_hook, output_hook) -> tuple[list[_Plan], dict]:
    plans, hooks = [], set()
    for folder in folders:
        cfg_path = folder / "cfg.json"
        cfg = _json(cfg_path)
        if not cfg.get("transcode", False):
            raise ValueError(f"folder: {cfg_path} has transcode false: a sparsify autoencoder, not a transcoder")
        if cfg.get("activation", "topk") != "topk":
            raise ValueError(f"folder: {cfg_path} activation is {cfg.get('activation')!r}; only 'topk' is read")
        if not isinstance(cfg.get("d_in"), int):
            raise ValueError(f"folder: {cfg_path} has no int 'd_in' (got {cfg.get('d_in')!r})")
        layer, hook_in, hook_out = _sparsify_hookpoint(folder.name, folder)
        hooks.add((input_hook or hook_in, output_hook or hook_out))
        weights = folder / "sae.safetensors"
        entries = _header(weights)
        skip = bool(cfg.get("skip_connection", False))
        _unexpected(
            entries,
            {"encoder.weight", "encoder.bias", "W_dec", "b_dec"} | ({"W_skip"} if skip else set()),
            weights,
            "sparsify",
        )
        get = partial(_need, entries, weights)
        plan = _Plan(
            layer, str(weights), get("encoder.weight", "encoder"), True, get("encoder.bias", "encoder bias"),
            {layer: (get("W_dec", "decoder"), None)}, get("b_dec", "decoder bias"),
            None, get("W_skip", "skip connection (cfg.json skip_connection)") if skip else None, True,
            "topk", cfg.get("k"),
        )  # fmt: skip
        features, d_in, _ = plan.check()
        latents = cfg.get("num_latents") or cfg["d_in"] * cfg.get("expansion_factor", 32)
        if (cfg["d_in"], latents) != (d_in, features):
            raise ValueError(
                f"folder: {cfg_path} says d_in={cfg['d_in']}, {latents} latents; {weights} holds {d_in}, {features}"
            )
        plans.append(plan)
    if len(hooks) > 1:
        raise ValueError(f"folder: its transcoders read and write at different points: {sorted(hooks)}")
    hook_in, hook_out = hooks.pop()
    meta = {
        "input_hook": hook_in, "output_hook": hook_out, "source_hooks": tuple(f.name for f in folders[:1]) * 2,
        "rectify": True, "input_normalization": "none", "cross_layer": False, "model_name": None,
    }  # fmt: skip
    return plans, meta


# ------------------------------------------------------------------------------------------------
# The entry point


def detect_layout(folder) -> str:
    """The layout of a folder's files: ``"circuit-tracer"`` (a config.yaml), ``"saelens"``
    (cfg.json with sae_weights.safetensors, in the folder or its subfolders) or ``"sparsify"``
    (cfg.json with sae.safetensors)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder: {folder} is not a folder")
    if (folder / "config.yaml").is_file():
        return "circuit-tracer"
    found = set()
    for place in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]:
        if (place / "cfg.json").is_file():
            found |= {"saelens"} if (place / "sae_weights.safetensors").is_file() else set()
            found |= {"sparsify"} if (place / "sae.safetensors").is_file() else set()
    if len(found) == 1:
        return found.pop()
    if found:
        raise ValueError(f"folder: {folder} holds both SAELens and sparsify transcoders; pass layout=")
    raise ValueError(
        f"folder: {folder} holds no transcoder set: looked for config.yaml (circuit-tracer), cfg.json with "
        "sae_weights.safetensors (SAELens) or with sae.safetensors (sparsify), in it or its subfolders"
    )


def _subfolders(folder: Path, weights: str) -> list[Path]:
    if (folder / "cfg.json").is_file():
        return [folder]
    found = [p for p in sorted(folder.iterdir()) if (p / "cfg.json").is_file() and (p / weights).is_file()]
    if not found:
        raise ValueError(f"folder: {folder} holds no cfg.json with {weights}, neither in it nor in its subfolders")
    return found


def load_transcoders(
    folder,
    *,
    model: Any = None,
    num_layers: int | None = None,
    d_model: int | None = None,
    layout: str | None = None,
    input_hook: str | None = None,
    output_hook: str | None = None,
    require_all_layers: bool = True,
    dtype: torch.dtype = torch.float64,
    device="cpu",
) -> TranscoderSet:
    """Read the transcoder set in ``folder`` (a circuit-tracer, SAELens or sparsify layout: see the
    module's docstring) into a :class:`TranscoderSet` of ``dtype`` on ``device``.

    Every file's tensor names, shapes and dtypes are checked from the headers first, then the set
    against ``model`` (a Hugging Face or TransformerLens model or config) or ``num_layers`` and
    ``d_model`` when given: its width, its layers (every layer of the model covered, unless
    ``require_all_layers=False``; a cross-layer set spans exactly the model's layers). Only then are
    the weights read. ``input_hook``/``output_hook`` (keys of ``HOOKS``) name where the set reads and
    writes when its files do not say, or override what they say."""
    folder = Path(folder)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch dtype, got {dtype!r}")
    for name, hook in (("input_hook", input_hook), ("output_hook", output_hook)):
        if hook is not None and hook not in HOOKS:
            raise ValueError(f"{name}: {hook!r} is not one of {sorted(HOOKS)}")
    if layout is None:
        layout = detect_layout(folder)
    elif layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    elif not folder.is_dir():
        raise FileNotFoundError(f"folder: {folder} is not a folder")
    if layout == "circuit-tracer":
        plans, meta = _circuit_tracer(folder)
        for plan in plans:
            plan.check()
        meta["input_hook"] = input_hook or meta["input_hook"]
        meta["output_hook"] = output_hook or meta["output_hook"]
    elif layout == "saelens":
        plans, meta = _saelens(_subfolders(folder, "sae_weights.safetensors"), input_hook, output_hook)
    else:
        plans, meta = _sparsify(_subfolders(folder, "sae.safetensors"), input_hook, output_hook)
    plans.sort(key=lambda plan: plan.layer)
    layers = tuple(plan.layer for plan in plans)
    if len(set(layers)) != len(layers):
        twice = next(layer for layer in layers if layers.count(layer) > 1)
        raise ValueError(
            f"folder: {folder} has two transcoders for layer {twice}: {[p.source for p in plans if p.layer == twice]}"
        )
    dims = {plan.layer: plan.check() for plan in plans}
    d_in, d_out = dims[layers[0]][1:]
    for plan in plans:
        if dims[plan.layer][1:] != (d_in, d_out):
            raise ValueError(
                f"folder: {plan.source} is d_in={dims[plan.layer][1]} d_out={dims[plan.layer][2]}; "
                f"{plans[0].source} is d_in={d_in} d_out={d_out}"
            )
    sources = {plan.layer: plan.source for plan in plans}
    if model is not None or num_layers is not None or d_model is not None:
        _check_fits(layers, d_in, d_out, meta["cross_layer"], sources, model, num_layers, d_model, require_all_layers)
    read = _Reader(dtype, device)
    w_dec = {}
    for plan in plans:
        w_dec[plan.layer] = {
            target: (read(entry) if index is None else read(entry)[:, index]).contiguous()
            for target, (entry, index) in plan.w_dec.items()
        }
    return TranscoderSet(
        layout=layout,
        layers=layers,
        w_enc={p.layer: (read(p.w_enc).T if p.enc_transposed else read(p.w_enc)).contiguous() for p in plans},
        b_enc={p.layer: read(p.b_enc) for p in plans},
        w_dec=w_dec,
        b_dec={p.layer: read(p.b_dec) for p in plans},
        threshold={p.layer: None if p.threshold is None else read(p.threshold) for p in plans},
        w_skip={
            p.layer: None
            if p.w_skip is None
            else (read(p.w_skip).T if p.skip_transposed else read(p.w_skip)).contiguous()
            for p in plans
        },
        activation={p.layer: p.activation for p in plans},
        k={p.layer: p.k for p in plans},
        rectify=meta["rectify"],
        input_normalization=meta["input_normalization"],
        input_hook=meta["input_hook"],
        output_hook=meta["output_hook"],
        source_hooks=tuple(meta["source_hooks"]),
        cross_layer=meta["cross_layer"],
        sources=sources,
        model_name=meta.get("model_name"),
    )


def random_transcoders(
    num_layers: int,
    d_model: int,
    num_features: int,
    *,
    layers=None,
    activation: str = "jumprelu",
    k: int | None = None,
    skip: bool = False,
    input_hook: str = "mlp_input",
    output_hook: str = "mlp_output",
    input_normalization: str = "none",
    rectify: bool = False,
    density: float | None = None,
    cross_layer: bool = False,
    dtype: torch.dtype = torch.float64,
    generator: torch.Generator | None = None,
):
    """A random :class:`~pathkernels.adapters.TranscoderSet` for a model of ``num_layers``
    layers of width ``d_model`` (``layers``: the layers it covers, default all), ``num_features``
    features each: encoder ``N(0, 1/d)``, biases ``N(−0.2, 0.3²)`` (about a third of the features of a
    unit-scale input active), thresholds ``U(0, 0.2)`` (JumpReLU), decoder ``N(0, 1/F)``, and with
    ``skip`` a ``W_skip`` ``N(0, 0.1²/d)``; ``k`` for TopK (default ``num_features // 4``). With
    ``density`` (JumpReLU), the encoder biases are 0 and every threshold the ``1 − density`` quantile
    of a standard normal, so that a fraction ``density`` of the features is active on an input
    whose entries have unit variance (a LayerNorm's output), e.g. 64 of 24,576 at 0.0026. With
    ``cross_layer``, each layer's features write into every later layer of the set too (a decoder
    ``N(0, 1/F)`` per target), as a cross-layer transcoder's do; ``skip`` then gives no ``W_skip``
    (cross-layer sets have none)."""
    layers = tuple(range(num_layers) if layers is None else layers)
    if density is not None and not (activation == "jumprelu" and 0.0 < float(density) < 1.0):
        raise ValueError(f"density: expected a fraction in (0, 1) of a JumpReLU set, got {density!r} ({activation})")
    quantile = None if density is None else float(torch.special.ndtri(torch.tensor(1.0 - float(density))))

    def draw(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * std + mean).to(dtype)

    def encoder_bias():  # 0 with a density: the thresholds alone set it
        if quantile is not None:
            return torch.zeros(num_features, dtype=dtype)
        return draw(num_features, std=0.3, mean=-0.2)

    return TranscoderSet(
        layout="circuit-tracer",
        layers=layers,
        w_enc={layer: draw(d_model, num_features, std=d_model**-0.5) for layer in layers},
        b_enc={layer: encoder_bias() for layer in layers},
        w_dec={
            layer: {
                target: draw(num_features, d_model, std=num_features**-0.5)
                for target in layers
                if target == layer or (cross_layer and target > layer)
            }
            for layer in layers
        },
        b_dec={layer: draw(d_model, std=0.3) for layer in layers},
        threshold={
            layer: None
            if activation != "jumprelu"
            else torch.full((num_features,), quantile, dtype=dtype)
            if quantile is not None
            else (torch.rand(num_features, generator=generator, dtype=torch.float64) * 0.2).to(dtype)
            for layer in layers
        },
        w_skip={
            layer: draw(d_model, d_model, std=0.1 * d_model**-0.5) if skip and not cross_layer else None
            for layer in layers
        },
        activation=dict.fromkeys(layers, activation),
        k=dict.fromkeys(layers, (k or max(1, num_features // 4)) if activation == "topk" else None),
        rectify=rectify,
        input_normalization=input_normalization,
        input_hook=input_hook,
        output_hook=output_hook,
        source_hooks=(input_hook, output_hook),
        cross_layer=cross_layer,
        sources={layer: f"random layer {layer}" for layer in layers},
    )


__all__ = [
    "ACTIVATIONS",
    "HOOKS",
    "LAYOUTS",
    "TranscoderSet",
    "detect_layout",
    "load_transcoders",
    "model_dimensions",
    "random_transcoders",
]
