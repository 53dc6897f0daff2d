"""The MLPs of a captured model replaced by a transcoder set, frozen at one forward pass.

With the norms, the attention patterns and each feature's gate frozen, a transcoder is linear in
the residual stream (docs/DESIGN.md, "Paths through MLP features"). The transcoder of layer ``l``
reads ``x_in = diag(s) X M + S``: the stream ``X`` ``[n, d]`` entering the MLP's norm, its frozen
per-token scale ``s`` and linear map ``M`` (the norm's centring and gain, then the format's own
input normalisation), and constant rows ``S`` (the norm's bias). Its features' activations are
``a_f = g_f ⊙ (x_in enc_f + b_enc,f)``, the gate ``g_f(t)`` 1 where feature f is active at token t
and 0 elsewhere (every supported activation passes an active feature's pre-activation
unchanged), and the MLP sublayer adds

    mlp_out = diag(o) (Σ_f a_f d_fᵀ + 1 b_decᵀ + x_in W_skip) Γ_o + E,

``o``, ``Γ_o`` the frozen norm on the transcoder's output where it writes before one (Gemma-2's
post-MLP norm, for a set whose output hook is the MLP module's output; 1 elsewhere) and ``E`` the
error, ``mlp_out`` less the reconstruction, as circuit tools name their error nodes. So the
sublayer is a sum of *feature steps*, ``X ↦ diag(o g_f s) X (M enc_f) (d_f Γ_o)ᵀ`` (a head of
d_head 1 with a diagonal token map), the skip map's steps (``M' W_skip Γ_o = Σ_k σ_k u_k v_kᵀ``, one
step per singular value; ``M'`` the hook's frame without the format's normalisation, as the
formats add the skip term of their raw input), and two sources: the constant rows (every feature's ``S enc_f +
b_enc,f`` through its gate and decoder, ``b_dec``, ``S W_skip``) and the error.

A cross-layer set's feature f of layer l writes ``a_f d_f^{l→m}`` into every layer ``m ≥ l``. Its
write at m is a step of layer m's MLP that reads the stream entering layer l's MLP: a path through
it takes nothing between (no head of layers l+1..m, no other MLP step, no source entering there).
The pre-norm skips between are the identity, so its term is the per-layer step's with the l→m
decoder, ``X ↦ diag(o_m g_f s_l) X (M_l enc_f) (d_f^{l→m} Γ_o)ᵀ`` on the stream below layer l's MLP.

:func:`replace_mlps` computes that, in float64, from what the capture read;
:class:`TranscoderCapture` holds it as ``capture.transcoders``, and
:func:`pathkernels.analysis.readout_trie.frozen_model` makes each replaced MLP a sublayer of
feature steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from pathkernels.adapters.transcoders import HOOKS, TranscoderSet

#: The input hooks a replaced MLP can read (keys of ``transcoders.HOOKS``): the stream entering the
#: MLP's norm, the norm's output, or the norm's output before its gain and bias.
INPUT_HOOKS = ("resid_mid", "mlp_input", "mlp_input_before_gain")
#: The output hooks: what the sublayer adds to the stream, or the MLP module's output before a
#: norm on it (the same where the model has none).
OUTPUT_HOOKS = ("mlp_output", "mlp_module_output")


@dataclass
class ReplacedLayer:
    """One MLP replaced by its transcoder, over a batch ``[B, n]`` (module docstring).

    - ``features`` ``[F']``: the ids of the features active at some real token of the batch (the
      only ones that are steps); ``gates`` ``[B, n, F']``: their gates, 0 or 1; ``activations``
      ``[B, n, F']``: their activations at the frozen gates;
    - ``input_scale`` ``[B, n]``: ``s``, the frozen scale of the input; ``output_scale`` ``[B, n]``:
      ``o``; ``token_weights`` ``[B, n]``: ``o ⊙ s``, what a feature step multiplies its token by
      (with its gate);
    - ``encoder`` ``[d, F']``: ``M enc_f``; ``encoder_bias`` ``[B, n, F']``: the pre-activations'
      constant part, ``S enc_f + b_enc,f`` (so a pre-activation is ``s (X M enc_f) + encoder_bias``);
      ``decoder`` ``[F', d]``: ``d_f Γ_o``;
    - ``skip_in`` ``[K, d]`` and ``skip_out`` ``[K, d]``: the skip map ``M' W_skip Γ_o`` as ``K``
      rank-one steps ``u_k σ_k v_kᵀ`` (None without ``W_skip``), ``skip_weights`` ``[B, n]`` their
      token weights ``o ⊙ s'`` (``s'``, ``M'``: the input hook's frame without the format's own
      normalisation, which the skip term does not pass);
    - ``bias`` ``[B, n, d]``: the constant rows; ``error`` ``[B, n, d]``: the MLP's output less the
      reconstruction; ``num_features``: the transcoder's width (feature ids are below it);
    - ``decoders_from``: a cross-layer set's writes into this layer from earlier ones, ``{l: [F'_l,
      d]}`` (the decoder rows ``d_f^{l→m} Γ_o`` of layer l's active features; empty for a per-layer
      set). A feature of layer l written here is a step of this layer's MLP that reads the stream
      below layer l's MLP (its gate, input scale and encoder are layer l's, its output scale this
      layer's).
    """

    layer: int
    features: Tensor
    gates: Tensor
    input_scale: Tensor
    output_scale: Tensor
    token_weights: Tensor
    encoder: Tensor
    encoder_bias: Tensor
    decoder: Tensor
    skip_in: Tensor | None
    skip_out: Tensor | None
    skip_weights: Tensor | None
    bias: Tensor
    error: Tensor
    num_features: int
    activations: Tensor
    decoders_from: dict[int, Tensor] = field(default_factory=dict)

    @property
    def num_skip(self) -> int:
        """``K``: the skip map's rank-one steps (0 without ``W_skip``)."""
        return 0 if self.skip_in is None else self.skip_in.shape[0]

    def step_label(self, branch: int) -> str:
        """A step's name in a path: ``"L3 F812"`` (feature 812) or ``"L3 skip[2]"`` (the skip
        map's third singular direction), ``branch`` as a path's choice holds it (a feature id,
        or ``num_features + k``)."""
        if branch < self.num_features:
            return f"L{self.layer} F{branch}"
        return f"L{self.layer} skip[{branch - self.num_features}]"

    def on(self, device) -> ReplacedLayer:
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        moved["decoders_from"] = {source: v.to(device) for source, v in self.decoders_from.items()}
        return ReplacedLayer(**moved)


