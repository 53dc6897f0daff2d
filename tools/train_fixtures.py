"""Train the fixtures of :mod:`pathkernels.fixtures` (docs/FIXTURES.md), and their transcoders.

Three small transformers learn the induction task of :func:`pathkernels.fixtures.induction_batch`
(a start token, random tokens, then a random segment of 8 to 16 tokens twice) on the CPU, seeded and on
deterministic data, and a fourth (``permuted_2l``) the permuted task of
:func:`pathkernels.fixtures.induction_targets` (at the second copy, ``π(A)`` for the token ``A`` that
induction copies), which needs its MLPs. Each is written beside the loader as a Hugging Face
checkpoint (``save_pretrained``: ``config.json`` and ``model.safetensors``), its
``training_curve.csv`` (loss and accuracy at every step) and ``fixture.json`` (the task, the
settings, the final accuracies; for ``permuted_2l`` also with its MLPs ablated, and those of an
attention-only control trained alike)::

    .venv/bin/python tools/train_fixtures.py --jobs 2        # all four, two at a time
    .venv/bin/python tools/train_fixtures.py attn_only_2l    # one of them
    .venv/bin/python tools/train_fixtures.py --out /tmp/fx   # somewhere else

``--transcoders`` trains, on a fixture's trained checkpoint, one JumpReLU transcoder per MLP (from
the MLP's argument to its output) and writes them into the fixture's ``transcoders/`` folder in
circuit-tracer's layout, with their ``training_curve.csv`` and ``transcoders.json`` (the settings and
the reconstruction on held-out data; read them with
:func:`pathkernels.fixtures.fixture_transcoders`)::

    .venv/bin/python tools/train_fixtures.py --transcoders             # gpt2_4l, llama_2l, permuted_2l
    .venv/bin/python tools/train_fixtures.py --transcoders llama_2l    # one of them

The same seeds and thread count on the same machine give the same bits (the weights are float32;
another CPU or thread count may differ in the last bits of the curve, which the tests allow).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pathkernels.fixtures import (  # noqa: E402
    BOS,
    fixture_path,
    induction_batch,
    induction_targets,
    repeated_positions,
    token_permutation,
)

EXAMPLE_SEED = 0  # load_fixture's example inputs
EVAL_SEED = 1  # the held-out batch of the final accuracies
DATA_SEED = 1000  # training step s reads induction_batch(..., seed=DATA_SEED + s)


@dataclass(frozen=True)
class FixtureSpec:
    """One fixture: its architecture (a Hugging Face config class and its arguments), the task's
    sizes and the training settings."""

    name: str
    config_class: str
    model_class: str
    config: dict
    description: str
    vocab: int = 64
    length: int = 16
    min_length: int = 8
    seed: int = 0
    steps: int = 1500
    batch: int = 64
    learning_rate: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    frozen_zero_mlps: bool = False
    betas: tuple[float, float] = field(default=(0.9, 0.98))
    # The permuted-induction task (pathkernels.fixtures.induction_targets): at the repeated positions
    # the target is π(next token), π = token_permutation(vocab, permutation_seed); None: induction.
    permutation_seed: int | None = None
    # A curriculum for the permuted task: the first plain_steps steps train plain induction (target A),
    # the rest the permuted task (π(A)). The relabelling can be learnt only once induction copies A,
    # and induction is learnt only where copying A pays: from the start on π(A), the model stayed near
    # chance (2 % after 2,000 steps).
    plain_steps: int = 0
    # Fixed token codes: each token's code C[A] is its random initial embedding's first code_width
    # entries scaled to std code_std; the embedding writes it into the first code_width dimensions of
    # the stream (zero elsewhere), the unembedding reads code_scale · C[B] from the next code_width
    # dimensions; both frozen, so that no trained weight can relabel a token: a head moves a code
    # linearly, and no linear map of 32-dimensional codes sends each of 511 tokens to the code of its
    # image under a random permutation (the best found reaches 21 %: linear_map_accuracy; the
    # attention-only control 26 %). None: both trained.
    code_width: int | None = None
    code_std: float = 0.05
    code_scale: float = 1.0
    # Also train the same model with its MLPs zero and frozen (the attention-only control), and record
    # its held-out accuracy in fixture.json.
    control: bool = False

    def permutation(self) -> torch.Tensor | None:
        return None if self.permutation_seed is None else token_permutation(self.vocab, self.permutation_seed)


_GPT2_COMMON = dict(
    vocab_size=64,
    n_positions=48,
    n_embd=64,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=BOS,
    eos_token_id=BOS,
    # Untied: tied embeddings make the direct path W_E W_Eᵀ predict the current token, which this
    # task never wants; the attention-only model then stayed at chance for 3,000 steps.
    tie_word_embeddings=False,
    # Weights drawn with std 0.05 instead of GPT-2's 0.02: the position embeddings then stand out
    # from the start, and the previous-token head, then the induction head, form within 750 steps
    # (at 0.02 the attention-only model was at 64 % after 2,000).
    initializer_range=0.05,
)

SPECS = {
    spec.name: spec
    for spec in (
        FixtureSpec(
            name="attn_only_2l",
            config_class="GPT2Config",
            model_class="GPT2LMHeadModel",
            config=dict(_GPT2_COMMON, n_layer=2),
            description="2-layer, 4-head GPT-2, MLPs zero and frozen: a previous-token head and an induction head",
            frozen_zero_mlps=True,
        ),
        FixtureSpec(
            name="gpt2_4l",
            config_class="GPT2Config",
            model_class="GPT2LMHeadModel",
            config=dict(_GPT2_COMMON, n_layer=4),
            description="4-layer, 4-head GPT-2 with LayerNorms and MLPs",
        ),
        FixtureSpec(
            name="llama_2l",
            config_class="LlamaConfig",
            model_class="LlamaForCausalLM",
            config=dict(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=48,
                bos_token_id=BOS,
                eos_token_id=BOS,
                tie_word_embeddings=False,
            ),
            description="2-layer Llama: RMSNorm, grouped-query attention (4 query, 2 key-value heads), rotary, SwiGLU",
            steps=600,  # rotary positions make the previous-token head easy: 99.8 % at step 500
        ),
        FixtureSpec(
            name="permuted_2l",
            config_class="GPT2Config",
            model_class="GPT2LMHeadModel",
            config=dict(
                _GPT2_COMMON,
                vocab_size=512,
                n_embd=64,
                n_inner=512,
                n_layer=2,
            ),
            description=(
                "2-layer, 4-head GPT-2 (d = 64, MLPs of 512) whose 512 tokens have fixed random 32-dimensional codes, "
                "read in and out: trained to answer π(A) where induction copies A, which its MLPs relabel"
            ),
            vocab=512,
            permutation_seed=0,
            code_width=32,
            # Codes with std 0.3 stand out from the positions (std 0.05): at the model's own 0.05, plain
            # induction stayed on a positional shortcut (33 % after 1,000 steps, against 93 % at 0.3).
            code_std=0.3,
            code_scale=2 / 3,  # the unembedding's entries have std 0.2
            plain_steps=1000,
            steps=3000,
            control=True,
        ),
    )
}


def build_model(spec: FixtureSpec) -> torch.nn.Module:
    """The untrained model of ``spec``, initialised from ``torch.manual_seed(spec.seed)``; for
    ``frozen_zero_mlps``, every MLP weight and bias is zero and excluded from training."""
    torch.manual_seed(spec.seed)
    config = getattr(transformers, spec.config_class)(**spec.config)
    model = getattr(transformers, spec.model_class)(config)
    if spec.code_width is not None:
        embedding, unembedding = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        assert unembedding is not embedding and 2 * spec.code_width <= embedding.shape[1]
        width = spec.code_width
        with torch.no_grad():
            codes = embedding[:, :width] * (spec.code_std / spec.config["initializer_range"])
            embedding.zero_()
            embedding[:, :width] = codes
            unembedding.zero_()
            unembedding[:, width : 2 * width] = spec.code_scale * codes
        embedding.requires_grad_(False)
        unembedding.requires_grad_(False)
    if spec.frozen_zero_mlps:
        zero_and_freeze_mlps(model)
    return model


def attention_only_control(spec: FixtureSpec) -> FixtureSpec:
    """``spec`` with its MLPs zero and frozen: the control that shows the task needs them."""
    return replace(spec, name=f"{spec.name} (attention-only control)", frozen_zero_mlps=True, control=False)


def zero_and_freeze_mlps(model: torch.nn.Module) -> None:
    """Zero a GPT-2's MLP weights and biases and freeze them: ``c_proj(gelu(c_fc(x)))`` is then
    exactly 0 (``c_fc`` gives 0, gelu(0) = 0, ``c_proj`` maps it to its zero bias)."""
    for block in model.transformer.h:
        for parameter in block.mlp.parameters():
            with torch.no_grad():
                parameter.zero_()
            parameter.requires_grad_(False)


def task_metrics(logits: torch.Tensor, ids: torch.Tensor, permutation: torch.Tensor | None = None) -> dict[str, float]:
    """Next-token metrics of ``logits [B, n, V]`` on ``ids [B, n]``: ``loss`` (every position),
    ``loss_repeated`` and ``accuracy_repeated`` (the positions of :func:`repeated_positions`, whose
    next token induction predicts), ``accuracy_first`` (the other positions but the start token's,
    whose next token is a fresh random one: chance is about 1/50). With ``permutation``, the targets
    are :func:`induction_targets`' (π of the next token at the repeated positions)."""
    predicted, targets = logits[:, :-1].float(), induction_targets(ids, permutation)
    losses = F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), targets.reshape(-1), reduction="none")
    losses = losses.view(targets.shape)
    correct = (predicted.argmax(-1) == targets).float()
    repeated = repeated_positions(ids)[:, :-1]
    first = ~repeated
    first[:, 0] = False
    return {
        "loss": float(losses.mean()),
        "loss_repeated": float(losses[repeated].mean()),
        "accuracy_repeated": float(correct[repeated].mean()),
        "accuracy_first": float(correct[first].mean()),
    }


