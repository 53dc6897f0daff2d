"""``pathkernels collapse``: the residual ratio of the hidden states against depth."""

from __future__ import annotations

from pathlib import Path

import torch

from pathkernels.adapters.huggingface import from_huggingface
from pathkernels.analysis.metrics import residual_ratio
from pathkernels.app import experiments
from pathkernels.app.cli.base import DEFAULT_TOKENS, CommandLineError
from pathkernels.app.cli.common import (
    check_attention_fits,
    float_format,
    local_model,
    model_inputs,
    resolve_device,
    save,
    sequence_length,
)
from pathkernels.app.cli.sizes import collapse_bytes, model_name, network_parameters
from pathkernels.core._memory import check_fits


def collapse_table(
    *,
    model: str | None = None,
    text: str | None = None,
    ids: list[int] | None = None,
    example: bool = False,
    layers: int = 12,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    batch: int = 8,
    seeds: int = 3,
    device: str = "cpu",
    out: Path | None = None,
):
    """``pathkernels collapse``: print (and with ``out``, write) the median residual ratio by depth."""
    device = resolve_device(device, "collapse")
    if model:
        local = local_model(model)
        inputs, what = model_inputs(
            local, text, tokens, batch, default_tokens=DEFAULT_TOKENS["collapse"], ids=ids, example=example
        )
        config = local.model.config
        check_attention_fits(
            "collapse",
            batch=batch,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            tokens=sequence_length(local, inputs),
            bytes_per_entry=16,  # the model's float32 maps and their stacked copy
            device=device,
        )
        inputs = {name: value.to(device) for name, value in inputs.items()}
        try:
            stack = from_huggingface(local.model.to(device), **inputs)
        except ValueError as error:
            raise CommandLineError(str(error).split(": ", 1)[-1]) from None
        ratios = residual_ratio(stack.hidden_states.double())  # [L+1, B]
        import pandas as pd

        name = model_name(model)
        table = pd.DataFrame(experiments.collapse_rows(name, ratios))
        title = f"{model}, {local.weights}; inputs: {what}"
        plot_title = f"Rank collapse: {name}, {local.weights}"
    else:
        tokens = DEFAULT_TOKENS["collapse"] if tokens is None else tokens
        check_attention_fits(
            "collapse", batch=batch, layers=layers, heads=heads, tokens=tokens, bytes_per_entry=16, device=device
        )
        check_fits(  # checked on the host before torch was imported; here the device's memory
            collapse_bytes(layers, heads, width, tokens, batch),
            torch.device(device),
            "pathkernels collapse",
            f"the networks of L = {layers}, H = {heads}, d = {width} (the transformer variant: "
            f"{network_parameters(layers, heads, width, mlp=True)[0]:,} parameters) and their activations for "
            f"{batch} × {tokens} tokens need about",
            "pass a smaller --width, --layers, --tokens or --batch",
            error=CommandLineError,
        )
        table = experiments.collapse_vs_depth(
            num_layers=layers,
            d_model=width,
            num_heads=heads,
            n=tokens,
            batch=batch,
            seeds=seeds,
            device=device,
            progress=True,
        )
        title = (
            f"pathkernels.models at initialisation (L = {layers}, H = {heads}, d = {width}, n = {tokens}, "
            f"{'seed 0' if seeds == 1 else f'seeds 0 … {seeds - 1}'}, {batch} inputs each)"
        )
        plot_title = "Rank collapse at initialisation"
    wide = table.pivot(index="depth", columns="variant", values="median")[list(dict.fromkeys(table["variant"]))]
    print(f"Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states by depth: {title}")
    print(wide.to_string(float_format=float_format))
    if out is not None:
        save(out, "collapse", table, experiments.plot_collapse(table, title=plot_title))
    return table
