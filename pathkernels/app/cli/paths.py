"""``pathkernels paths``: the residual ratio of every path (or of a stratified sample), by length."""

from __future__ import annotations

from pathlib import Path

import torch

from pathkernels.adapters.huggingface import from_huggingface
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
from pathkernels.app.experiments import skip_network_attention
from pathkernels.core.decompose import decompose
from pathkernels.core.distributed import launched_group
from pathkernels.core.paths import count_paths


def paths_table(
    *,
    model: str | None = None,
    text: str | None = None,
    ids: list[int] | None = None,
    example: bool = False,
    layers: int = 6,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    seed: int = 0,
    samples_per_length: int | None = None,
    max_exact: int = 10**6,
    device: str = "cpu",
    out: Path | None = None,
):
    """``pathkernels paths``: the residual ratio of the paths by length. Under torchrun the ranks
    split the tree (gloo on CPU, NCCL with cuda); rank 0 reports, the others return None."""
    device = resolve_device(device, "paths")
    with launched_group(device) as distributed:
        if distributed and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        if model:
            local = local_model(model)
            inputs, what = model_inputs(
                local, text, tokens, default_tokens=DEFAULT_TOKENS["paths"], seed=seed, ids=ids, example=example
            )
            config = local.model.config
            check_attention_fits(
                "paths",
                batch=1,
                layers=config.num_hidden_layers,
                heads=config.num_attention_heads,
                tokens=sequence_length(local, inputs),
                bytes_per_entry=40,  # the model's maps, a float64 copy and the engine's centred operands
                device="cpu",  # the model runs on the CPU; the maps move to the device after
            )
            try:
                stack = from_huggingface(local.model, **inputs).to(torch.float64)
            except ValueError as error:
                raise CommandLineError(str(error).split(": ", 1)[-1]) from None
            attn = stack.attn
            source = (
                f"{model}, {local.weights} (L = {stack.num_layers}, H = {stack.num_heads}, "
                f"n = {attn.shape[-1]}); inputs: {what}"
            )
        else:
            tokens = DEFAULT_TOKENS["paths"] if tokens is None else tokens
            check_attention_fits(
                "paths", batch=1, layers=layers, heads=heads, tokens=tokens, bytes_per_entry=32, device="cpu"
            )
            attn = skip_network_attention(num_layers=layers, num_heads=heads, n=tokens, d_model=width, seed=seed)
            source = f"a '+skip' network at initialisation (L = {layers}, H = {heads}, n = {tokens}, seed {seed})"
        attn = attn.to(device)
        total = count_paths(attn.shape[1], attn.shape[2], skip=True)
        generator = torch.Generator().manual_seed(seed)
        if samples_per_length or total > max_exact:
            per_length = samples_per_length or 200
            dec = decompose(attn, skip=True, samples_per_length=per_length, generator=generator, progress=True)
            how = f"up to {per_length} distinct paths drawn per length, of {total:,} (lengths with fewer: all, exactly)"
        else:
            dec = decompose(attn, skip=True, progress=True)
            how = f"all {total:,} paths, exactly"
        if dec is None:  # another rank reports
            return None
        if distributed:
            how += f", split over {torch.distributed.get_world_size()} processes"
    table = dec.by_length()
    print(f"Residual ratio of the attention products P_p by path length: {source}; {how}")
    columns = [
        c
        for c in ("length", "path_count", "evaluated", "exact", "mean", "stderr", "median", "q10", "q90")
        if c in table.columns
    ]
    print(table[columns].to_string(index=False, float_format=float_format))
    if out is not None:
        save(
            out,
            "ratio_by_length",
            table,
            dec.plot(title=f"Residual ratio of the attention products P_p: {source}; {how}"),
        )
    return table
