"""The paper's experiments on the embedded default, as DataFrames and matplotlib figures.

- :func:`collapse_vs_depth`: residual ratio of the hidden states against depth for the four
  variants of :mod:`pathkernels.app.models` at initialisation (pure attention, +MLP, +skip, transformer);
- :func:`path_length_distribution`: how the ``(H+1)^L`` paths of common architectures spread over
  lengths, ``C(L, k) H^k``;
- :func:`ratio_by_length`: the exact residual ratio of every path of a network, by length;
- :func:`path_effectiveness`: train a small attention-only model with skip connections to sort, then
  its accuracy when only paths of length ≤ k are kept, exactly, from :func:`pathkernels.length_sums`;
- :func:`induction_example` and :func:`trained_collapse`: the trained fixtures (which paths write an
  induction head's prediction; how far the path terms of a trained model collapse against its
  initialisation).

Plots follow one convention: labelled axes, log scales where values span decades, a legend.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.analysis.metrics import residual_ratio
from pathkernels.app.models import VARIANTS, SelfAttentionNetwork
from pathkernels.core._figures import require
from pathkernels.core._progress import progress_bar
from pathkernels.core.decompose import decompose
from pathkernels.core.length_sums import truncated_output
from pathkernels.core.paths import count_by_length

# (layers, heads) of architectures people decompose.
ARCHITECTURES: dict[str, tuple[int, int]] = {
    "BERT-base / GPT-2 small / ViT-B": (12, 12),
    "GPT-2 medium": (24, 16),
    "GPT-2 XL": (48, 25),
    "Llama-2-7B": (32, 32),
    "Llama-3-70B": (80, 64),
}


def collapse_rows(variant: str, ratios: Tensor) -> list[dict]:
    """Rows of :func:`collapse_vs_depth` from ``ratios [L+1, ...]``: per depth, the ``mean``,
    ``median``, ``q10`` and ``q90`` over everything after the depth dimension."""
    rows = []
    for depth, values in enumerate(ratios.double().flatten(1)):
        rows.append(
            {
                "variant": variant,
                "depth": depth,
                "mean": values.mean().item(),
                "median": values.quantile(0.5).item(),  # interpolated, as q10 and q90
                "q10": values.quantile(0.1).item(),
                "q90": values.quantile(0.9).item(),
            }
        )
    return rows


# --- collapse versus depth ----------------------------------------------------------------------


def collapse_vs_depth(
    *,
    num_layers: int = 12,
    d_model: int = 64,
    num_heads: int = 4,
    n: int = 32,
    batch: int = 8,
    seeds: int = 3,
    variants: Sequence[str] = tuple(VARIANTS),
    dtype=torch.float64,
    device="cpu",
    progress: bool = False,
):
    """Residual ratio ``‖X_l − 1μᵀ‖_{1,∞} / ‖X_l‖_{1,∞}`` of the hidden states at every depth l.

    For each variant and seed: a freshly initialised :class:`~pathkernels.app.models.SelfAttentionNetwork`
    of ``num_layers`` layers, fed ``batch`` standard normal inputs ``[n, d_model]`` (drawn on the
    CPU, so that a seed gives the same inputs on any ``device``), run on ``device``.

    Returns:
        DataFrame with columns ``variant``, ``depth`` (0 = the input), ``mean``, ``median``,
        ``q10``, ``q90`` over batch and seeds.
    """
    pd = require("pandas")
    rows = []
    bar = progress_bar(len(variants) * seeds, enabled=progress, unit="model", desc="collapse vs depth")
    for variant in variants:
        ratios = []
        for seed in range(seeds):
            generator = torch.Generator().manual_seed(seed)
            torch.manual_seed(seed)
            model = SelfAttentionNetwork.variant(
                variant, d_model=d_model, num_heads=num_heads, num_layers=num_layers
            ).to(device=device, dtype=dtype)
            x = torch.randn(batch, n, d_model, generator=generator, dtype=dtype).to(device)
            with torch.no_grad():
                ratios.append(residual_ratio(model(x).hidden_states).cpu())  # [L+1, B]
            if bar:
                bar.update(1)
        rows += collapse_rows(variant, torch.cat(ratios, dim=1))
    if bar:
        bar.close()
    return pd.DataFrame(rows)


def plot_collapse(table, ax=None, *, title: str = "Rank collapse at initialisation"):
    """Residual ratio against depth, one line per variant (log y), under ``title`` (say what the
    weights are). Returns the Figure."""
    plt = _pyplot()
    fig, ax = _axes(plt, ax)
    floor = 2 * torch.finfo(torch.float64).eps
    # A ratio of exactly 0 (every token equal to the last bit) has no place on a log axis: such
    # points sit on the axis' bottom edge, a decade below the smallest positive value or the
    # round-off line, marked apart, so that the axis spans the values that were measured.
    values = table[["median", "q10", "q90"]].to_numpy(dtype=float)
    positive = values[values > 0]
    lowest = float(positive.min()) if positive.size else floor
    # The axis spans the data: down to the round-off line only where the data come near it (an
    # exact 0 is below it).
    near = lowest <= 1e3 * floor or bool((values == 0).any())
    bottom = min(lowest, floor) / 10 if near else lowest / 2
    for i, (variant, rows) in enumerate(table.groupby("variant", sort=False)):
        ax.plot(rows["depth"], rows["median"].clip(lower=bottom), "o-", ms=3, color=f"C{i}", label=variant)
        ax.fill_between(
            rows["depth"], rows["q10"].clip(lower=bottom), rows["q90"].clip(lower=bottom), color=f"C{i}", alpha=0.2
        )
        zero = rows["median"] == 0
        ax.plot(rows["depth"][zero], [bottom] * int(zero.sum()), "v", ms=6, color=f"C{i}", clip_on=False)
    if float(table["median"].eq(0).sum()):
        ax.plot([], [], "v", color="0.3", label="exactly 0 (all tokens equal)")
    if float(values.min()) < 1e3 * floor:  # only where the data come near it
        ax.axhline(floor, color="0.5", linestyle=":", linewidth=1, label="float64 round-off")
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom)
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_xlabel("depth (layers applied)")
    ax.set_ylabel("residual ratio ‖X − 1μᵀ‖ / ‖X‖ (ℓ1,∞)")
    ax.set_title(fitted_title(f"{title} (median, 10–90 % band)"), fontsize="medium")
    ax.legend(fontsize="small", ncol=2 if table["variant"].nunique() > 2 else 1)
    return fig


def fitted_title(text: str, width: int = 72) -> str:
    """``text`` wrapped at about ``width`` characters, so that a figure's title fits its width."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


