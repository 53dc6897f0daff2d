"""The trained fixtures (pathkernels.fixtures): what they are, that they load as Hugging Face models
and reproduce their record, and the known answers of induction (Olsson et al. 2022) found by the
path decomposition, by the certified search and by full enumeration alike."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import pathkernels as pk
from pathkernels.fixtures import (
    BOS,
    FIXTURES,
    fixture_info,
    fixture_path,
    induction_batch,
    load_fixture,
    previous_occurrence,
    repeated_positions,
)

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _trainer():
    """tools/train_fixtures.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("train_fixtures", ROOT / "tools" / "train_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_fixtures", module)
    spec.loader.exec_module(module)
    return module


# -- the task ----------------------------------------------------------------------------------------------------


def test_induction_batch_by_hand():
    ids = induction_batch(vocab=64, length=5, batch=3, seed=7)
    assert ids.shape == (3, 11) and ids.dtype == torch.long
    assert bool((ids[:, 0] == BOS).all())
    assert torch.equal(ids[:, 1:6], ids[:, 6:11])  # min_length = length: the sequence, then again
    for row in ids:
        assert len(set(row[1:6].tolist())) == 5 and BOS not in row[1:].tolist()
    # previous_occurrence and repeated_positions on a sequence written out by hand.
    hand = torch.tensor([[BOS, 5, 9, 7, 5, 9, 3]])
    assert previous_occurrence(hand).tolist() == [[-1, -1, -1, -1, 1, 2, -1]]
    # position 4 (5 again) predicts 9 (which followed 5 at 1): yes; position 5 (9 again) predicts 7: no.
    assert repeated_positions(hand).tolist() == [[False, False, False, False, True, False, False]]


def test_induction_batch_segments_vary_and_repeat():
    ids = induction_batch(vocab=64, length=16, batch=256, seed=3, min_length=8)
    assert torch.equal(ids, induction_batch(vocab=64, length=16, batch=256, seed=3, min_length=8))
    previous = previous_occurrence(ids)
    repeated = repeated_positions(ids)
    counts = (previous >= 0).sum(-1)
    assert int(counts.min()) >= 8 and int(counts.max()) <= 16  # one copy of 8 … 16 tokens
    gaps = {int(t - previous[row, t]) for row, t in zip(*torch.nonzero(previous >= 0, as_tuple=True))}
    assert len(gaps) > 8  # the copies' distance varies: no head can find them by position alone
    rows, positions = torch.nonzero(repeated, as_tuple=True)
    assert torch.equal(ids[rows, positions + 1], ids[rows, previous[rows, positions] + 1])


def test_induction_batch_at_its_limits():
    # vocab − 1 = 2 · length − min_length: every token is used, each sequence a permutation.
    ids = induction_batch(vocab=9, length=8, batch=64, seed=1)
    assert all(sorted(set(row[1:].tolist())) == list(range(1, 9)) for row in ids)
    # Every token of 1 … vocab − 1 is drawn, none outside.
    ids = induction_batch(vocab=64, length=16, batch=256, seed=2, min_length=8)
    assert sorted(set(ids[:, 1:].flatten().tolist())) == list(range(1, 64))
    # A sequence whose first token repeats (no start token): position 2 repeats position 0.
    assert repeated_positions(torch.tensor([5, 9, 5, 9, 4])).tolist() == [False, False, True, False, False]


def test_induction_batch_refuses_impossible_tasks():
    with pytest.raises(ValueError, match="induction_batch: expected 2 · length − min_length ≤ vocab − 1"):
        induction_batch(vocab=8, length=8, batch=1, seed=0)  # 8 distinct tokens needed, 7 exist
    with pytest.raises(ValueError, match="induction_batch: expected min_length in"):
        induction_batch(vocab=64, length=8, batch=1, seed=0, min_length=9)
    with pytest.raises(ValueError, match="induction_batch: expected min_length in"):
        induction_batch(vocab=64, length=8, batch=1, seed=0, min_length=0)
    with pytest.raises(ValueError, match="fixtures: expected a fixture name"):
        fixture_path("gpt2-small")


