"""The trained fixtures (pathkernels.fixtures): what they are, that they load as Hugging Face models
and reproduce their record, and the known answers of induction (Olsson et al. 2022) found by the
path decomposition, by the certified search and by full enumeration alike; the fixture whose task
needs its MLPs (permuted_2l) and the fixtures' trained transcoders."""

from __future__ import annotations

import contextlib
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
    fixture_permutation,
    fixture_transcoders_info,
    fixture_transcoders_path,
    induction_batch,
    induction_targets,
    load_fixture,
    previous_occurrence,
    repeated_positions,
    token_permutation,
)

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _one_thread():
    """Torch on one thread within the block: the fixtures were trained so, and a loop of small
    operations on two threads beside another busy process ran 20 times slower (170 s against 9 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fixture_transcoders(name: str, model=None, dtype=torch.float64):
    """A fixture's trained transcoders as a user reads them: load_transcoders of their folder."""
    from pathkernels.adapters.transcoders import load_transcoders

    return load_transcoders(fixture_transcoders_path(name), model=model, dtype=dtype)


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


def test_the_permuted_task_by_hand():
    """π is a derangement of the tokens 1 … vocab − 1 that keeps the start token; the targets are the
    next tokens, but π of them at the repeated positions."""
    permutation = token_permutation(64, 0)
    assert torch.equal(permutation, token_permutation(64, 0)) and not torch.equal(permutation, token_permutation(64, 1))
    assert int(permutation[BOS]) == BOS and sorted(permutation.tolist()) == list(range(64))
    assert bool((permutation[1:] != torch.arange(1, 64)).all())  # no token is its own image
    hand = torch.tensor([[BOS, 5, 9, 7, 5, 9, 3]])
    assert torch.equal(induction_targets(hand), hand[:, 1:])
    # Position 4 (5 again) is repeated: its target is π(9); every other target is the next token.
    assert induction_targets(hand, permutation).tolist() == [[5, 9, 7, 5, int(permutation[9]), 3]]
    ids = induction_batch(vocab=64, length=16, batch=32, seed=4, min_length=8)
    targets, repeated = induction_targets(ids, permutation), repeated_positions(ids)[:, :-1]
    assert torch.equal(targets[repeated], permutation[ids[:, 1:][repeated]])
    assert torch.equal(targets[~repeated], ids[:, 1:][~repeated])
    with pytest.raises(ValueError, match="token_permutation: expected vocab ≥ 3"):
        token_permutation(2, 0)
    assert fixture_permutation("gpt2_4l") is None
    assert torch.equal(fixture_permutation("permuted_2l"), token_permutation(512, 0))


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


@contextlib.contextmanager
def as_trained():
    """One thread, as the fixtures and their transcoders were trained; after, the threads as they
    were and deterministic algorithms off (training turns them on)."""
    try:
        with _one_thread():
            yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("name", ["attn_only_2l", "permuted_2l"])
def test_training_is_seeded(name):
    """The first steps of training again give the recorded curve (to float32 rounding across CPUs)."""
    trainer = _trainer()
    with as_trained():
        _, rows = trainer.train(trainer.SPECS[name], steps=3)
    with open(fixture_path(name) / "training_curve.csv") as handle:
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


# -- the fixture whose task needs its MLPs -----------------------------------------------------------------------