@dataclass
class TranscoderCapture:
    """A capture's MLPs replaced by a transcoder set: ``layers`` maps each replaced layer to its
    :class:`ReplacedLayer`; ``num_layers`` is the model's layer count (a path's choices are then
    ``[2 L]``: the head of each layer, then the step of each MLP); ``description``: the set's repr;
    ``input_hook``, ``output_hook``: where it reads and writes (keys of ``transcoders.HOOKS``).

    The step a path takes at layer m's MLP is, in its column ``L + m``: a feature's id ``f`` or
    ``num_features + k`` for the skip map's k-th direction; with a cross-layer set, the feature f of
    an earlier layer l written at m is ``(m − l) · stride + f`` (:attr:`stride`, :meth:`decode`)."""

    layers: dict[int, ReplacedLayer]
    num_layers: int
    description: str
    input_hook: str
    output_hook: str
    input_error: float | None = None  # the frozen input against the model's own MLP input (check_input_hook)
    transcoder_set: TranscoderSet | None = None  # the set itself, for what recomputes it (the causal check)
    parallel: bool = False  # each MLP reads its block's input, beside the attention (GPT-J, Phi, …)

    def __repr__(self) -> str:
        active = ", ".join(f"L{layer}: {r.features.numel()}" for layer, r in self.layers.items())
        return f"TranscoderCapture({self.description}; active features {active})"

    @property
    def cross_layer(self) -> bool:
        """Whether some layer's features write into later layers (a cross-layer set)."""
        return any(r.decoders_from for r in self.layers.values())

    @property
    def stride(self) -> int:
        """What a step's value advances by per layer between where its feature reads and where it
        writes: the most steps any one layer has (features, then skip directions)."""
        return max(r.num_features + r.num_skip for r in self.layers.values())

    def writers(self, target: int) -> dict[int, Tensor]:
        """``{l: [F'_l, d]}``: the decoder rows (a norm after the module folded in) of each layer l
        whose active features write into layer ``target``'s MLP: itself, and with a cross-layer set
        every earlier layer."""
        replaced = self.layers[target]
        return {target: replaced.decoder, **replaced.decoders_from}

    def writes(self, source: int) -> dict[int, Tensor]:
        """``{m: [F'_l, d]}``: the decoder rows that layer ``source``'s active features write into each
        layer m (itself, and with a cross-layer set every later layer), in layer order."""
        by_target = {target: self.writers(target) for target in sorted(self.layers)}
        return {target: writers[source] for target, writers in by_target.items() if source in writers}

    def decode(self, slot: int, branch: int) -> tuple[int, int, int]:
        """``(l, m, b)`` of the step ``branch`` in column ``slot`` (``L + m``): the layer ``l`` whose
        feature or skip direction ``b`` it takes (``b`` as :meth:`ReplacedLayer.step_label` reads
        it), written into layer ``m``'s MLP."""
        target = slot - self.num_layers
        offset, index = divmod(int(branch), self.stride)
        return target - offset, target, index

    def step_label(self, slot: int, branch: int) -> str:
        """The name of a step: ``slot`` a path's column (``L + m`` for layer m's MLP): ``"L1 F812"``,
        or ``"L1 F812→L3"`` for a cross-layer feature of layer 1 written into layer 3."""
        source, target, index = self.decode(slot, branch)
        label = self.layers[source].step_label(index)
        return label if source == target else f"{label}→L{target}"

    def on(self, device) -> TranscoderCapture:
        return TranscoderCapture(
            {layer: r.on(device) for layer, r in self.layers.items()},
            self.num_layers,
            self.description,
            self.input_hook,
            self.output_hook,
            self.input_error,
            self.transcoder_set,
            self.parallel,
        )