# -- the shipped files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_small_trained_and_reproduces_its_record(name):
    folder = fixture_path(name)
    files = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "fixture.json", "training_curve.csv"} <= files
    assert sum(path.stat().st_size for path in folder.iterdir()) < 2 * 2**20
    info = fixture_info(name)
    final = info["final"]
    # Trained: induction predicts the second copy; the first copy's tokens stay at chance (1/63).
    assert final["accuracy_repeated"] > 0.9 and final["accuracy_repeated_full"] > 0.9
    assert final["accuracy_first"] < 0.05
    with open(folder / "training_curve.csv") as handle:
        curve = list(csv.DictReader(handle))
    assert len(curve) == info["training"]["steps"]
    assert float(curve[-1]["loss_repeated"]) < 0.5 * float(curve[0]["loss_repeated"])
    # The weights are the ones the record was measured on: the held-out accuracy again.
    model, inputs = load_fixture(name, dtype=torch.float32)
    assert type(model).__name__ == info["model"]["class"]
    assert sum(p.numel() for p in model.parameters()) == info["model"]["parameters"]
    trainer = _trainer()
    again = trainer.evaluate(model, trainer.SPECS[name])
    for key in ("accuracy_repeated", "accuracy_repeated_full", "loss_repeated"):
        assert again[key] == pytest.approx(final[key], abs=2e-3), key
    assert inputs["input_ids"].shape == (1, 2 * info["task"]["length"] + 1)


def test_loading_prints_nothing_and_leaves_the_progress_bar_setting(capfd):
    """transformers' "Loading weights" bar stays off while a fixture loads, and on afterwards."""
    logging = transformers.utils.logging
    assert logging.is_progress_bar_enabled()
    load_fixture("llama_2l")
    assert capfd.readouterr().err == ""
    assert logging.is_progress_bar_enabled()


def test_attention_only_fixture_has_zero_mlps():
    model, _ = load_fixture("attn_only_2l")
    for block in model.transformer.h:
        for parameter in block.mlp.parameters():
            assert float(parameter.detach().abs().max()) == 0.0


def test_training_is_seeded():
    """The first steps of training again give the recorded curve (to float32 rounding across CPUs)."""
    trainer = _trainer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fixtures were trained
    try:
        _, rows = trainer.train(trainer.SPECS["attn_only_2l"], steps=3)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)  # train() turns it on
    with open(fixture_path("attn_only_2l") / "training_curve.csv") as handle:
        recorded = list(csv.DictReader(handle))[:3]
    for row, want in zip(rows, recorded):
        for key in ("loss", "loss_repeated"):
            assert row[key] == pytest.approx(float(want[key]), rel=1e-4), (row["step"], key)


# -- the known answers -------------------------------------------------------------------------------------------


