"""Train the fixtures of :mod:`pathkernels.fixtures` (docs/FIXTURES.md).

Three small transformers learn the induction task of :func:`pathkernels.fixtures.induction_batch`
(a start token, random tokens, then a random segment of 8 to 16 tokens twice) on the CPU, seeded and on
deterministic data, and each is written beside the loader as a Hugging Face checkpoint
(``save_pretrained``: ``config.json`` and ``model.safetensors``), its ``training_curve.csv`` (loss
and accuracy at every step) and ``fixture.json`` (the task, the settings, the final accuracies)::

    .venv/bin/python tools/train_fixtures.py --jobs 2        # all three, two at a time
    .venv/bin/python tools/train_fixtures.py attn_only_2l    # one of them
    .venv/bin/python tools/train_fixtures.py --out /tmp/fx   # somewhere else

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pathkernels.fixtures import BOS, fixture_path, induction_batch, repeated_positions  # noqa: E402

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
    )
}


def build_model(spec: FixtureSpec) -> torch.nn.Module:
    """The untrained model of ``spec``, initialised from ``torch.manual_seed(spec.seed)``; for
    ``frozen_zero_mlps``, every MLP weight and bias is zero and excluded from training."""
    torch.manual_seed(spec.seed)
    config = getattr(transformers, spec.config_class)(**spec.config)
    model = getattr(transformers, spec.model_class)(config)
    if spec.frozen_zero_mlps:
        zero_and_freeze_mlps(model)
    return model


def zero_and_freeze_mlps(model: torch.nn.Module) -> None:
    """Zero a GPT-2's MLP weights and biases and freeze them: ``c_proj(gelu(c_fc(x)))`` is then
    exactly 0 (``c_fc`` gives 0, gelu(0) = 0, ``c_proj`` maps it to its zero bias)."""
    for block in model.transformer.h:
        for parameter in block.mlp.parameters():
            with torch.no_grad():
                parameter.zero_()
            parameter.requires_grad_(False)


def task_metrics(logits: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Next-token metrics of ``logits [B, n, V]`` on ``ids [B, n]``: ``loss`` (every position),
    ``loss_repeated`` and ``accuracy_repeated`` (the positions of :func:`repeated_positions`, whose
    next token induction predicts), ``accuracy_first`` (the other positions but the start token's,
    whose next token is a fresh random one: chance is about 1/50)."""
    predicted, targets = logits[:, :-1].float(), ids[:, 1:]
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
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            rows.append({"step": step, **task_metrics(logits.detach(), ids)})
        if log is not None and (step % 250 == 0 or step == spec.steps - 1):
            log(
                f"{spec.name} step {step}: loss {rows[-1]['loss']:.4f}, repeated half {rows[-1]['loss_repeated']:.4f} "
                f"(accuracy {rows[-1]['accuracy_repeated']:.3f}), first half accuracy {rows[-1]['accuracy_first']:.3f}"
            )
    if spec.frozen_zero_mlps:
        assert all(float(p.abs().max()) == 0 for block in model.transformer.h for p in block.mlp.parameters())
    return model.eval(), rows


def evaluate(model: torch.nn.Module, spec: FixtureSpec, batch: int = 512) -> dict[str, float]:
    """:func:`task_metrics` on held-out batches (``seed=EVAL_SEED``, no training step's): the
    training task's (segments of ``min_length … length`` tokens) and, suffixed ``_full``, whole
    repeats (``[BOS, A, A]``, the example inputs' form)."""
    with torch.no_grad():
        ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED, spec.min_length)
        metrics = task_metrics(model(input_ids=ids).logits, ids)
        ids = induction_batch(spec.vocab, spec.length, batch, EVAL_SEED)
        full = task_metrics(model(input_ids=ids).logits, ids)
    return metrics | {f"{key}_full": value for key, value in full.items()}


def save(model: torch.nn.Module, spec: FixtureSpec, rows: list[dict], seconds: float, folder: Path) -> dict:
    """Write the checkpoint, ``training_curve.csv`` and ``fixture.json`` into ``folder``; returns the
    fixture's record (``fixture.json``)."""
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
    (folder / "fixture.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def train_and_save(name: str, out: Path | None, threads: int) -> str:
    """Train fixture ``name`` on ``threads`` torch threads and write its folder; returns a summary line."""
    torch.set_num_threads(threads)
    spec = SPECS[name]
    begin = time.perf_counter()
    model, rows = train(spec, log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - begin
    folder = fixture_path(name) if out is None else out / name
    final = save(model, spec, rows, seconds, folder)["final"]
    return (
        f"{name}: {seconds:.1f} s, held-out loss {final['loss']:.4f}, repeated half accuracy "
        f"{final['accuracy_repeated']:.4f}, first half {final['accuracy_first']:.4f} -> {folder}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"fixtures to train, of {', '.join(SPECS)} (default: all)")
    parser.add_argument("--out", type=Path, help="write the folders here (default: beside the loader)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per fixture (default 1)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="fixtures trained at once, each in a process of its own (default 1; the same bits either way)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in SPECS]
    if unknown:
        parser.error(f"unknown fixtures {unknown}; expected names of {list(SPECS)}")
    if args.threads < 1 or args.jobs < 1:
        parser.error("expected --threads >= 1 and --jobs >= 1")
    names = args.names or list(SPECS)
    started = time.perf_counter()
    if args.jobs == 1:
        lines = [train_and_save(name, args.out, args.threads) for name in names]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            lines = list(pool.map(train_and_save, names, [args.out] * len(names), [args.threads] * len(names)))
    print("\n".join(lines))
    print(
        f"total {time.perf_counter() - started:.1f} s, {args.jobs} job(s) of {args.threads} thread(s), "
        f"{os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