def test_the_permuted_fixture_reads_and_writes_fixed_codes():
    """Its tokens' codes are fixed: the embedding writes C[A] into dimensions 0-31 and nothing else,
    the unembedding reads 2/3 C[B] from dimensions 32-63 and nothing else, as the untrained model
    drew them: no trained weight relabels a token."""
    model, _ = load_fixture("permuted_2l")
    info = fixture_info("permuted_2l")
    width = info["model"]["fixed_codes"]["width"]
    embedding = model.get_input_embeddings().weight.detach()
    unembedding = model.get_output_embeddings().weight.detach()
    assert float(embedding[:, width:].abs().max()) == 0 and float(unembedding[:, :width].abs().max()) == 0
    assert embedding.shape[1] == 2 * width
    torch.testing.assert_close(unembedding[:, width : 2 * width], embedding[:, :width] * (2 / 3), rtol=1e-6, atol=0)
    trainer = _trainer()
    untrained = trainer.build_model(trainer.SPECS["permuted_2l"])
    assert torch.equal(untrained.get_input_embeddings().weight.double(), embedding)
    assert model.config.vocab_size == 512 > 2 * model.config.n_embd  # 511 tokens, 32-dimensional codes


def test_the_permuted_fixture_needs_its_mlps():
    """The trained model answers π(A) at the second copy (98 %); with its MLPs zeroed, or replaced by
    their mean output, it falls to chance (1/511) and mostly answers A itself, the copied token: the
    attention copies, the MLPs relabel. The model trained alike with its MLPs zero and frozen stays
    far below (26 %)."""
    model, _ = load_fixture("permuted_2l", dtype=torch.float32)
    trainer = _trainer()
    found = trainer.mlp_ablations(model, trainer.SPECS["permuted_2l"])
    final = fixture_info("permuted_2l")["final"]
    recorded = final["mlp_ablations"]
    assert found.keys() == recorded.keys()
    for key, value in recorded.items():
        assert found[key] == pytest.approx(value, abs=2e-3), key
    chance = 1 / 511
    assert found["chance"] == pytest.approx(chance)
    assert found["accuracy_repeated"] > 0.95 and found["copies"] == 0
    assert found["accuracy_repeated_zero"] < 2 * chance and found["accuracy_repeated_mean"] < 2 * chance
    assert found["copies_zero"] > 0.4  # without its MLPs the model copies A
    assert max(found["accuracy_repeated_zero_layer0"], found["accuracy_repeated_zero_layer1"]) < 0.05  # both needed
    control = fixture_info("permuted_2l")["attention_only_control"]["final"]
    assert control["accuracy_repeated"] < 0.3 < final["accuracy_repeated"] - 0.6
    assert final["linear_map_accuracy"] < 0.25


def test_the_permuted_fixtures_linear_map_accuracy_is_reproduced():
    """The best linear map found from a token's input code to the readout of its image (the record's
    ``linear_map_accuracy``, 21 %) is found again, to a token or two of 511."""
    model, _ = load_fixture("permuted_2l", dtype=torch.float32)
    trainer = _trainer()
    with _one_thread():
        found = trainer.linear_map_accuracy(model, trainer.SPECS["permuted_2l"])
    assert found == pytest.approx(fixture_info("permuted_2l")["final"]["linear_map_accuracy"], abs=2.5 / 511)


# -- the trained transcoders -------------------------------------------------------------------------------------

WITH_TRANSCODERS = ("gpt2_4l", "llama_2l", "permuted_2l")


def _mlps(model) -> list[torch.nn.Module]:
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return [block.mlp for block in blocks]


def test_which_fixtures_have_transcoders():
    assert [name for name in FIXTURES if (fixture_path(name) / "transcoders").is_dir()] == list(WITH_TRANSCODERS)
    with pytest.raises(ValueError, match=r"fixture 'attn_only_2l' has no transcoders \(its MLPs are zero\)"):
        fixture_transcoders("attn_only_2l")
    with pytest.raises(ValueError, match="fixtures: expected a fixture name"):
        fixture_transcoders("gpt2-small")
    # All the shipped files, the transcoders with them, stay small.
    shipped = sum(path.stat().st_size for path in fixture_path("gpt2_4l").parent.rglob("*") if path.is_file()
                  and "__pycache__" not in path.parts)  # fmt: skip
    assert shipped < 6 * 2**20