@dataclass
class MlpInputs:
    """What a capture read around each MLP, ``[B, L, …]`` float64: ``stream`` ``[B, L, n, d]`` the
    stream entering the MLP's norm; ``norm_scale`` ``[B, L, n]`` the norm's frozen ``1/σ``,
    ``norm_weight``, ``norm_bias`` ``[L, d]`` its γ and β, ``centred`` whether it centres (a
    LayerNorm); ``output_scale`` ``[B, L, n]`` and ``output_weight`` ``[L, d]`` a norm after the
    MLP module (None where none); ``mlp_out`` ``[B, L, n, d]`` what the sublayer adds; ``own_inputs``:
    ``{hook: [B, L, n, d]}``, an input hook's value as the model computed it (its MLP's argument,
    TransformerLens's ``ln2.hook_normalized``), where the capture read one, for the check of the
    set's input hook."""

    stream: Tensor
    norm_scale: Tensor
    norm_weight: Tensor
    norm_bias: Tensor
    centred: bool
    mlp_out: Tensor
    output_scale: Tensor | None = None
    output_weight: Tensor | None = None
    own_inputs: dict[str, Tensor] = field(default_factory=dict)


def _centre_columns(w: Tensor) -> Tensor:
    """``C w`` for ``w [d, k]``: ``C = I − 11ᵀ/d`` on the left (each column less its mean)."""
    return w - w.mean(0, keepdim=True)


class InputFrame:
    """``x_in = diag(s) X M + S`` of one layer (module docstring): the per-token ``scale`` ``[B, n]``,
    the constant rows ``shift`` ``[B, n, d]``, and ``M`` applied to columns by :meth:`apply`."""

    def __init__(self, hook: str, normalization: str, inputs: MlpInputs, layer: int):
        stream = inputs.stream[:, layer]
        batch, tokens, d = stream.shape
        self.centre_first = hook != "resid_mid" and inputs.centred  # the norm's C
        self.gain = inputs.norm_weight[layer] if hook == "mlp_input" else None  # the norm's Γ
        self.centre_last = normalization == "layer_norm"  # the format's own LayerNorm: C again
        if hook == "resid_mid":
            scale = torch.ones(batch, tokens, dtype=torch.float64, device=stream.device)
        else:
            scale = inputs.norm_scale[:, layer]
        shift = torch.zeros(d, dtype=torch.float64, device=stream.device)
        if hook == "mlp_input":
            shift = inputs.norm_bias[layer]
        shift = shift.expand(batch, tokens, d)
        if normalization in ("constant_norm_rescale", "layer_norm"):
            framed = scale[..., None] * self.apply_rows(stream, last=False) + shift
            if normalization == "constant_norm_rescale":
                extra = d**0.5 / framed.norm(dim=-1)
            else:
                centred = framed - framed.mean(-1, keepdim=True)
                extra = 1.0 / (centred.std(dim=-1) + 1e-5)
                shift = shift - shift.mean(-1, keepdim=True)
            scale, shift = scale * extra, extra[..., None] * shift
        self.scale, self.shift = scale, shift

    def apply_rows(self, x: Tensor, last: bool = True) -> Tensor:
        """``x M`` for rows ``x [..., d]``."""
        if self.centre_first:
            x = x - x.mean(-1, keepdim=True)
        if self.gain is not None:
            x = x * self.gain
        if last and self.centre_last:
            x = x - x.mean(-1, keepdim=True)
        return x

    def apply(self, w: Tensor) -> Tensor:
        """``M w`` for columns ``w [d, k]`` (``M = C Γ C'``: the transpose of the rows' order)."""
        if self.centre_last:
            w = _centre_columns(w)
        if self.gain is not None:
            w = self.gain[:, None] * w
        if self.centre_first:
            w = _centre_columns(w)
        return w

    def __call__(self, stream: Tensor) -> Tensor:
        """``x_in`` ``[B, n, d]``."""
        return self.scale[..., None] * self.apply_rows(stream) + self.shift


def check_replaceable(transcoders: TranscoderSet, num_layers: int, d_model: int, where: str) -> None:
    """Refuse, naming the argument, a set whose MLPs cannot be replaced in a capture: one that does
    not fit the model or hooks the replacement does not read."""
    if not isinstance(transcoders, TranscoderSet):
        raise TypeError(
            f"{where}: expected transcoders to be a pathkernels.adapters.TranscoderSet (load_transcoders), "
            f"got {type(transcoders).__name__}"
        )
    transcoders.check_fits(num_layers=num_layers, d_model=d_model, require_all_layers=False)
    if transcoders.input_hook not in INPUT_HOOKS:
        raise ValueError(
            f"{where}: transcoders reads {transcoders.input_hook!r}; a replaced MLP reads one of {INPUT_HOOKS} "
            "(the MLP's own input, before or after its norm)"
        )
    if transcoders.output_hook not in OUTPUT_HOOKS:
        raise ValueError(
            f"{where}: transcoders writes {transcoders.output_hook!r}; a replaced MLP writes one of {OUTPUT_HOOKS}"
        )


@dataclass
class _Reading:
    """What one layer's transcoder reads (the first half of :func:`replace_mlps`): its frames, the
    active features and their gates, activations and pre-activations' constant parts."""

    frame: InputFrame
    hook_frame: InputFrame  # the input hook's frame without the format's normalisation (the skip term's)
    w_enc: Tensor
    features: Tensor  # [F'] active at some real token
    gates: Tensor  # [B, n, F'] 0 or 1
    activations: Tensor  # [B, n, F']
    encoder_bias: Tensor  # [B, n, F']