def learning_rate(spec: FixtureSpec, step: int) -> float:
    """Linear warm-up over ``spec.warmup`` steps, then a cosine decay to a tenth at the last step."""
    if step < spec.warmup:
        return spec.learning_rate * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(spec: FixtureSpec, steps: int | None = None, log=None) -> tuple[torch.nn.Module, list[dict]]:
    """Train ``spec``'s model for ``steps`` (default ``spec.steps``; the schedule is always that of
    ``spec.steps``) with AdamW on the batches ``induction_batch(..., seed=DATA_SEED + step)``.
    Returns the model (eval mode) and one row of :func:`task_metrics` per step, measured on that
    step's batch before its update."""
    torch.use_deterministic_algorithms(True)
    model = build_model(spec).train()
    permutation = spec.permutation()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(
        trainable, lr=spec.learning_rate, betas=spec.betas, weight_decay=spec.weight_decay, foreach=False
    )
    rows = []
    for step in range(spec.steps if steps is None else steps):
        for group in optimiser.param_groups:
            group["lr"] = learning_rate(spec, step)
        ids = induction_batch(spec.vocab, spec.length, spec.batch, DATA_SEED + step, spec.min_length)
        logits = model(input_ids=ids).logits
        task = None if step < spec.plain_steps else permutation
        targets = induction_targets(ids, task)  # ids[:, 1:] for induction
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            rows.append({"step": step, **task_metrics(logits.detach(), ids, task)})
        if log is not None and (step % 250 == 0 or step == spec.steps - 1):
            log(
                f"{spec.name} step {step}: loss {rows[-1]['loss']:.4f}, repeated half {rows[-1]['loss_repeated']:.4f} "
                f"(accuracy {rows[-1]['accuracy_repeated']:.3f}), first half accuracy {rows[-1]['accuracy_first']:.3f}"
            )
    if spec.frozen_zero_mlps:
        assert all(float(p.abs().max()) == 0 for block in model.transformer.h for p in block.mlp.parameters())
    if spec.code_width is not None:
        initial = build_model(spec)
        assert torch.equal(model.get_input_embeddings().weight, initial.get_input_embeddings().weight)
        assert torch.equal(model.get_output_embeddings().weight, initial.get_output_embeddings().weight)
    return model.eval(), rows