@pytest.mark.parametrize("name", WITH_TRANSCODERS)
def test_fixture_transcoders_load_and_fit_their_model(name):
    """circuit-tracer's layout, one JumpReLU transcoder per MLP, read as writing the MLP's output from
    its argument, checked against the model by the reader."""
    model, _ = load_fixture(name)
    info = fixture_transcoders_info(name)
    folder = fixture_transcoders_path(name)
    layers = len(_mlps(model))
    assert {p.name for p in folder.iterdir()} == {
        "config.yaml", "transcoders.json", "training_curve.csv", *(f"layer_{i}.safetensors" for i in range(layers))
    }  # fmt: skip
    assert sum(p.stat().st_size for p in folder.iterdir()) < 1.2 * 2**20
    transcoders = fixture_transcoders(name, model=model)
    assert transcoders.layout == "circuit-tracer" and not transcoders.cross_layer
    assert (transcoders.input_hook, transcoders.output_hook) == ("mlp_input", "mlp_output")
    assert transcoders.source_hooks == ("mlp.hook_in", "hook_mlp_out") and transcoders.model_name == name
    assert transcoders.layers == tuple(range(layers)) and transcoders.dtype == torch.float64
    assert transcoders.d_in == transcoders.d_out == model.config.get_text_config().hidden_size
    for layer in transcoders.layers:
        assert transcoders.activation[layer] == "jumprelu" and transcoders.num_features(layer) == info["features"]
        assert float(transcoders.threshold[layer].min()) > 0 and transcoders.w_skip[layer] is None
    assert fixture_transcoders(name, dtype=torch.float32).dtype == torch.float32


def logits_with_mlp_hook(model, ids, hook):
    """The model's logits on ``ids`` with ``hook(layer, mlp_input, mlp_output)`` on every MLP (its
    return, where not None, replaces the MLP's output)."""
    handles = []
    for layer, mlp in enumerate(_mlps(model)):
        handles.append(
            mlp.register_forward_hook(lambda module, args, output, layer=layer: hook(layer, args[0], output))
        )
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("name", WITH_TRANSCODERS)
def test_fixture_transcoders_reproduce_their_record(name):
    """On the held-out batch, each transcoder (the reader's forward, float32) reconstructs the model's
    MLP output as recorded: normalised MSE, explained variance, active features per token; and the
    model with every MLP replaced by its transcoder, no error term, keeps the recorded accuracy.
    Tolerances: 1e-3 on the variance figures, 0.05 features, 2e-3 on the accuracies (float32 rounding
    across CPUs)."""
    model, _ = load_fixture(name, dtype=torch.float32)
    record = fixture_transcoders_info(name)["held_out"]
    transcoders = fixture_transcoders(name, model=model, dtype=torch.float32)
    task = fixture_info(name)["task"]
    ids = induction_batch(task["vocab"], task["length"], 512, record["eval_seed"], task["min_length"])
    seen = {}
    own = logits_with_mlp_hook(model, ids, lambda layer, x, y: seen.__setitem__(layer, (x, y)))
    assert len(record["layers"]) == len(seen) and record["tokens"] == ids.numel()
    for row in record["layers"]:
        x, y = seen[row["layer"]]
        with torch.no_grad():
            error = (transcoders.forward(row["layer"], x) - y).pow(2).sum()
            active = (transcoders.encode(row["layer"], x) != 0).float().sum(-1)
        assert float(error / y.pow(2).sum()) == pytest.approx(row["nmse"], abs=1e-3), row
        assert float(1 - error / (y - y.mean((0, 1))).pow(2).sum()) == pytest.approx(
            row["explained_variance"], abs=1e-3
        ), row
        assert float(active.mean()) == pytest.approx(row["l0"], abs=0.05), row
        assert row["explained_variance"] > 0.95 and row["l0"] < 80
    logits = logits_with_mlp_hook(model, ids, lambda layer, x, y: transcoders.forward(layer, x))
    targets = induction_targets(ids, fixture_permutation(name))
    repeated = repeated_positions(ids)[:, :-1]
    accuracy = float((logits[:, :-1].argmax(-1) == targets)[repeated].float().mean())
    model_accuracy = float((own[:, :-1].argmax(-1) == targets)[repeated].float().mean())
    assert accuracy == pytest.approx(record["replaced"]["accuracy_repeated"], abs=2e-3)
    assert model_accuracy == pytest.approx(record["replaced"]["accuracy_repeated_model"], abs=2e-3)
    assert record["replaced"]["accuracy_kept"] > 0.95