# --- path-length distribution -------------------------------------------------------------------


def path_length_distribution(architectures: dict[str, tuple[int, int]] | None = None):
    """Share of the ``(H+1)^L`` paths (skip allowed at every layer) that have length k: ``C(L, k) H^k / (H+1)^L``.

    Returns:
        DataFrame with ``architecture``, ``layers``, ``heads``, ``length``, ``path_count`` (exact
        Python int), ``share`` and ``log10_share``.
    """
    pd = require("pandas")
    rows = []
    for name, (layers, heads) in (architectures or ARCHITECTURES).items():
        counts = count_by_length(layers, heads, skip=True)
        log_total = layers * math.log10(heads + 1)
        for k, count in enumerate(counts):
            log_share = math.log10(count) - log_total
            rows.append(
                {
                    "architecture": name,
                    "layers": layers,
                    "heads": heads,
                    "length": k,
                    "path_count": count,
                    "share": 10**log_share,
                    "log10_share": log_share,
                }
            )
    frame = pd.DataFrame(rows)
    frame["path_count"] = frame["path_count"].astype(object)
    return frame


def plot_path_lengths(table, ax=None):
    """Share of paths against relative length k / L, one line per architecture (log y)."""
    plt = _pyplot()
    fig, ax = _axes(plt, ax)
    for name, rows in table.groupby("architecture", sort=False):
        layers, heads = int(rows["layers"].iloc[0]), int(rows["heads"].iloc[0])
        ax.plot(
            rows["length"] / layers,
            rows["share"].clip(lower=1e-300),
            ".-",
            ms=3,
            label=f"{name} (L={layers}, H={heads})",
        )
    ax.set_yscale("log")
    # Six decades hold every peak and its shoulders; the far tails (down to 1e-90) would squash them.
    ax.set_ylim(bottom=1e-6, top=1.5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("relative path length $k / L$")
    ax.set_ylabel("share of paths $\\binom{L}{k} H^k / (H+1)^L$")
    ax.set_title("Most paths are of length ≈ $L H / (H+1)$", fontsize="medium")
    ax.legend(fontsize="x-small", loc="upper left", frameon=False)
    return fig


# --- exact residual ratio by path length --------------------------------------------------------


def ratio_by_length(
    *, num_layers: int = 6, num_heads: int = 4, n: int = 32, d_model: int = 64, seed: int = 0, progress: bool = False
):
    """Exact decomposition of the attention of a "+skip" network at initialisation into all of
    its ``(H+1)^L`` paths: the residual ratio of every ``P_p`` (see :func:`pathkernels.decompose`).

    Returns:
        The :class:`~pathkernels.PathDecomposition` (``.by_length()`` is the table, ``.plot()`` the figure).
    """
    attn = skip_network_attention(num_layers=num_layers, num_heads=num_heads, n=n, d_model=d_model, seed=seed)
    return decompose(attn, skip=True, progress=progress)


def skip_network_attention(*, num_layers: int, num_heads: int, n: int, d_model: int, seed: int) -> torch.Tensor:
    """The attention maps ``[1, L, H, n, n]`` of a "+skip" network at initialisation (its weights
    from ``seed``) on one random input ``[1, n, d_model]`` (from a generator of the same seed): what
    :func:`ratio_by_length` and ``pathkernels paths`` decompose."""
    torch.manual_seed(seed)
    model = SelfAttentionNetwork.variant("+skip", d_model=d_model, num_heads=num_heads, num_layers=num_layers)
    x = torch.randn(1, n, d_model, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).attn


# --- path effectiveness on sorting ----------------------------------------------------------------


class SortingModel(nn.Module):
    """Token and position embeddings, an attention-only network with skip connections and no
    normalisation or biases (so its output is exactly the sum over its paths), and a linear readout.

    ``tokens [B, n] -> logits [B, n, V]``: position i should predict the i-th smallest token.
    """

    def __init__(self, vocab: int = 16, n: int = 8, d_model: int = 64, num_heads: int = 4, num_layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(n, d_model) / math.sqrt(d_model))
        self.network = SelfAttentionNetwork(d_model, num_heads, num_layers, skip=True, bias=False)
        self.unembed = nn.Linear(d_model, vocab, bias=False)

    def embedding(self, tokens: Tensor) -> Tensor:
        """``X = E[tokens] + P``: ``[B, n] -> [B, n, d]``, the input of every path."""
        return self.embed(tokens) + self.position

    def forward(self, tokens: Tensor):
        result = self.network(self.embedding(tokens))
        return self.unembed(result.output), result


def sorting_batch(batch: int, n: int, vocab: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random ``tokens [batch, n]`` in ``[0, vocab)`` (repeats allowed) and their sorted ``target``."""
    tokens = torch.randint(0, vocab, (batch, n), generator=generator)
    return tokens, tokens.sort(dim=1).values


class ThreadChoice:
    """The torch thread count of a training loop, chosen by measurement as it runs: at the start of
    every ``every`` steps, ``trials`` steps run on one thread and ``trials`` on all of them, and the
    faster count runs the rest. On a quiet 2-core machine both threads win by about 1.2×; on a
    loaded one the thread pool's hand-offs stall (one thread won 1.7× beside two busy processes,
    and the demo's training once took 13× its quiet time on two). The sorting model's small
    products gave the same bits on one thread and two on the development machine; the tests hold
    any machine to the same accuracies and to weights within 1e-5.

    ``with choice.step(i):`` around step i; the count in force before is restored by ``close()``."""

    def __init__(self, every: int = 100, trials: int = 2):
        self.most, self.every, self.trials = torch.get_num_threads(), every, trials
        self.chosen, self.seconds = self.most, {}

    @contextlib.contextmanager
    def step(self, index: int):
        phase = index % self.every
        if self.most == 1:
            yield
            return
        trial = phase < 2 * self.trials
        count = (1 if phase < self.trials else self.most) if trial else self.chosen
        if phase == 0:
            self.seconds = {}
        torch.set_num_threads(count)
        start = time.perf_counter()
        yield
        if trial:
            self.seconds[count] = self.seconds.get(count, 0.0) + time.perf_counter() - start
            if phase == 2 * self.trials - 1:
                self.chosen = min(self.seconds, key=self.seconds.get)

    def close(self) -> None:
        torch.set_num_threads(self.most)


@dataclass
class EffectivenessResult:
    table: object  # DataFrame: max_length, token_accuracy, sequence_accuracy, path_count
    model: SortingModel
    train_seconds: float
    final_loss: float


def path_effectiveness(
    *,
    vocab: int = 16,
    n: int = 8,
    d_model: int = 64,
    num_heads: int = 4,
    num_layers: int = 3,
    steps: int = 1000,
    batch: int = 128,
    lr: float = 3e-3,
    test_size: int = 2048,
    seed: int = 0,
    progress: bool = False,
) -> EffectivenessResult:
    """Train :class:`SortingModel` to sort, then its accuracy using only paths of length ≤ k.

    Training: Adam with a cosine learning-rate decay over ``steps`` batches of fresh random
    sequences (about a minute on 2 CPU cores with the defaults), on the thread count that runs
    faster on the machine as it is (:class:`ThreadChoice`).

    The output kept is ``Σ_{len(p) ≤ k} P_p X W_p`` (attention patterns of the full forward pass,
    computed exactly by :func:`pathkernels.length_sums` in float64), read out by the model's
    unembedding; k = L recovers the model. Accuracy is over held-out random sequences.

    Returns:
        :class:`EffectivenessResult`; ``table`` has one row per k = 0..L with ``max_length``,
        ``token_accuracy``, ``sequence_accuracy`` and ``path_count`` (paths of length ≤ k).
    """
    require("pandas")
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = SortingModel(vocab, n, d_model, num_heads, num_layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)  # decays to 0: no late spikes
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    bar = progress_bar(steps, enabled=progress, unit="step", desc="training the sorting model")
    threads = ThreadChoice()
    try:
        for step in range(steps):
            with threads.step(step):
                tokens, target = sorting_batch(batch, n, vocab, generator)
                logits, _ = model(tokens)
                loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
            if bar:
                bar.update(1)
                if step % 50 == 0:
                    bar.set_postfix_str(f"loss {loss.item():.4f}")
    finally:
        threads.close()
        if bar:
            bar.close()
    train_seconds = time.perf_counter() - start

    tokens, target = sorting_batch(test_size, n, vocab, generator)
    return EffectivenessResult(truncation_accuracy(model, tokens, target), model, train_seconds, loss.item())


def truncation_accuracy(model: SortingModel, tokens: Tensor, target: Tensor):
    """Accuracy of ``model`` on ``tokens [B, n]`` when only paths of length ≤ k are kept, k = 0..L.

    ``logits_k = unembed(Σ_{len(p) ≤ k} P_p X W_p)`` with the patterns of the full forward pass
    and ``X`` the embeddings, computed in float64 by :func:`pathkernels.length_sums`.

    Returns:
        DataFrame with ``max_length``, ``token_accuracy``, ``sequence_accuracy`` and ``path_count``.
    """
    pd = require("pandas")
    network = model.network
    num_layers, num_heads = len(network.attention), network.attention[0].num_heads
    model64 = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits, result = model64(tokens)
        sums = model64.network.attention_stack(result).length_sums(model64.embedding(tokens))
        # k = L keeps every path: the decomposition must give the model's own logits back.
        torch.testing.assert_close(model64.unembed(truncated_output(sums, num_layers)), logits)
        counts = count_by_length(num_layers, num_heads, skip=True)
        rows = []
        for k in range(num_layers + 1):
            correct = model64.unembed(truncated_output(sums, k)).argmax(-1) == target
            rows.append(
                {
                    "max_length": k,
                    "token_accuracy": correct.double().mean().item(),
                    "sequence_accuracy": correct.all(-1).double().mean().item(),
                    "path_count": sum(counts[: k + 1]),
                }
            )
    return pd.DataFrame(rows)


def plot_effectiveness(table, ax=None):
    """Accuracy against the longest path kept (token and whole-sequence accuracy)."""
    plt = _pyplot()
    fig, ax = _axes(plt, ax)
    ax.plot(table["max_length"], table["token_accuracy"], "o-", label="token accuracy")
    ax.plot(table["max_length"], table["sequence_accuracy"], "s--", label="sequence accuracy")
    ax.set_xticks(list(table["max_length"]))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("longest path kept (k): output = Σ over paths of length ≤ k")
    ax.set_ylabel("accuracy on held-out sequences")
    ax.set_title("Path effectiveness: sorting with an attention-only model")
    ax.legend()
    return fig


# --- a trained model: which paths write a prediction ---------------------------------------------


@dataclass
class InductionExample:
    """:func:`induction_example`'s result: the attribution, the token read and the one predicted."""

    attribution: object  # pk.PathAttribution
    position: int
    target: int
    by_length: object  # DataFrame: length, paths, attribution, share


def induction_example(top_k: int = 10, position: int = 20) -> InductionExample:
    """The trained attention-only fixture ``attn_only_2l`` (:mod:`pathkernels.fixtures`) on its
    example ``[BOS, A, A]`` (16 random tokens, then the same 16), read at ``position`` in the second
    copy: every path's exact attribution (:func:`pathkernels.path_attribution`) to the logit of the
    token that followed the same token in the first copy, the one induction predicts.

    ``by_length``: the attributions summed by number of heads, and each sum's share of what the
    paths carry (``value − constant``)."""
    pd = require("pandas")
    from pathkernels.adapters import capture_huggingface_residual
    from pathkernels.analysis import logit, path_attribution
    from pathkernels.fixtures import fixture_info, load_fixture

    model, inputs = load_fixture("attn_only_2l")
    ids = inputs["input_ids"]
    length = fixture_info("attn_only_2l")["task"]["length"]
    if not length < position < 2 * length:
        raise ValueError(f"induction_example: expected position in ({length}, {2 * length}), got {position}")
    target = int(ids[0, position - length + 1])
    stack, _ = capture_huggingface_residual(model, **inputs)
    result = path_attribution(stack, logit(model, target), positions=position, top_k=top_k)
    sums = result.by_length[:, 0, 0]
    carried = float(result.value[0, 0] - result.constant[0, 0])
    table = pd.DataFrame(
        {
            "length": range(len(sums)),
            "paths": result.counts.sum(0).tolist(),
            "attribution": sums.tolist(),
            "share": (sums / carried).tolist(),
        }
    )
    return InductionExample(result, position, target, table)


def trained_collapse(name: str = "gpt2_4l", seed: int = 0):
    """The residual ratio ``‖res(T)‖_{1,∞} / ‖T‖_{1,∞}`` of every path term T of a trained fixture
    (:mod:`pathkernels.fixtures`) on its example, by number of heads, against the same architecture
    at initialisation (``torch.manual_seed(seed)``), exactly (:func:`pathkernels.decompose`).

    Returns:
        DataFrame with ``weights`` ("trained" or "initialisation"), ``length``, ``paths``,
        ``median``, ``q10`` and ``q90``.
    """
    pd = require("pandas")
    import transformers

    from pathkernels.adapters import capture_huggingface_residual
    from pathkernels.fixtures import fixture_info, fixture_path, load_fixture

    trained, inputs = load_fixture(name)
    config = getattr(transformers, fixture_info(name)["model"]["config_class"]).from_pretrained(fixture_path(name))
    torch.manual_seed(seed)
    initial = getattr(transformers, fixture_info(name)["model"]["class"])(config).double().eval()
    frames = []
    for weights, model in (("trained", trained), ("initialisation", initial)):
        stack, _ = capture_huggingface_residual(model, **inputs)
        dec = decompose(stack)
        # The bias paths' ratio is round-off (their rows are equal at every token): left out.
        band = dec.quantiles_by_length(dec.bias_paths)
        counts = dec.by_length()[["length", "path_count"]].rename(columns={"path_count": "paths"})
        table = counts.merge(band[["length", "median", "q10", "q90"]], on="length")
        frames.append(table.assign(weights=weights)[["weights", "length", "paths", "median", "q10", "q90"]])
    return pd.concat(frames, ignore_index=True)


def plot_trained_collapse(table, ax=None, *, name: str = "gpt2_4l"):
    """Residual ratio of the path terms against their number of heads, trained against at
    initialisation (median, 10–90 % band; the bias paths, whose ratio is round-off, left out).
    Returns the Figure."""
    plt = _pyplot()
    fig, ax = _axes(plt, ax)
    for i, (weights, rows) in enumerate(table.groupby("weights", sort=False)):
        ax.plot(rows["length"], rows["median"], "o-", ms=3, color=f"C{i}", label=weights)
        ax.fill_between(rows["length"], rows["q10"], rows["q90"], color=f"C{i}", alpha=0.2)
    ax.xaxis.set_major_locator(_integer_ticks())
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("heads on the path")
    ax.set_ylabel("residual ratio of the path term (ℓ1,∞)")
    title = f"Path terms of {name}: trained against initialisation (median, 10–90 %; bias paths left out)"
    ax.set_title(fitted_title(title), fontsize="medium")
    ax.legend()
    return fig


# --- helpers --------------------------------------------------------------------------------------


def _pyplot():
    require("matplotlib")
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg") and not _has_display():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_display() -> bool:
    import os

    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _axes(plt, ax, figsize=(6.4, 4.2)):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax
