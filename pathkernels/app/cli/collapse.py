"""``pathkernels collapse``: the residual ratio of the hidden states against depth."""

from __future__ import annotations

from pathlib import Path

from pathkernels.adapters.huggingface import from_huggingface
from pathkernels.analysis.metrics import residual_ratio
from pathkernels.app import experiments
from pathkernels.app.cli.common import (
    check_attention_fits,
    float_format,
    local_model,
    model_inputs,
    resolve_device,
    save,
    sequence_length,
)


def collapse_table(
    *,
    model: str | None = None,
    text: str | None = None,
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
        inputs, what = model_inputs(local, text, tokens, batch)
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
        stack = from_huggingface(local.model.to(device), **inputs)
        ratios = residual_ratio(stack.hidden_states.double())  # [L+1, B]
        import pandas as pd

        table = pd.DataFrame(experiments.collapse_rows(model, ratios))
        title = f"{model}, {local.weights}; inputs: {what}"
        plot_title = f"Rank collapse: {model}, {local.weights}"
    else:
        tokens = 32 if tokens is None else tokens
        check_attention_fits(
            "collapse", batch=batch, layers=layers, heads=heads, tokens=tokens, bytes_per_entry=16, device=device
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
            f"{seeds} seed(s) × {batch} inputs)"
        )
        plot_title = "Rank collapse at initialisation"
    wide = table.pivot(index="depth", columns="variant", values="median")[list(dict.fromkeys(table["variant"]))]
    print(f"Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states by depth: {title}")
    print(wide.to_string(float_format=float_format))
    if out is not None:
        save(out, "collapse", table, experiments.plot_collapse(table, title=plot_title))
    return table