def evaluate(model: torch.nn.Module, spec: FixtureSpec, batch: int = 512) -> dict[str, float]:
    """:func:`task_metrics` on held-out batches (``seed=EVAL_SEED``, no training step's): the
    training task's (segments of ``min_length … length`` tokens) and, suffixed ``_full``, whole
    repeats (``[BOS, A, A]``, the example inputs' form)."""
    permutation = spec.permutation()
    with torch.no_grad():
        ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED, spec.min_length)
        metrics = task_metrics(model(input_ids=ids).logits, ids, permutation)
        ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED)
        full = task_metrics(model(input_ids=ids).logits, ids, permutation)
    return metrics | {f"{key}_full": value for key, value in full.items()}


def mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLP module of each block (GPT-2's ``transformer.h[l].mlp``, Llama's ``model.layers[l].mlp``):
    called on the MLP's argument (the norm's output), it returns what the block adds to the stream."""
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return [block.mlp for block in blocks]


class _MLPsReplaced:
    """Within the block, each MLP's output is ``replacement(layer, argument, output)`` where that is
    not None (a forward hook; ``argument``: the MLP's input, ``output``: its own output)."""

    def __init__(self, model: torch.nn.Module, replacement):
        self.modules, self.replacement, self.handles = mlp_modules(model), replacement, []

    def __enter__(self):
        for layer, module in enumerate(self.modules):
            hook = lambda module, args, output, layer=layer: self.replacement(layer, args[0], output)  # noqa: E731
            self.handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def mlp_ablations(model: torch.nn.Module, spec: FixtureSpec, batch: int = 512) -> dict[str, float]:
    """What the model does on the held-out batch of :func:`evaluate` with its MLPs ablated: every
    MLP's output zero (``zero``), or its mean over the batch's tokens, one vector per layer
    (``mean``), or only layer l's zeroed (``zero_layer{l}``); for each, the accuracy at the repeated
    positions on the fixture's targets (``accuracy_repeated_<ablation>``) and how often the prediction
    there is the copied token itself, unpermuted (``copies_<ablation>``; and ``copies``, the model's
    own). Chance is 1/(vocab − 1)."""
    permutation = spec.permutation()
    ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED, spec.min_length)
    repeated = repeated_positions(ids)[:, :-1]
    targets, copied = induction_targets(ids, permutation), ids[:, 1:]

    def scores(name: str, replacement) -> dict[str, float]:
        with torch.no_grad(), _MLPsReplaced(model, replacement):
            predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
        suffix = f"_{name}" if name else ""
        return {
            f"accuracy_repeated{suffix}": float((predicted == targets)[repeated].float().mean()),
            f"copies{suffix}": float((predicted == copied)[repeated].float().mean()),
        }

    outputs = {}
    with torch.no_grad(), _MLPsReplaced(model, lambda layer, x, output: outputs.__setitem__(layer, output)):
        model(input_ids=ids)
    means = {layer: output.mean((0, 1)) for layer, output in outputs.items()}
    found = scores("", lambda layer, x, output: None)
    found |= scores("zero", lambda layer, x, output: torch.zeros_like(output))
    found |= scores("mean", lambda layer, x, output: means[layer].expand_as(output))
    for ablated in outputs:
        found |= scores(
            f"zero_layer{ablated}",
            lambda layer, x, output, ablated=ablated: torch.zeros_like(output) if layer == ablated else None,
        )
    return {"chance": 1 / (spec.vocab - 1), **found}