def _read(transcoders: TranscoderSet, inputs: MlpInputs, layer: int, real: Tensor) -> _Reading:
    frame = InputFrame(transcoders.input_hook, transcoders.input_normalization, inputs, layer)
    # The skip term reads the hook's value itself, before the format's normalisation (SAELens's skip
    # transcoder adds x @ W_skip.T of its raw input).
    hook_frame = InputFrame(transcoders.input_hook, "none", inputs, layer)
    device = inputs.stream.device
    w_enc = transcoders.w_enc[layer].to(device, torch.float64)
    b_enc = transcoders.b_enc[layer].to(device, torch.float64)
    pre = frame(inputs.stream[:, layer]) @ w_enc + b_enc  # [B, n, F]
    acts = transcoders.activate(layer, pre).to(torch.float64)
    gates = (acts != 0) & real[..., None]
    features = gates.flatten(0, 1).any(0).nonzero().flatten()  # active at some real token
    gates = gates[..., features].double()
    encoder_bias = frame.shift @ w_enc[:, features] + b_enc[features]  # S enc_f + b_enc,f [B, n, F']
    return _Reading(frame, hook_frame, w_enc, features, gates, acts[..., features] * gates, encoder_bias)


def replace_mlps(
    transcoders: TranscoderSet,
    inputs: MlpInputs,
    token_mask: Tensor | None,
    tolerance: float,
    where: str,
    parallel: bool = False,
) -> TranscoderCapture:
    """Each MLP of ``transcoders``' layers replaced by its transcoder, frozen (module docstring),
    from what the capture read (:class:`MlpInputs`); ``token_mask`` ``[B, n]`` marks the real
    tokens (a feature active only at padding is no step). Float64 throughout, whatever the set's
    dtype: the gates are decided on the float64 pre-activations of the frozen input. The frozen
    input is first checked against the model's own (:func:`check_input_hook`, within ``tolerance``;
    its difference kept as ``input_error``). A cross-layer set's layer ``m`` sums what the features
    of every layer ``l ≤ m`` write into it (``ReplacedLayer.decoders_from``). ``parallel``: each MLP
    reads its block's input, beside the attention (``inputs.stream`` is then that input)."""
    input_error = check_input_hook(transcoders, inputs, tolerance, where)
    batch, num_layers, tokens, d = inputs.stream.shape
    device = inputs.stream.device
    real = torch.ones(batch, tokens, dtype=torch.bool, device=device) if token_mask is None else token_mask.to(device)
    zero = ~real[..., None]
    reads = {layer: _read(transcoders, inputs, layer, real) for layer in transcoders.layers}
    layers = {}
    for layer in transcoders.layers:
        own = reads[layer]
        out_scale = torch.ones(batch, tokens, dtype=torch.float64, device=device)
        out_gain = None
        if transcoders.output_hook == "mlp_module_output" and inputs.output_scale is not None:
            out_scale, out_gain = inputs.output_scale[:, layer], inputs.output_weight[layer]
        # What each layer l ≤ this one writes into it (l = this layer alone for a per-layer set):
        # its active features' decoder rows; the constant rows take each feature's S enc_f + b_enc,f
        # through its gate, then b_dec and S W_skip.
        b_dec = transcoders.b_dec[layer].to(device, torch.float64)
        decoders, constant, reconstruction = {}, b_dec, b_dec
        for source in transcoders.layers:
            if layer not in transcoders.w_dec[source]:
                continue
            read = reads[source]
            decoder = transcoders.w_dec[source][layer].to(device, torch.float64)[read.features]
            constant = constant + (read.gates * read.encoder_bias) @ decoder
            reconstruction = reconstruction + read.activations @ decoder
            decoders[source] = decoder
        w_skip = transcoders.w_skip[layer]
        skip = None if w_skip is None else w_skip.to(device, torch.float64)
        if skip is not None:
            constant = constant + own.hook_frame.shift @ skip
            reconstruction = reconstruction + own.hook_frame(inputs.stream[:, layer]) @ skip
        if out_gain is not None:
            decoders = {source: decoder * out_gain for source, decoder in decoders.items()}
            constant, reconstruction = constant * out_gain, reconstruction * out_gain
            skip = None if skip is None else skip * out_gain
        constant = out_scale[..., None] * constant
        error = inputs.mlp_out[:, layer] - out_scale[..., None] * reconstruction
        skip_in = skip_out = skip_weights = None
        if skip is not None:
            skip_in, skip_out = _rank_one_steps(own.hook_frame.apply(skip))
            skip_weights = (out_scale * own.hook_frame.scale).masked_fill(~real, 0)
        layers[layer] = ReplacedLayer(
            layer=layer,
            features=own.features.cpu(),
            gates=own.gates,
            input_scale=own.frame.scale.masked_fill(~real, 0),
            output_scale=out_scale.masked_fill(~real, 0),
            token_weights=(out_scale * own.frame.scale).masked_fill(~real, 0),
            encoder=own.frame.apply(own.w_enc[:, own.features]),
            encoder_bias=own.encoder_bias.masked_fill(zero, 0),
            decoder=decoders.pop(layer),
            skip_in=skip_in,
            skip_out=skip_out,
            skip_weights=skip_weights,
            bias=constant.masked_fill(zero, 0),
            error=error.masked_fill(zero, 0),
            num_features=transcoders.num_features(layer),
            activations=own.activations,
            decoders_from=decoders,
        )
    hooks = (transcoders.input_hook, transcoders.output_hook)
    return TranscoderCapture(layers, num_layers, repr(transcoders), *hooks, input_error, transcoders, parallel)


