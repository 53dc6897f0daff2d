"""A capture that checks itself against the model: the sum of its paths, and the logits it reads
out, beside the model's own unmodified forward pass on the same inputs.

A capture reads the model through a forward pass of its own: eager attention with
``output_attentions``, hooks on the norms and MLPs, float64 softmax and norms in a float64 model.
Where that pass differs from what the model computes when it is simply called (a family whose
``output_attentions`` branch is not its normal one, a clamp the paths cannot hold, a norm read
with the wrong gain, positions that are not the model's), the paths still sum exactly, to the
wrong value. So after every capture, :func:`check_huggingface_capture` and
:func:`check_transformer_lens_capture` run the model once more as a user would (eval mode, no
gradients, its own attention implementation, nothing changed: a read-only hook at most, for the
stream entering the final norm, and a float64 model's attention masks kept finite in float32,
which changes no finite result, :func:`~pathkernels.adapters.huggingface.finite_masks`) and
compare, on the real tokens:

- the stream: ``Σ_p term_p`` (:meth:`AttentionStack.path_sum`) against the model's
  stream entering its final norm (the last hidden state of a post-norm model);
- the logits (where the model's output is its linear readout: an LM head, a sequence classifier's
  score head at the token it reads; before Gemma-2's soft cap): the reconstruction read out through
  the frozen final norm and the unembedding, against the model's logits (capped alike).

Where the model's logits at every token would exceed :data:`_CHECKED_LOGITS_BYTES` (4.2 GB at
Gemma-2-2B's vocabulary and 4,096 tokens, with copies for its soft cap) and its forward takes
``logits_to_keep``, its logits are compared at an even spread of positions that fits, each
sequence's last real token among them; the stream is still compared at every token.

Each difference is relative to the largest entry of the model's own tensor. Beyond
:func:`check_tolerance` the capture is refused by name, with both differences. The tolerance
leaves room for the model's own float32 steps (a float64 Hugging Face model computes its softmax,
RMSNorms and rotary angles in float32: up to 1.3e-5 relative measured, weights ×15), far below the
discrepancies it exists to catch (4.5e-3 and more).
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.adapters.huggingface import _attention_layers, _forward_parameters, finite_masks, score_head

# Measured (tests/test_capture_self_check.py: every family the capture reads, weights ×5, random
# biases and norm gains, 2 × 7 tokens): a float64 model against its own forward at most 2.9e-7
# relative (its float32 softmax, RMSNorms and rotary angles; an independent float64 reference saw
# up to 1.3e-5 at weights ×15), a float32 model at most 1.1e-6. The tolerance leaves 15× room above
# the larger and is 20× below the smallest discrepancy found (Falcon's ALiBi, 4.5e-3).
_TOLERANCE = {torch.float64: 2e-4, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def check_tolerance(dtype: torch.dtype) -> float:
    """The largest relative difference a capture of a ``dtype`` model may show against the model's
    own forward pass (:data:`_TOLERANCE`, from measurement)."""
    return _TOLERANCE.get(dtype, _TOLERANCE[torch.float32])


@dataclass(frozen=True)
class CaptureCheck:
    """How a capture compared with the model's own forward pass on the same inputs.

    ``stream_error``: ``max |Σ_p term_p − stream| / max |stream|`` over the real tokens, ``stream``
    the model's, entering its final norm; ``logits_error``: the same for the logits read out from
    the reconstruction (None where the model's output is not its linear readout); ``tolerance``:
    the bound both met; ``seconds``: the check's cost (the model's forward pass and the sums);
    ``logits_positions``: the positions whose logits were compared, where not every token's (a
    long prompt's, module docstring), else None."""

    stream_error: float
    logits_error: float | None
    tolerance: float
    seconds: float
    logits_positions: int | None = None


@contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode (no dropout) and no gradients for the call; the user's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def warn_if_training(model: nn.Module, where: str) -> None:
    """Warn when ``model`` is in train mode with active dropout: the capture runs it in eval mode (no
    dropout), so the user's own ``model(ids)`` differs from the capture by its dropout until they
    call ``model.eval()`` (a freshly built Hugging Face model is in train mode)."""
    if not model.training:
        return
    active = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
    ]
    config = getattr(model, "config", None)
    rates = [
        getattr(config, key, 0) or 0 for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout")
    ]
    if active or any(isinstance(rate, (int, float)) and rate > 0 for rate in rates):
        warnings.warn(
            f"{where}: the model is in train mode with active dropout ({len(active)} dropout module(s) with p > 0"
            f"{', e.g. ' + active[0] if active else ''}); the capture runs it in eval mode, without dropout, so "
            "your own model(...) calls differ from it until you call model.eval()",
            UserWarning,
            stacklevel=3,
        )