def linear_map_accuracy(model: torch.nn.Module, spec: FixtureSpec, steps: int = 3000) -> float:
    """For a fixture with fixed codes and a permutation: the accuracy at answering π(A) of the best
    linear map found from A's input code to the readout, through the final LayerNorm (its gain and
    bias fitted too): ``argmax_B u_B · (LN(c_A M + b) γ + β) = π(A)``, fitted by Adam with the
    cross-entropy over all tokens at once, from ``torch.manual_seed(spec.seed)``. What one head adds
    to a position from the copied token is linear in its code; this is how far one such map gets (a
    fit, not a bound: attention mixes several heads with weights that depend on the tokens, and the
    attention-only control does a little better)."""
    width = spec.code_width
    codes = model.get_input_embeddings().weight[1:, :width].detach().double()  # tokens 1 … vocab − 1
    readout = model.get_output_embeddings().weight[:, width : 2 * width].detach().double()
    targets = spec.permutation()[1:]
    torch.manual_seed(spec.seed)
    weight = (torch.randn(width, width, dtype=torch.float64) / width**0.5).requires_grad_()
    bias, gain, shift = (torch.zeros(width, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        gain += 1
    optimiser = torch.optim.Adam([weight, bias, gain, shift], lr=3e-3, foreach=False)
    for _ in range(steps):
        hidden = F.layer_norm(codes @ weight + bias, (width,)) * gain + shift
        loss = F.cross_entropy(hidden @ readout.T, targets)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        hidden = F.layer_norm(codes @ weight + bias, (width,)) * gain + shift
        return float(((hidden @ readout.T).argmax(-1) == targets).double().mean())


def save(
    model: torch.nn.Module,
    spec: FixtureSpec,
    rows: list[dict],
    seconds: float,
    folder: Path,
    control: dict | None = None,
) -> dict:
    """Write the checkpoint, ``training_curve.csv`` and ``fixture.json`` into ``folder``; returns the
    fixture's record (``fixture.json``). For the permuted task, the record holds the MLP ablations
    (:func:`mlp_ablations`), the linear map's accuracy (:func:`linear_map_accuracy`) and ``control``, the
    attention-only control's training time and held-out figures."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    with open(folder / "training_curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (value if key == "step" else f"{value:.6g}") for key, value in row.items()})
    record = {
        "name": spec.name,
        "description": spec.description,
        "task": {
            "generator": "pathkernels.fixtures.induction_batch",
            "vocab": spec.vocab,
            "length": spec.length,
            "min_length": spec.min_length,
            "sequence_length": 2 * spec.length + 1,
            "bos": BOS,
            "example_seed": EXAMPLE_SEED,
        },
        "model": {
            "class": spec.model_class,
            "config_class": spec.config_class,
            "parameters": sum(p.numel() for p in model.parameters()),
            "frozen_zero_mlps": spec.frozen_zero_mlps,
        },
        "training": {
            "seed": spec.seed,
            "data_seeds": f"{DATA_SEED} + step",
            "steps": spec.steps,
            "batch": spec.batch,
            "optimiser": "AdamW",
            "learning_rate": spec.learning_rate,
            "schedule": f"linear warm-up over {spec.warmup} steps, then cosine to a tenth",
            "betas": list(spec.betas),
            "weight_decay": spec.weight_decay,
            "threads": torch.get_num_threads(),
            "seconds": round(seconds, 1),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "final": {"eval_seed": EVAL_SEED, **evaluate(model, spec)},
    }
    if spec.permutation_seed is not None:
        record["task"] |= {
            "targets": "pathkernels.fixtures.induction_targets with token_permutation(vocab, permutation_seed)",
            "permutation_seed": spec.permutation_seed,
        }
        record["model"]["fixed_codes"] = {
            "width": spec.code_width,
            "std": spec.code_std,
            "unembedding_scale": spec.code_scale,
            "embedding": f"code C[A] in dimensions 0-{spec.code_width - 1}, zero elsewhere, frozen",
            "unembedding": f"{spec.code_scale:.4g} C[B] in dimensions {spec.code_width}-{2 * spec.code_width - 1}, "
            "zero elsewhere, frozen",
        }
        record["training"]["curriculum"] = (
            f"steps 0-{spec.plain_steps - 1} on plain induction (target A), then the permuted task (π(A)); "
            "the curve's accuracies are on each step's own targets"
        )
        record["final"]["mlp_ablations"] = mlp_ablations(model, spec)
        record["final"]["linear_map_accuracy"] = linear_map_accuracy(model, spec)
    if control is not None:
        record["attention_only_control"] = control
    (folder / "fixture.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record


def train_and_save(name: str, out: Path | None, threads: int) -> str:
    """Train fixture ``name`` on ``threads`` torch threads and write its folder; returns a summary line."""
    torch.set_num_threads(threads)
    spec = SPECS[name]
    begin = time.perf_counter()
    model, rows = train(spec, log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - begin
    control = None
    if spec.control:  # the same model with its MLPs zero and frozen, trained alike
        begin = time.perf_counter()
        attention_only, control_rows = train(attention_only_control(spec), log=lambda line: print(line, flush=True))
        control = {
            "description": "the same model, data and schedule with every MLP zero and frozen",
            "seconds": round(time.perf_counter() - begin, 1),
            "final_step": {key: value for key, value in control_rows[-1].items() if key != "step"},
            "final": {"eval_seed": EVAL_SEED, **evaluate(attention_only, spec)},
        }
    folder = fixture_path(name) if out is None else out / name
    final = save(model, spec, rows, seconds, folder, control)["final"]
    return (
        f"{name}: {seconds:.1f} s, held-out loss {final['loss']:.4f}, repeated half accuracy "
        f"{final['accuracy_repeated']:.4f}, first half {final['accuracy_first']:.4f} -> {folder}"
        + (f"; attention-only control {control['final']['accuracy_repeated']:.4f}" if control else "")
    )


# -- transcoders -------------------------------------------------------------------------------------------------

TRANSCODER_DATA_SEED = 100_000  # transcoder step s reads induction_batch(..., seed=TRANSCODER_DATA_SEED + s)
TRANSCODER_HOOKS = ("mlp.hook_in", "hook_mlp_out")  # circuit-tracer's names: the MLP's argument, its output


@dataclass(frozen=True)
class TranscoderSpec:
    """The transcoders of one fixture: one per MLP, ``features`` wide, JumpReLU (a feature is active
    where its pre-activation exceeds its threshold θ_f > 0, and then passes it unchanged), trained
    together (each on its own layer) with Adam on the normalised MSE of the MLP's output plus ``l0``
    times the features active per token, the thresholds learnt through straight-through estimators
    of ``bandwidth`` (Rajamanoharan et al. 2024, "Jumping ahead: improving reconstruction fidelity
    with JumpReLU sparse autoencoders"). Data: the MLP inputs and outputs of ``batch`` sequences of
    the fixture's task per step, seeds ``TRANSCODER_DATA_SEED + step`` (no fixture's training step,
    example or held-out batch)."""

    features: int
    l0: float
    steps: int = 3000
    batch: int = 32
    learning_rate: float = 1e-3
    warmup: int = 100
    l0_warmup: int = 500  # the penalty's weight grows linearly to l0 over these steps
    threshold: float = 0.5  # every feature's initial threshold
    threshold_learning_rate: float = 1e-2  # the log-thresholds' (Adam's steps are about this size)
    bandwidth: float = 0.1
    seed: int = 0


TRANSCODERS = {
    "gpt2_4l": TranscoderSpec(features=512, l0=1e-3),
    "llama_2l": TranscoderSpec(features=512, l0=3e-4),
    # Wider and less sparse: its MLPs relabel each of 511 tokens, and the answer is kept only if the
    # relabelled code is precise (at l0 = 1e-3 and 1,500 steps the replaced model kept 63 %).
    "permuted_2l": TranscoderSpec(features=1024, l0=3e-4),
}
TRANSCODER_CURVE_STEPS = "0-9, then every 10th and the last"  # the rows of its training_curve.csv


def curve_step(step: int, steps: int) -> bool:
    """Whether the transcoders' ``training_curve.csv`` keeps step ``step`` of ``steps``."""
    return step < 10 or step % 10 == 0 or step == steps - 1


class _JumpReLU(torch.autograd.Function):
    """``pre · (pre > θ)``; the gradient passes to ``pre`` where the gate is open, and to θ through
    a rectangle of width ``bandwidth`` about it (the straight-through estimate of the jump)."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        gate = (pre > threshold).to(pre.dtype)
        window = ((pre - threshold).abs() < ctx.bandwidth / 2).to(pre.dtype) / ctx.bandwidth
        grad_threshold = -(threshold * window * grad).reshape(-1, pre.shape[-1]).sum(0)
        return grad * gate, grad_threshold, None


class _Step(torch.autograd.Function):
    """``(pre > θ)``, the gate, with the straight-through estimate of its gradient to θ only."""

    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        window = ((pre - threshold).abs() < ctx.bandwidth / 2).to(pre.dtype) / ctx.bandwidth
        return None, -(window * grad).reshape(-1, pre.shape[-1]).sum(0), None


def mlp_activations(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the MLP's argument and its output at every token of ``ids``: ``([B n, d], [B n, d])``."""
    seen = {}

    def record(layer, x, output):
        seen[layer] = (x.detach().reshape(-1, x.shape[-1]), output.detach().reshape(-1, output.shape[-1]))

    with torch.no_grad(), _MLPsReplaced(model, record):
        model(input_ids=ids)
    return [seen[layer] for layer in range(len(seen))]


class Transcoders(torch.nn.Module):
    """One JumpReLU transcoder per layer: ``a = pre · (pre > θ)``, ``pre = x W_enc + b_enc``, and
    ``a W_dec + b_dec``, float32; ``θ = exp(log_threshold)``."""

    def __init__(self, layers: int, d_in: int, d_out: int, features: int, threshold: float, bandwidth: float):
        super().__init__()
        # The encoder N(0, 1/d_in), its bias zero; decoder rows in random directions of norm 0.1; the
        # decoder bias is set to the output's mean before training.
        self.w_enc = torch.nn.Parameter(torch.randn(layers, d_in, features) / d_in**0.5)
        w_dec = torch.randn(layers, features, d_out)
        self.w_dec = torch.nn.Parameter(0.1 * w_dec / w_dec.norm(dim=-1, keepdim=True))
        self.b_enc = torch.nn.Parameter(torch.zeros(layers, features))
        self.b_dec = torch.nn.Parameter(torch.zeros(layers, d_out))
        self.log_threshold = torch.nn.Parameter(torch.full((layers, features), math.log(threshold)))
        self.bandwidth = bandwidth

    def threshold(self, layer: int) -> torch.Tensor:
        return self.log_threshold[layer].exp()

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_enc[layer] + self.b_enc[layer]

    def forward(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reconstruction ``[N, d_out]`` and the features' activations ``[N, F]``."""
        acts = _JumpReLU.apply(self.pre_activations(layer, x), self.threshold(layer), self.bandwidth)
        return acts @ self.w_dec[layer] + self.b_dec[layer], acts

    def active(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[N]``: the features active at each row of ``x``, with the gradient of the L0 penalty."""
        return _Step.apply(self.pre_activations(layer, x), self.threshold(layer), self.bandwidth).sum(-1)


def transcoder_batch(spec: FixtureSpec, batch: int, seed: int) -> torch.Tensor:
    return induction_batch(spec.vocab, spec.length, batch, seed, spec.min_length)


def train_transcoders(
    model: torch.nn.Module, spec: FixtureSpec, tspec: TranscoderSpec, steps: int | None = None, log=None
) -> tuple[Transcoders, list[dict], list[float]]:
    """Train ``tspec``'s transcoders on ``model`` (float32, eval mode) for ``steps`` (default
    ``tspec.steps``; the schedule is always that of ``tspec.steps``). Returns them, one row per step
    (per layer the normalised MSE and the active features per token of that step's batch, before
    its update) and the scale of each layer's output (its RMS norm about the mean on the first
    batch), which normalises the loss."""
    torch.use_deterministic_algorithms(True)
    first = mlp_activations(model, transcoder_batch(spec, tspec.batch, TRANSCODER_DATA_SEED))
    layers, d_in, d_out = len(first), first[0][0].shape[1], first[0][1].shape[1]
    torch.manual_seed(tspec.seed)
    transcoders = Transcoders(layers, d_in, d_out, tspec.features, tspec.threshold, tspec.bandwidth)
    scales = [float((y - y.mean(0)).pow(2).sum(-1).mean().sqrt()) for _, y in first]
    with torch.no_grad():
        for layer, (_, y) in enumerate(first):
            transcoders.b_dec[layer] = y.mean(0)
    weights = [p for name, p in transcoders.named_parameters() if name != "log_threshold"]
    groups = [{"params": weights, "scale": 1.0}]
    groups.append({"params": [transcoders.log_threshold], "scale": tspec.threshold_learning_rate / tspec.learning_rate})
    optimiser = torch.optim.Adam(groups, lr=tspec.learning_rate, foreach=False)
    schedule = replace(spec, steps=tspec.steps, warmup=tspec.warmup, learning_rate=tspec.learning_rate)
    rows = []
    for step in range(tspec.steps if steps is None else steps):
        for group in optimiser.param_groups:
            group["lr"] = group["scale"] * learning_rate(schedule, step)
        l0 = tspec.l0 * min(1.0, (step + 1) / tspec.l0_warmup)
        data = mlp_activations(model, transcoder_batch(spec, tspec.batch, TRANSCODER_DATA_SEED + step))
        loss, row = 0.0, {"step": step}
        for layer, (x, y) in enumerate(data):
            reconstruction, _ = transcoders(layer, x)
            mse = (reconstruction - y).pow(2).sum(-1).mean() / scales[layer] ** 2
            active = transcoders.active(layer, x).mean()
            loss = loss + mse + l0 * active
            row[f"nmse_L{layer}"] = float(mse.detach())
            row[f"l0_L{layer}"] = float(active.detach())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        rows.append(row)
        if log is not None and (step % 250 == 0 or step == tspec.steps - 1):
            figures = (f"L{i} nmse {row[f'nmse_L{i}']:.4f} l0 {row[f'l0_L{i}']:.1f}" for i in range(layers))
            log(f"{spec.name} transcoders step {step}: " + ", ".join(figures))
    return transcoders, rows, scales


def evaluate_transcoders(model: torch.nn.Module, spec: FixtureSpec, transcoders, batch: int = 512) -> dict:
    """The transcoders on :func:`evaluate`'s held-out batch (``seed=EVAL_SEED``, the training task's
    form). ``transcoders(layer, x)`` returns the reconstruction (and anything else).

    Per layer, on the model's own MLP inputs: ``nmse`` (Σ‖y − ŷ‖² / Σ‖y‖² over the tokens),
    ``explained_variance`` (1 − Σ‖y − ŷ‖² / Σ‖y − ȳ‖², ȳ the mean output), ``l0`` (the features
    active per token), ``dead`` (the fraction of features active at no token). Then the model with
    every MLP replaced by its transcoder, no error term: its accuracy and loss at the repeated
    positions, on the fixture's targets, against the model's own (``accuracy_kept``: their ratio),
    and how often its top token is the model's, at every position but the last (``top1_agreement``;
    most of them predict a fresh random token, where the model's own top token is a near tie) and at
    the repeated positions (``top1_agreement_repeated``)."""
    permutation = spec.permutation()
    ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED, spec.min_length)
    per_layer = []
    with torch.no_grad():
        for layer, (x, y) in enumerate(mlp_activations(model, ids)):
            reconstruction, acts = transcoders(layer, x)
            error = (reconstruction - y).pow(2).sum()
            per_layer.append(
                {
                    "layer": layer,
                    "nmse": float(error / y.pow(2).sum()),
                    "explained_variance": float(1 - error / (y - y.mean(0)).pow(2).sum()),
                    "l0": float((acts > 0).float().sum(-1).mean()),
                    "dead": float(((acts > 0).sum(0) == 0).float().mean()),
                }
            )
        own = model(input_ids=ids).logits
        with _MLPsReplaced(model, lambda layer, x, output: transcoders(layer, x)[0]):
            replaced = model(input_ids=ids).logits
    mine, theirs = task_metrics(own, ids, permutation), task_metrics(replaced, ids, permutation)
    agree = own[:, :-1].argmax(-1) == replaced[:, :-1].argmax(-1)
    repeated = repeated_positions(ids)[:, :-1]
    return {
        "eval_seed": EVAL_SEED,
        "tokens": int(ids.numel()),
        "layers": per_layer,
        "replaced": {
            "accuracy_repeated": theirs["accuracy_repeated"],
            "accuracy_repeated_model": mine["accuracy_repeated"],
            "accuracy_kept": theirs["accuracy_repeated"] / mine["accuracy_repeated"],
            "loss_repeated": theirs["loss_repeated"],
            "loss_repeated_model": mine["loss_repeated"],
            "top1_agreement": float(agree.float().mean()),
            "top1_agreement_repeated": float(agree[repeated].float().mean()),
        },
    }


def save_transcoders(
    transcoders: Transcoders,
    spec: FixtureSpec,
    tspec: TranscoderSpec,
    model: torch.nn.Module,
    rows: list[dict],
    seconds: float,
    folder: Path,
) -> dict:
    """Write the transcoders into ``folder`` in circuit-tracer's layout (``config.yaml`` naming the hooks
    and the files, ``layer_{i}.safetensors`` with ``W_enc [F, d_in]``, ``W_dec [F, d_out]``,
    ``b_enc [F]``, ``b_dec [d_out]`` and ``activation_function.threshold [F]``, float32), their
    ``training_curve.csv`` and ``transcoders.json`` (the settings and :func:`evaluate_transcoders`'
    figures); returns the record."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    layers = transcoders.w_enc.shape[0]
    files = [f"layer_{layer}.safetensors" for layer in range(layers)]
    for layer, file in enumerate(files):
        tensors = {
            "W_enc": transcoders.w_enc[layer].detach().T.contiguous(),
            "W_dec": transcoders.w_dec[layer].detach().contiguous(),
            "b_enc": transcoders.b_enc[layer].detach().contiguous(),
            "b_dec": transcoders.b_dec[layer].detach().contiguous(),
            "activation_function.threshold": transcoders.threshold(layer).detach().contiguous(),
        }
        save_file(tensors, str(folder / file))
    config = [
        f"# Transcoders of pathkernels' fixture {spec.name} (tools/train_fixtures.py --transcoders), in",
        "# circuit-tracer's layout: one JumpReLU transcoder per MLP, reading the MLP's argument (its",
        "# norm's output) and writing the MLP's output.",
        f"model_name: {spec.name}",
        "model_kind: transcoder_set",
        f"feature_input_hook: {TRANSCODER_HOOKS[0]}",
        f"feature_output_hook: {TRANSCODER_HOOKS[1]}",
        "transcoders:",
        *(f"  - {file}" for file in files),
    ]
    (folder / "config.yaml").write_text("\n".join(config) + "\n")
    with open(folder / "training_curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            if curve_step(row["step"], len(rows)):
                writer.writerow({key: (value if key == "step" else f"{value:.6g}") for key, value in row.items()})
    record = {
        "fixture": spec.name,
        "layout": "circuit-tracer",
        "hooks": {"input": TRANSCODER_HOOKS[0], "output": TRANSCODER_HOOKS[1]},
        "activation": "jumprelu",
        "layers": layers,
        "features": tspec.features,
        "d_in": int(transcoders.w_enc.shape[1]),
        "d_out": int(transcoders.w_dec.shape[2]),
        "dtype": "float32",
        "training": {
            "seed": tspec.seed,
            "data_seeds": f"{TRANSCODER_DATA_SEED} + step",
            "steps": tspec.steps,
            "curve": f"training_curve.csv: per layer the normalised MSE and L0 of each step's batch, steps "
            f"{TRANSCODER_CURVE_STEPS}",
            "batch": tspec.batch,
            "tokens_per_step": tspec.batch * (2 * spec.length + 1),
            "optimiser": "Adam",
            "learning_rate": tspec.learning_rate,
            "schedule": f"linear warm-up over {tspec.warmup} steps, then cosine to a tenth",
            "loss": "Σ_l ‖y − ŷ‖² / s_l² + λ L0_l, s_l: layer l's output's RMS norm about its mean on the first batch",
            "l0": tspec.l0,
            "l0_warmup": tspec.l0_warmup,
            "initial_threshold": tspec.threshold,
            "threshold_learning_rate": tspec.threshold_learning_rate,
            "bandwidth": tspec.bandwidth,
            "threads": torch.get_num_threads(),
            "seconds": round(seconds, 1),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "held_out": evaluate_transcoders(model, spec, transcoders),
    }
    (folder / "transcoders.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record


def load_trained(name: str, folder: Path) -> torch.nn.Module:
    """Fixture ``name``'s checkpoint in ``folder``, float32, eval mode."""
    from pathkernels.core._progress import quiet_model_loading

    with quiet_model_loading():
        return getattr(transformers, SPECS[name].model_class).from_pretrained(folder).float().eval()


def train_and_save_transcoders(name: str, out: Path | None, threads: int) -> str:
    """Train fixture ``name``'s transcoders on its checkpoint (beside the loader, or in ``out``) and
    write them into its ``transcoders/`` folder; returns a summary line."""
    torch.set_num_threads(threads)
    spec, tspec = SPECS[name], TRANSCODERS[name]
    folder = fixture_path(name) if out is None else out / name
    model = load_trained(name, folder)
    begin = time.perf_counter()
    transcoders, rows, _ = train_transcoders(model, spec, tspec, log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - begin
    held_out = save_transcoders(transcoders, spec, tspec, model, rows, seconds, folder / "transcoders")["held_out"]
    layers = ", ".join(
        f"L{row['layer']} EV {row['explained_variance']:.3f} L0 {row['l0']:.1f}" for row in held_out["layers"]
    )
    replaced = held_out["replaced"]
    return (
        f"{name} transcoders: {seconds:.1f} s, {layers}; replaced accuracy {replaced['accuracy_repeated']:.4f} "
        f"of {replaced['accuracy_repeated_model']:.4f} ({replaced['accuracy_kept']:.3f} kept) -> {folder}/transcoders"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"fixtures to train, of {', '.join(SPECS)} (default: all)")
    parser.add_argument(
        "--transcoders",
        action="store_true",
        help=(
            "train the fixtures' transcoders (one per MLP) on their trained checkpoints instead, into their "
            f"transcoders/ folders (of {', '.join(TRANSCODERS)}; default: all of them)"
        ),
    )
    parser.add_argument("--out", type=Path, help="write the folders here (default: beside the loader)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per fixture (default 1)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="fixtures trained at once, each in a process of its own (default 1; the same bits either way)",
    )
    args = parser.parse_args(argv)
    known = TRANSCODERS if args.transcoders else SPECS
    unknown = [name for name in args.names if name not in known]
    if unknown:
        what = "fixtures with transcoders" if args.transcoders else "fixtures"
        parser.error(f"unknown {what} {unknown}; expected names of {list(known)}")
    if args.threads < 1 or args.jobs < 1:
        parser.error("expected --threads >= 1 and --jobs >= 1")
    names = args.names or list(known)
    task = train_and_save_transcoders if args.transcoders else train_and_save
    started = time.perf_counter()
    if args.jobs == 1:
        lines = [task(name, args.out, args.threads) for name in names]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            lines = list(pool.map(task, names, [args.out] * len(names), [args.threads] * len(names)))
    print("\n".join(lines))
    print(
        f"total {time.perf_counter() - started:.1f} s, {args.jobs} job(s) of {args.threads} thread(s), "
        f"{os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