def _attention(name: str, batch: int = 8, seed: int = 5):
    """A fixture in float64, a held-out batch of the training task, and its attention [B, L, H, n, n]
    (as captured)."""
    model, _ = load_fixture(name)
    task = fixture_info(name)["task"]
    ids = induction_batch(task["vocab"], task["length"], batch, seed, task["length"] // 2)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids)
    return model, ids, stack.attn


def _previous_token_and_induction_heads(ids, attn):
    """Per head ``[H]``: how much layer 0 attends to the previous token (at positions 2 …), and how
    much layer 1 attends to the token after the previous occurrence (at the repeated positions)."""
    n = ids.shape[1]
    previous_token = attn[:, 0, :, torch.arange(2, n), torch.arange(1, n - 1)].mean((0, 2))
    rows, positions = torch.nonzero(repeated_positions(ids), as_tuple=True)
    targets = previous_occurrence(ids)[rows, positions] + 1
    induction = attn[rows, 1, :, positions, targets].mean(0)
    return previous_token, induction


def test_the_attention_only_fixture_has_a_previous_token_head_and_induction_heads():
    _, ids, attn = _attention("attn_only_2l")
    previous_token, induction = _previous_token_and_induction_heads(ids, attn)
    n = ids.shape[1]
    uniform = sum(1 / (t + 1) for t in range(2, n)) / (n - 2)  # a causal head attending evenly
    # Layer 0: one head looks at the previous token far more than the others and than an even spread.
    assert float(previous_token.max()) > 4 * uniform
    assert float(previous_token.max()) > 2 * float(previous_token.sort().values[-2])
    # Layer 1: induction heads, each attending (> 80 %) to the token after the previous copy.
    assert int((induction > 0.8).sum()) >= 1
    assert float(induction.max()) > 0.9


def _cases(ids, count: int = 4):
    """``count`` repeated positions of the first sequence, and the token induction predicts at each."""
    positions = torch.nonzero(repeated_positions(ids[:1])[0]).flatten()
    chosen = positions[torch.linspace(0, len(positions) - 1, count).round().long()]
    return [(int(t), int(ids[0, t + 1])) for t in chosen]


def _enumerated(every, found) -> Tensor:
    """The enumeration's attribution of each path (and source) the search found."""
    keys = {(tuple(p.tolist()), int(s)): i for i, (p, s) in enumerate(zip(every.paths, every.path_sources))}
    rows = [keys[(tuple(p.tolist()), int(s))] for p, s in zip(found.paths, found.sources)]
    return every.attribution[rows, 0, 0]


def _same_top(found, every, values: Tensor) -> None:
    """The search's list is the enumeration's: the same values, and each path found has the value
    the enumeration gives it (ties may be listed in another order)."""
    torch.testing.assert_close(found.values, values, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(_enumerated(every, found), found.values, rtol=1e-9, atol=1e-12)


def test_induction_known_answer_the_induction_heads_direct_paths_write_the_prediction():
    """At a second occurrence, the logit of the token that followed the first is written mostly by
    the paths from the embedding (of the token after the first occurrence) through one induction
    head alone, straight to the logit; the largest of all paths is one of them, found alike by the
    certified search and by full enumeration. The paths through the previous-token head's values
    carry little: its role is in the induction heads' keys, which the frozen patterns hold but no
    path through its values shows."""
    model, ids, attn = _attention("attn_only_2l")
    previous_token, induction = _previous_token_and_induction_heads(ids, attn)
    previous_head, induction_heads = (
        int(previous_token.argmax()),
        set(torch.nonzero(induction > 0.8).flatten().tolist()),
    )
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids[:1])
    carried = direct = through_previous = 0.0
    for position, target in _cases(ids):
        readout = pk.logit(model, target)
        found = pk.top_paths(stack, readout, 5, position=position)
        every = pk.path_attribution(stack, readout, positions=position, top_k=5)
        assert found.certified
        _same_top(found, every, every.top_values[:, 0, 0])
        top_path, top_source = found.paths[0].tolist(), found.source_names[int(found.sources[0])]
        assert top_source == "embedding" and top_path[0] == -1 and top_path[1] in induction_heads, top_path
        attribution = every.attribution[:, 0, 0]
        from_embedding = every.path_sources == found.source_names.index("embedding")
        one_head = (every.paths[:, 0] == -1) & torch.isin(every.paths[:, 1], torch.tensor(sorted(induction_heads)))
        carried += float(every.value[0, 0] - every.constant[0, 0])
        direct += float(attribution[from_embedding & one_head].sum())
        through_previous += float(attribution[every.paths[:, 0] == previous_head].sum())
    assert carried > 0
    assert direct > 0.45 * carried  # 57–66 % at these four positions (docs/FIXTURES.md: a median 62 % held out)
    assert abs(through_previous) < 0.1 * carried


@pytest.mark.parametrize("name", FIXTURES)
def test_top_20_certified_and_equal_to_enumeration(name):
    model, ids, _ = _attention(name, batch=1)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids)
    ((position, target),) = _cases(ids, count=1)
    logits = model(input_ids=ids).logits[0, position].detach().double()
    runner_up = int(logits.topk(2).indices[1]) if int(logits.argmax()) == target else int(logits.argmax())
    readout = pk.logit_diff(model, target, runner_up)
    every = pk.path_attribution(stack, readout, positions=position, top_k=20)
    for largest, values in ((True, every.top_values), (False, every.bottom_values)):
        found = pk.top_paths(stack, readout, 20, position=position, largest=largest)
        assert found.certified, (name, largest, found.bound, found.gap)
        _same_top(found, every, values[:, 0, 0])
    # The sum of every path and the constant is the model's own logit difference.
    torch.testing.assert_close(every.value[0, 0], logits[target] - logits[runner_up], rtol=1e-6, atol=1e-9)