def _relative(got: Tensor, want: Tensor, real: Tensor) -> float:
    """``max |got − want| / max |want|`` over the real rows (``real [B, n]``) of ``[B, n, ·]`` tensors."""
    keep = real.to(got.device)[..., None]
    got, want = (torch.where(keep, t.double().to(got.device), 0.0) for t in (got, want))  # padded rows may be NaN
    if not bool(torch.isfinite(want).all()):
        return float("inf")
    difference, scale = (got - want).abs().amax(), want.abs().amax()
    return float(difference / scale) if float(scale) > 0 else float(difference)


def read_out_stream(capture, stream: Tensor) -> Tensor:
    """``stream [B, n, d]`` through the capture's frozen final norm (its kind, scale, γ and β; none
    for a post-norm model): ``D (x C) Γ + 1 βᵀ``, float64."""
    x = stream.double()
    if capture.final_scale is None:
        return x
    x = x - x.mean(-1, keepdim=True) if capture.final_centred else x
    return capture.final_scale[..., None] * x * capture.final_weight + capture.final_bias


def _soft_capped(logits: Tensor, cap: float | None) -> Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _refuse_if_not_finite(family: str, stream: Tensor, real: Tensor, where: str) -> None:
    """Refuse, saying so, a check whose reference is not finite: the model's own forward pass gives
    NaN or inf at real tokens (a fully masked padded query whose softmax the model takes in float32
    gives a NaN row, which the next layer's values carry to every real token as ``0 · NaN``)."""
    bad = ~torch.isfinite(stream.detach()).all(-1).cpu() & real.cpu()
    if bool(bad.any()):
        rows = sorted({int(b) for b in bad.nonzero()[:, 0]})
        padded = not bool(real.cpu()[rows].all())
        cause = (
            "a padded query with no key to attend, whose softmax the model takes in float32, gives a NaN row "
            "that reaches the real tokens"
            if padded
            else "a step it takes in float32 or lower overflows, where the capture's float64 does not"
        )
        advice = ", or run those sequences without padding" if padded else ""
        raise ValueError(
            f"{where}: this {family} model's own forward pass gives NaN or inf at real tokens of sequence(s) {rows} "
            f"({cause}), so there is nothing to check the capture against. Pass check=False to keep it (its paths "
            f"sum to the stream computed in float64){advice}"
        )


def _refuse_if_beyond(family: str, stream_error: float, logits_error: float | None, tolerance: float, where: str):
    if all(error <= tolerance for error in (stream_error, logits_error) if error is not None):  # NaN fails too
        return
    logits = "" if logits_error is None else f", its logits {logits_error:.2g} of the model's logits' scale off"
    raise ValueError(
        f"{where}: the capture of this {family} model does not reproduce the model's own forward pass on the same "
        f"inputs: the sum of its paths is {stream_error:.2g} of the stream's scale off{logits}, beyond the "
        f"tolerance {tolerance:.2g} (room for the model's own float32 rounding). The paths would sum exactly to "
        "a value the model does not compute. Check the inputs (position_ids, attention_mask), or pass "
        "check=False to keep the capture anyway"
    )


