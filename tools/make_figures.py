"""Draw the figures of docs/USAGE.md ("Figures") into docs/images/ from the shipped fixtures.

    .venv/bin/python tools/make_figures.py [--out docs/images]

Each figure is the ``plot()`` of a result on a fixture's example input (pathkernels.fixtures),
saved at 100 dpi; about 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

import pathkernels as pk  # noqa: E402
from pathkernels.fixtures import load_fixture  # noqa: E402

POSITION = 20  # the 4th token of the second copy
KEY = POSITION - 15  # the token after the first copy of its token: where the induction heads look


def save(figure, out: Path, name: str) -> None:
    figure.savefig(out / name, dpi=100)
    plt.close(figure)
    print(f"{out / name}: {(out / name).stat().st_size // 1024} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)

    model, inputs = load_fixture("attn_only_2l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs, query_key=True)
    target = inputs["input_ids"][0, KEY].item()
    looks = pk.score_decomposition(stack, 1, 0, query=POSITION)
    save(looks.plot(KEY, other=0), out, "attn_only_2l_scores.png")
    paths = [[head, -1] for head in range(stack.num_heads)] + [[-1, -1]]
    check = pk.causal_check(
        model, stack, inputs, paths, ["embedding"] * len(paths), layer=1, head=0, side="key", query=POSITION,
        key=KEY, readout=pk.logit(model, target),
    )  # fmt: skip
    save(check.plot(), out, "attn_only_2l_causal_check.png")

    model, inputs = load_fixture("gpt2_4l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs)
    save(pk.decompose(stack).plot(), out, "gpt2_4l_decomposition.png")
    model, inputs = load_fixture("gpt2_4l", batch=3)
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs)
    readouts = [pk.logit(model, inputs["input_ids"][b, KEY].item()) for b in range(3)]
    mean = pk.batch_attribution(stack, readouts, positions=[[POSITION]] * 3, top_k=6)
    save(mean.plot(6), out, "gpt2_4l_batch_attribution.png")

    model, inputs = load_fixture("llama_2l")
    stack, _ = pk.adapters.capture_huggingface_residual(model, **inputs, query_key=True)
    target = inputs["input_ids"][0, KEY].item()
    result = pk.path_attribution(stack, pk.logit(model, target), positions=POSITION, top_k=8)
    save(result.plot(8), out, "llama_2l_attribution.png")


if __name__ == "__main__":
    main()