CAPTURES = {  # the example's first tokens and the first again: induction predicts the second
    "gpt2_4l": dict(tokens=5, max_length=2),  # 4 layers: the paths through more than 2 steps in one sum
    "llama_2l": dict(tokens=5, max_length=None),
    "permuted_2l": dict(tokens=4, max_length=None),
}


@pytest.mark.parametrize("name", WITH_TRANSCODERS)
def test_a_capture_with_fixture_transcoders_sums_to_the_logit(name):
    """Each MLP replaced by its trained transcoder and its error term: the paths through heads and
    features plus the constant are the model's own logit (float64, to 1e-9), at a second occurrence
    where the 2-layer fixtures predict what induction copies (π of it for permuted_2l). On gpt2_4l the
    paths of more than two steps are summed whole (``unenumerated``): listing them one by one would
    take billions. Llama's float64 forward rounds its RMSNorms to float32: its paths are held to the
    float64 reference (tests/float64_reference.py) to 1e-9 and to its own forward to 1e-6."""
    from float64_reference import logits_in_float64

    model, inputs = load_fixture(name)
    example = inputs["input_ids"][0]
    setting = CAPTURES[name]
    ids = torch.cat([example[: setting["tokens"]], example[1:2]])[None]
    permutation = fixture_permutation(name)
    target = int(example[2]) if permutation is None else int(permutation[example[2]])
    transcoders = fixture_transcoders(name, model=model)
    with _one_thread():  # hundreds of thousands of paths in small chunks
        stack, capture = pk.adapters.capture_huggingface_residual(model, transcoders=transcoders, input_ids=ids)
        result = pk.path_attribution(stack, pk.logit(model, target), top_k=5, max_length=setting["max_length"])
    assert sorted(capture.transcoders.layers) == list(transcoders.layers)
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    if setting["max_length"] is None:
        assert float(result.unenumerated.abs().max()) < 1e-12
    else:
        total += float(result.unenumerated.sum())
    with torch.no_grad():
        own = float(model(input_ids=ids).logits[0, -1, target])
    if name != "llama_2l":
        assert abs(total - own) < 1e-9, (total, own)
    else:
        assert abs(total - float(logits_in_float64(model, input_ids=ids)[0, -1, target])) < 1e-9
        assert abs(total - own) < 1e-6
    if name != "gpt2_4l":  # on 5 tokens gpt2_4l's induction has not started
        assert int(model(input_ids=ids).logits[0, -1].argmax()) == target
    assert any("MLP error" in source for source in result.source_names)


@pytest.mark.parametrize("name", WITH_TRANSCODERS)
def test_transcoder_training_is_seeded(name):
    """The first steps of the transcoders' training again give their recorded curve."""
    trainer = _trainer()
    model = trainer.load_trained(name, fixture_path(name))
    with as_trained():
        _, rows, _ = trainer.train_transcoders(model, trainer.SPECS[name], trainer.TRANSCODERS[name], steps=3)
    with open(fixture_transcoders_path(name) / "training_curve.csv") as handle:
        recorded = list(csv.DictReader(handle))[:3]
    for row, want in zip(rows, recorded):
        assert row["step"] == int(want["step"])
        for key, value in want.items():
            if key != "step":
                assert row[key] == pytest.approx(float(value), rel=1e-4), (row["step"], key)