def check_huggingface_capture(
    model: nn.Module, inputs: dict, stack, capture, final_input: nn.Module | None, where: str, bar=None
) -> CaptureCheck:
    """Compare a Hugging Face capture with ``model(**inputs)`` (module docstring); refuse it by name
    beyond :func:`check_tolerance`. ``inputs``: those the capture ran on (the positions it used
    included); ``final_input``: the module whose input is the stream the capture holds as
    ``residual`` (the final norm, OPT's ``project_out``), None where it is the last hidden state;
    ``bar``: a progress bar (or None), updated as each attention layer runs and told each step."""
    start = time.monotonic()
    seen: list[Tensor] = []
    handles = []
    if final_input is not None:  # read-only: the hook keeps a copy of the module's input
        handles.append(
            final_input.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
        )
    if bar is not None:  # reads nothing: counts the layers as they run
        bar.set_postfix_str("the self-check: the model's own forward pass")
        handles += [
            layer.attention.register_forward_hook(lambda *_: bar.update(1)) for layer in _attention_layers(model)
        ]
    batch, tokens, d = stack.attn.shape[0], stack.attn.shape[-1], stack.d_model
    real = torch.ones(batch, tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask.bool().cpu()
    positions = _checked_positions(model, capture, real)
    kept = {} if positions is None else {"logits_to_keep": positions}
    try:
        with _eval_mode(model), finite_masks(model):
            output = model(**inputs, **kept, output_hidden_states=final_input is None)
    finally:
        for handle in handles:
            handle.remove()
    stream = (seen[-1] if final_input is not None else output.hidden_states[-1]).reshape(batch, tokens, d)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    _refuse_if_not_finite(family, stream, real, where)
    if bar is not None:
        bar.set_postfix_str("the self-check: the path sum")
    reconstruction = stack.path_sum()
    stream_error = _relative(reconstruction, stream, real)
    if bar is not None:
        bar.set_postfix_str("the self-check: the logits")
    logits_error = _huggingface_logits_error(model, output, capture, reconstruction, real, positions)
    tolerance = check_tolerance(next(model.parameters()).dtype)
    _refuse_if_beyond(family, stream_error, logits_error, tolerance, where)
    count = None if positions is None else positions.numel()
    return CaptureCheck(stream_error, logits_error, tolerance, time.monotonic() - start, count)


# The model's logits a check compares at once, at most (where its forward takes logits_to_keep).
_CHECKED_LOGITS_BYTES = 1 << 29


def _checked_positions(model: nn.Module, capture, real: Tensor) -> Tensor | None:
    """The positions whose logits the check compares ``[P]``, sorted, or None for every token: where
    the model's logits ``[B, n, vocab]`` would exceed :data:`_CHECKED_LOGITS_BYTES` and its forward
    takes ``logits_to_keep``, an even spread of positions that fits, with each sequence's last real
    token (``real [B, n]``)."""
    if capture.unembedding is None or capture.pooled_token is not None:
        return None
    batch, tokens = real.shape
    row_bytes = batch * capture.unembedding.shape[0] * capture.unembedding.element_size()
    if tokens * row_bytes <= _CHECKED_LOGITS_BYTES or "logits_to_keep" not in _forward_parameters(model):
        return None
    spread = torch.linspace(0, tokens - 1, max(1, _CHECKED_LOGITS_BYTES // row_bytes - batch)).round().long()
    last = tokens - 1 - real.flip(-1).int().argmax(-1)  # each sequence's last real token
    return torch.cat((spread, last)).unique()


def _huggingface_logits_error(
    model, output, capture, reconstruction: Tensor, real: Tensor, positions: Tensor | None = None
) -> float | None:
    """The logits' difference where the model's logits are its linear readout of the final norm:
    an LM head (``capture.unembedding``) or a sequence classifier's ``score`` at its pooled token;
    ``positions``: the only positions the model's logits hold (None: every token)."""
    logits = getattr(output, "logits", None)
    if not isinstance(logits, Tensor):
        return None
    normed = read_out_stream(capture, reconstruction)
    if positions is not None:
        normed, real = normed[:, positions.to(normed.device)], real[:, positions]
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if capture.pooled_token is not None:  # a sequence classifier: its score head at the pooled token (no cap)
        pooled = capture.pooled_token.cpu()
        rows = normed[torch.arange(normed.shape[0]), pooled.to(normed.device)]
        weight, bias = score_head(model)
        ours = rows @ weight.double().T.to(rows.device)
        if bias is not None:
            ours = ours + bias.double().to(rows.device)
        read = real[torch.arange(real.shape[0]), pooled]  # a pooled token the mask pads is refused when read
        return _relative(ours[:, None], logits.reshape(ours.shape)[:, None], read[:, None])
    if capture.unembedding is None or capture.final_scale is None or logits.shape[-1] != capture.unembedding.shape[0]:
        return None  # a head that is not a linear readout of the final norm (BERT's MLM transform, ViT)
    return _readout_error(normed, capture, float(cap) if cap else None, logits, real)


_READOUT_BLOCK = 1 << 23  # entries of the logits read out at once (64 MiB in float64)


def _readout_error(normed: Tensor, capture, cap: float | None, logits: Tensor, real: Tensor) -> float:
    """:func:`_relative` of the logits read out from ``normed [B, n, d]`` (the reconstruction through
    the frozen final norm) by the capture's unembedding, ``normed W_Uᵀ + b_U`` soft-capped by
    ``cap``, against the model's ``logits`` on the real tokens, a block of words at a time (no
    ``[B, n, vocab]`` float64 copy: 1 GB for each of three at Llama-3.2-1B's vocabulary and 1,024
    tokens). The product is taken in the unembedding's dtype, float32 at least: the model's logits
    carry that rounding themselves (about 1e-7 relative), far below the tolerance."""
    weight, bias = capture.unembedding, capture.unembedding_bias
    dtype = torch.promote_types(weight.dtype, torch.float32)
    keep = real.to(normed.device)
    every = bool(keep.all())  # then the rows as they are, not a copy of the model's [B·n, vocab] logits
    rows = (normed.flatten(0, 1) if every else normed[keep]).to(dtype)  # [R, d]: padded rows may be NaN
    want_rows = logits.reshape(*normed.shape[:2], -1).to(normed.device)
    want_rows = want_rows.flatten(0, 1) if every else want_rows[keep]  # [R, vocab]
    difference = scale = torch.zeros((), dtype=torch.float64, device=normed.device)
    block = max(1, _READOUT_BLOCK // max(rows.shape[0], 1))  # words per block: R × block entries at most
    for start in range(0, weight.shape[0], block):
        ours = rows @ weight[start : start + block].to(normed.device, dtype).T
        if bias is not None:
            ours = ours + bias[start : start + block].to(normed.device, dtype)
        want = want_rows[:, start : start + block]
        scale = torch.maximum(scale, want.abs().amax().double())  # NaN and inf carried: amax propagates them
        difference = torch.maximum(difference, (_soft_capped(ours, cap) - want.to(dtype)).abs().amax().double())
    scale, difference = float(scale), float(difference)
    if not math.isfinite(scale):
        return float("inf")
    return difference / scale if scale > 0 else difference


def check_cached_capture(model, cache, stack, capture, where: str) -> CaptureCheck:
    """Compare a TransformerLens capture read from a user's ActivationCache with the stream its last
    block left in that cache (``hook_resid_post``): the paths, built from the cache's patterns,
    MLP outputs and norm scales and the model's weights, must sum to it; refuse it by name beyond
    :func:`check_tolerance`. (No logits: the cache holds none, and the model is not run again.)"""
    start = time.monotonic()
    stream = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    real = torch.ones(stream.shape[:2], dtype=torch.bool) if stack.token_mask is None else stack.token_mask.bool().cpu()
    family = getattr(model.cfg, "original_architecture", None) or type(model).__name__
    _refuse_if_not_finite(family, stream, real, where)
    stream_error = _relative(stack.path_sum(), stream, real)
    tolerance = check_tolerance(next(model.parameters()).dtype)
    _refuse_if_beyond(family, stream_error, None, tolerance, where)
    return CaptureCheck(stream_error, None, tolerance, time.monotonic() - start)


def check_transformer_lens_capture(model, tokens: Tensor, attention_mask, stack, capture, where: str) -> CaptureCheck:
    """Compare a TransformerLens capture with the model's own forward pass on the same tokens: its
    logits (``model(tokens)``, soft-capped as it caps them) and the stream its last block leaves
    (``run_with_cache`` of that one hook, which only reads); refuse it by name beyond
    :func:`check_tolerance`."""
    start = time.monotonic()
    name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    with _eval_mode(model):
        logits, cache = model.run_with_cache(tokens, names_filter=lambda hook: hook == name, **kwargs)
    stream = cache[name]
    real = torch.ones(stream.shape[:2], dtype=torch.bool) if stack.token_mask is None else stack.token_mask.bool().cpu()
    family = getattr(model.cfg, "original_architecture", None) or type(model).__name__
    _refuse_if_not_finite(family, stream, real, where)
    reconstruction = stack.path_sum()
    stream_error = _relative(reconstruction, stream, real)
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    cap = float(cap) if cap is not None and float(cap) > 0 else None
    logits_error = _readout_error(read_out_stream(capture, reconstruction), capture, cap, logits, real)
    dtype = next(model.parameters()).dtype
    tolerance = check_tolerance(dtype)
    _refuse_if_beyond(family, stream_error, logits_error, tolerance, where)
    return CaptureCheck(stream_error, logits_error, tolerance, time.monotonic() - start)
