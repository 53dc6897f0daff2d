"""Work limits: calls whose work exceeds a stated bound refuse before starting.

pk.decompose and pk.path_statistics of a 10^15-path tree began streaming for years; they refuse
beyond ``max_paths=`` (10^10 by default), naming the bound, the time at the measured rates and
the ways round, and run with a larger ``max_paths=``. sample_paths refuses draws that would not
fit in memory, instead of the allocator's error.
"""

import sys
import time

import pytest
import torch

import pathkernels as pk
from pathkernels.core.paths import DEFAULT_MAX_PATHS
from pathkernels.testing import random_attention

HUGE = random_attention(1, 15, 9, 3, 3, dtype=torch.float64)  # (9 + 1)^15 = 10^15 paths with skip


def test_the_default_bound_is_ten_billion_paths():
    assert DEFAULT_MAX_PATHS == 10**10


@pytest.mark.parametrize(
    "call, name, ways",
    [
        (lambda: pk.decompose(HUGE), "decompose", r"Pass max_length .*num_samples or samples_per_length"),
        (
            lambda: pk.path_statistics(HUGE, pk.PathTree.complete(15, 9, skip=True)),
            "path_statistics",
            r"Stream a tree with max_length .*sample paths",
        ),
    ],
    ids=["decompose", "path_statistics"],
)
def test_a_ten_to_the_fifteen_path_tree_is_refused_at_once(call, name, ways):
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=rf"^pathkernels\.{name}: the call would evaluate 1,000,000,000,000,000 paths, more than "
        rf"max_paths=10,000,000,000: 5\.3 years to 317 years at the 6·10\^6 to 10\^5 paths/s measured on an H200 "
        rf"and on 2 CPU cores \(\S*docs/BENCHMARKS\.md\)\. {ways}.*; "
        r"or pass max_paths=1000000000000000 to run them all$",
    ):
        call()
    assert time.monotonic() - start < 5  # refused before any work


def test_the_bound_is_inclusive_and_a_larger_max_paths_runs(monkeypatch):
    """Exactly max_paths paths run; one more is refused. decompose of a tree within the bound that
    streams (stubbed: no run) passes its max_paths on."""
    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)  # 27 paths with skip
    assert len(pk.decompose(attn, max_paths=27).paths) == 27
    with pytest.raises(
        ValueError, match=r"^pathkernels\.decompose: the call would evaluate 27 paths, more than max_paths=26"
    ):
        pk.decompose(attn, max_paths=26)
    tree = pk.PathTree.complete(3, 2, skip=True)
    assert int(pk.path_statistics(attn, tree, max_paths=27).counts.sum()) == 27
    with pytest.raises(ValueError, match=r"^pathkernels\.path_statistics: the call would evaluate 27 paths"):
        pk.path_statistics(attn, tree, max_paths=26)
    streamed = []
    module = sys.modules["pathkernels.core.statistics"]
    monkeypatch.setattr(module, "_stream", lambda net, tree, *args, **kwargs: streamed.append(tree) or "streamed")
    assert pk.path_statistics(HUGE, pk.PathTree.complete(15, 9, skip=True), max_paths=10**15) == "streamed"
    assert streamed[0].num_paths == 10**15


def test_samples_are_bounded_as_trees_are():
    """num_samples, samples_per_length (what is drawn: no more than a length has) and an explicit
    tree count against max_paths alike."""
    attn = random_attention(1, 4, 3, 4, 4, dtype=torch.float64)  # 4^4 = 256 paths with skip
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: the call would evaluate 100 paths, .*=99"):
        pk.decompose(attn, num_samples=100, max_paths=99)
    assert len(pk.decompose(attn, num_samples=100, max_paths=100).paths) == 100
    # Lengths 0..2 hold 1, 12 and 54 paths: min(40, count) of each is 1 + 12 + 40 = 53.
    with pytest.raises(ValueError, match=r"evaluate 53 paths, more than max_paths=52"):
        pk.decompose(attn, samples_per_length=40, max_length=2, max_paths=52)
    assert len(pk.decompose(attn, samples_per_length=40, max_length=2, max_paths=53).paths) == 53
    with pytest.raises(ValueError, match=r"evaluate 10,000,000,000,000 paths, more than max_paths=10,000,000,000"):
        pk.decompose(HUGE, num_samples=10**13)
    tree = pk.PathTree.from_paths(torch.tensor([[0, 1, -1, 2], [1, 1, 1, 1], [-1, -1, -1, -1]]), num_heads=3)
    with pytest.raises(ValueError, match=r"evaluate 3 paths, more than max_paths=2"):
        pk.decompose(attn, tree=tree, max_paths=2)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-5, ValueError), (1e10, TypeError), (True, TypeError)])
def test_max_paths_must_be_a_positive_int(bad, error):
    attn = random_attention(1, 2, 2, 3, 3, dtype=torch.float64)
    for call, name in (
        (lambda: pk.decompose(attn, max_paths=bad), "decompose"),
        (lambda: pk.path_statistics(attn, pk.PathTree.complete(2, 2), max_paths=bad), "path_statistics"),
    ):
        with pytest.raises(error, match=rf"^pathkernels\.{name}: expected max_paths"):
            call()


def test_a_captured_model_is_bounded_too():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=20)
    gpt2 = transformers.GPT2LMHeadModel(config).double().eval()
    stack, _ = pk.adapters.capture_huggingface_residual(gpt2, input_ids=torch.randint(0, 20, (1, 4)))
    every = 9 + 2 * 3 + 2 * 1  # from the embedding; from layer 0's two sources; from layer 1's
    assert len(pk.decompose(stack, max_paths=every).paths) == every
    with pytest.raises(ValueError, match=rf"^pathkernels\.decompose: the call would evaluate {every} paths, more than"):
        pk.decompose(stack, max_paths=every - 1)
    with pytest.raises(ValueError, match=r"evaluate 5 paths, more than max_paths=4"):
        pk.decompose(stack, num_samples=5, max_paths=4)


def test_sample_paths_refuses_draws_that_would_not_fit_in_memory():
    """sample_paths(3, 2, 10**15) failed in the allocator; the estimate comes first."""
    with pytest.raises(
        ValueError,
        match=r"^pathkernels\.sample_paths: num_samples=1,000,000,000,000,000 paths of 3 layers \(int64, with the "
        r"draws' temporaries\) need about [0-9.]+ TiB \(72,000,000,000,000,000 bytes\), more than the .* available "
        r"on cpu; draw fewer paths \(num_samples\)",
    ):
        pk.sample_paths(3, 2, 10**15)