def input_frame(
    transcoders: TranscoderSet,
    stream: Tensor,
    norm_scale: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor,
    centred: bool,
) -> InputFrame:
    """The frame ``x_in = diag(s) X M + S`` of the set's input (:class:`InputFrame`, as
    :func:`replace_mlps` builds it) for streams ``stream`` ``[M, d]`` entering the MLP's norm, that
    norm at scales ``norm_scale`` ``[M]`` (its ``1/σ``, recomputed or held by the caller) with gain
    ``norm_weight`` and bias ``norm_bias`` ``[d]``; the format's own normalisation is computed on
    these streams. Its rows are ``[M, 1, d]``: ``frame(stream[:, None])`` is ``x_in``."""
    count, d = stream.shape
    inputs = MlpInputs(
        stream=stream.double().view(count, 1, 1, d),
        norm_scale=norm_scale.double().view(count, 1, 1),
        norm_weight=norm_weight.double().view(1, d),
        norm_bias=norm_bias.double().view(1, d),
        centred=centred,
        mlp_out=stream.new_zeros(count, 1, 1, d),
    )
    return InputFrame(transcoders.input_hook, transcoders.input_normalization, inputs, 0)


def _rank_one_steps(skip_map: Tensor) -> tuple[Tensor, Tensor]:
    """``skip_map [d, d]`` as ``Σ_k u_k (σ_k v_k)ᵀ``: ``([K, d], [K, d])`` over its non-zero singular
    values (relative to the largest, above float64's rounding), in float64."""
    u, sigma, vh = torch.linalg.svd(skip_map)
    keep = sigma > sigma.max() * skip_map.shape[0] * torch.finfo(torch.float64).eps
    return u[:, keep].T.contiguous(), (sigma[keep, None] * vh[keep]).contiguous()


def check_input_hook(transcoders: TranscoderSet, inputs: MlpInputs, tolerance: float, where: str) -> float | None:
    """Where the capture read the value of the set's input hook as the model computed it
    (``inputs.own_inputs``), the largest relative difference between the frozen input (before the
    format's own normalisation) and it over the set's layers; refused above ``tolerance`` (the
    model's MLP does not read what the set's hook says). None where there is nothing to compare."""
    hook = transcoders.input_hook
    if hook not in inputs.own_inputs:
        return None
    worst = 0.0
    for layer in transcoders.layers:
        frame = InputFrame(hook, "none", inputs, layer)
        own = inputs.own_inputs[hook][:, layer]
        difference = float((frame(inputs.stream[:, layer]) - own).abs().max() / own.abs().max().clamp_min(1e-300))
        worst = max(worst, difference)
        if difference > tolerance:
            raise ValueError(
                f"{where}: the frozen input of layer {layer}'s transcoder differs from the MLP's own input by "
                f"{difference:.2e} (relative; tolerance {tolerance:.1e}): this model's MLP does not read what the "
                f"set's input hook {hook!r} says ({HOOKS[hook]})"
            )
    return worst


__all__ = [
    "INPUT_HOOKS",
    "InputFrame",
    "OUTPUT_HOOKS",
    "MlpInputs",
    "ReplacedLayer",
    "TranscoderCapture",
    "replace_mlps",
    "input_frame",
]
