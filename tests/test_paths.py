"""PathTree, path counts and sample_paths."""

import itertools
import math
import time

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pathkernels as pk  # noqa: E402
from pathkernels.core.paths import MAX_ENUMERATED_PATHS, build_trie_chunk  # noqa: E402


def brute_force_paths(num_layers, num_heads, skip, max_length=None):
    choices = ([-1] if skip else []) + list(range(num_heads))
    paths = [p for p in itertools.product(choices, repeat=num_layers)]
    if max_length is not None:
        paths = [p for p in paths if sum(h >= 0 for h in p) <= max_length]
    return torch.tensor(paths, dtype=torch.long)  # itertools.product is lexicographic


@pytest.mark.parametrize(
    "layers, heads, skip, max_length",
    [
        (3, 2, False, None),
        (3, 2, True, None),
        (4, 3, True, 2),
        (2, 5, True, 0),
        (5, 2, True, 5),
        (1, 4, False, None),
    ],
)
def test_complete_tree_enumerates_every_path_in_lexicographic_order(layers, heads, skip, max_length):
    tree = pk.PathTree.complete(layers, heads, skip=skip, max_length=max_length)
    expected = brute_force_paths(layers, heads, skip, max_length)
    assert torch.equal(tree.paths(), expected)
    assert len(tree) == tree.num_paths == expected.shape[0]
    assert torch.equal(tree.lengths(), (expected >= 0).sum(1))
    counts = torch.bincount(tree.lengths(), minlength=layers + 1).tolist()
    assert tree.count_by_length() == counts == pk.count_by_length(layers, heads, skip=skip, max_length=max_length)
    levels = [1] + [torch.unique(expected[:, :k], dim=0).shape[0] for k in range(1, layers + 1)]
    assert tree.nodes_per_level() == levels


@given(st.integers(1, 7), st.integers(1, 4), st.data())
def test_short_path_trees_are_every_short_path_in_order(layers, heads, data):
    max_length = data.draw(st.integers(0, layers - 1))
    tree = pk.PathTree.complete(layers, heads, skip=True, max_length=max_length)
    expected = brute_force_paths(layers, heads, True, max_length)
    assert torch.equal(tree.paths(), expected)
    assert tree.nodes_per_level() == [1] + [torch.unique(expected[:, :k], dim=0).shape[0] for k in range(1, layers + 1)]
    # What the engine reads of it: ranges, any leaves, their lengths, each from the heads alone.
    start = data.draw(st.integers(0, len(tree)))
    stop = data.draw(st.integers(start, len(tree)))
    assert torch.equal(tree.path_range(start, stop), expected[start:stop])
    assert torch.equal(tree.leaf_lengths(start, stop), (expected[start:stop] >= 0).sum(1))
    leaves = torch.tensor(data.draw(st.lists(st.integers(0, len(tree) - 1), max_size=12)), dtype=torch.long)
    assert torch.equal(tree.leaf_paths(leaves), expected[leaves])
    assert tree.leaf_of_path() is None and tree.num_leaves == len(tree)


def test_deep_short_path_trees_hold_their_heads_alone():
    """L = 20,000 with at most one head: 20,001 paths, whose [M, L] table would take 3.2 GB.
    Growing every prefix layer by layer took minutes at L = 1000 and hung here; the tree now
    keeps each path's heads (one entry per head taken) and writes table rows only on request."""
    layers = 20_000
    tree = pk.PathTree.complete(layers, 2, skip=True, max_length=1)
    assert len(tree) == 2 * layers + 1
    assert tree._short.layer.numel() == tree._short.head.numel() == 2 * layers  # one entry per head taken
    assert torch.equal(tree.lengths(), (torch.arange(2 * layers + 1) > 0).long())
    # Lexicographic, skip first: the head comes ever earlier; row 1 + 2j + h takes head h at layer L-1-j.
    rows = torch.tensor([0, 1, 2, 3, 2 * layers - 1, 2 * layers])
    paths = tree.leaf_paths(rows)
    assert bool((paths[0] == -1).all())
    j, h = (rows[1:] - 1) // 2, (rows[1:] - 1) % 2
    assert torch.equal((paths[1:] >= 0).float().argmax(1), layers - 1 - j)
    assert torch.equal(paths[1:].gather(1, (layers - 1 - j).unsqueeze(1)).squeeze(1), h)
    assert torch.equal(paths[1:].clamp(min=0).sum(1), h)  # and no other head
    assert torch.equal(tree.path_range(2 * layers - 1, 2 * layers + 1), paths[-2:])
    assert tree.nodes_per_level()[:3] == [1, 3, 5] and tree.nodes_per_level()[-1] == len(tree)


def test_counts_are_exact_python_ints_beyond_int64():
    assert pk.count_paths(100, 12, skip=True) == 13**100
    assert pk.count_paths(12, 12, skip=True) == 13**12 == 23_298_085_122_481
    assert pk.count_by_length(12, 12, skip=True)[3] == math.comb(12, 3) * 12**3
    assert pk.count_paths(6, 4) == 4**6
    assert pk.count_paths(6, 4, skip=True, max_length=2) == 1 + 6 * 4 + 15 * 16


@pytest.mark.parametrize("skip", [True, False])
def test_a_max_length_beyond_the_layers_keeps_every_path(skip):
    """max_length > L caps nothing: the counts are those without it (an IndexError without the cap
    at L)."""
    for max_length in (6, 7, 100):
        assert pk.count_paths(6, 4, skip=skip, max_length=max_length) == pk.count_paths(6, 4, skip=skip)
        assert pk.count_by_length(6, 4, skip=skip, max_length=max_length) == pk.count_by_length(6, 4, skip=skip)
    assert pk.count_paths(6, 4, skip=True, max_length=100) == 5**6
    assert len(pk.PathTree.complete(3, 2, skip=True, max_length=5)) == 3**3


def test_too_large_tree_says_how_many_and_what_to_do():
    tree = pk.PathTree.complete(12, 12, skip=True)  # fine to stream (path_statistics), not to list
    with pytest.raises(ValueError, match=r"23,298,085,122,481 paths.*path_statistics.*max_length.*sampl.*length_sums"):
        tree.paths()
    assert tree.path_range(10**13, 10**13 + 2).shape == (2, 12)
    with pytest.raises(ValueError, match=r"more than int64 leaf indices reach"):
        pk.PathTree.complete(48, 25, skip=True)
    # The same network with a length cap is fine: 1 + 12·12 + 66·144 paths.
    assert len(pk.PathTree.complete(12, 12, skip=True, max_length=2)) == 1 + 144 + 66 * 144
    assert pk.count_paths(12, 12, skip=True) > MAX_ENUMERATED_PATHS


def test_from_paths_keeps_order_and_duplicates():
    paths = torch.tensor([[1, -1, 0], [0, 0, 0], [1, -1, 0], [-1, -1, -1], [0, 1, 1]])
    tree = pk.PathTree.from_paths(paths)
    assert torch.equal(tree.paths(), paths)
    assert tree.num_heads == 2 and tree.skip and len(tree) == 5 and tree.num_leaves == 4
    assert tree.lengths().tolist() == [2, 3, 2, 0, 3]
    assert tree.count_by_length() == [1, 0, 2, 2]
    assert pk.PathTree.from_paths(paths, num_heads=7).num_heads == 7


@pytest.mark.parametrize(
    "paths, error, message",
    [
        (torch.zeros(3, 2, dtype=torch.float32), TypeError, "expected paths as an integer tensor"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"expected paths of shape \[M, L\]"),
        (torch.zeros(0, 3, dtype=torch.long), ValueError, r"expected paths of shape \[M, L\]"),
        (torch.tensor([[0, -2]]), ValueError, r"expected heads in \[-1, 1\)"),
    ],
)
def test_from_paths_bad_input(paths, error, message):
    with pytest.raises(error, match="pathkernels.PathTree.from_paths: " + message):
        pk.PathTree.from_paths(paths)


def test_from_paths_head_out_of_range_for_given_heads():
    with pytest.raises(ValueError, match=r"expected heads in \[-1, 2\), got values in \[0, 3\]"):
        pk.PathTree.from_paths(torch.tensor([[0, 3]]), num_heads=2)


def test_complete_bad_arguments():
    with pytest.raises(ValueError, match=r"complete: expected num_heads in \[1, 2147483647\], got 0"):
        pk.PathTree.complete(3, 0)
    with pytest.raises(ValueError, match="max_length=2 keeps no path; pass skip=True"):
        pk.PathTree.complete(3, 2, max_length=2)
    with pytest.raises(TypeError, match="complete: expected skip to be True or False, got str 'no'"):
        pk.PathTree.complete(3, 2, skip="no")
    with pytest.raises(TypeError, match="complete: expected num_layers to be an int, got float 3.0"):
        pk.PathTree.complete(3.0, 2)
    assert pk.PathTree.complete(np.int64(3), np.int32(2), skip=np.bool_(True)).num_paths == 27


@pytest.mark.parametrize(
    "paths, num_heads, error, message",
    [
        ([], None, ValueError, "expected at least one path, got an empty list"),
        (
            [[0, 1], [1]],
            None,
            TypeError,
            r"expected paths as an integer tensor \[M, L\] or a list of M lists of L ints",
        ),
        (["ab"], None, TypeError, "expected paths as an integer tensor"),
        ([[0, 1]], 0, ValueError, "expected num_heads >= 1, got 0"),
        ([[0, 1]], -2, ValueError, "expected num_heads >= 1, got -2"),
    ],
)
def test_from_paths_refuses_what_is_not_a_path_set(paths, num_heads, error, message):
    with pytest.raises(error, match="pathkernels.PathTree.from_paths: " + message):
        pk.PathTree.from_paths(paths, num_heads=num_heads)


def test_trie_chunk_of_a_complete_tree_needs_no_gather():
    tree = pk.PathTree.complete(4, 3, skip=True)
    chunk = build_trie_chunk(tree.paths())
    for level, (parents, heads) in enumerate(zip(chunk.parents, chunk.heads)):
        for head in heads.unique():
            run = parents[heads == head]
            assert torch.equal(run, torch.arange(run.numel())), f"level {level + 1}, head {head}"
    assert [p.numel() for p in chunk.parents] == tree.nodes_per_level()[1:]
    assert sorted(chunk.leaf_position.tolist()) == list(range(len(tree)))


def test_trie_chunk_shares_prefixes_of_a_sparse_set():
    paths = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 1, 1]])
    chunk = build_trie_chunk(paths)
    assert [p.numel() for p in chunk.parents] == [2, 3, 4]
    # Following parents from each leaf's position reproduces its path.
    for i, path in enumerate(paths.tolist()):
        position, walked = int(chunk.leaf_position[i]), []
        for level in range(2, -1, -1):
            walked.append(int(chunk.heads[level][position]))
            position = int(chunk.parents[level][position])
        assert walked[::-1] == path


@pytest.mark.parametrize(("layers", "heads", "skip"), [(4, 3, False), (4, 3, True), (6, 2, True), (3, 1, True)])
def test_subtree_chunk_is_the_trie_of_its_leaves(layers, heads, skip):
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    choices = heads + int(skip)
    for depth in range(layers + 1):
        block = choices**depth
        start = int(torch.randint(tree.num_leaves // block, ())) * block
        closed_form = tree.subtree_chunk(start, depth)
        built = build_trie_chunk(tree.leaf_range(start, start + block))
        for got, expected in [(closed_form.parents, built.parents), (closed_form.heads, built.heads)]:
            assert [t.tolist() for t in got] == [t.tolist() for t in expected], (depth, start)
        assert torch.equal(closed_form.leaf_position, built.leaf_position), (depth, start)


def test_subtree_chunk_bad_arguments():
    with pytest.raises(ValueError, match="no subtree of depth 2 starts at leaf 3"):
        pk.PathTree.complete(3, 3).subtree_chunk(3, 2)
    with pytest.raises(ValueError, match="only for complete trees without max_length"):
        pk.PathTree.complete(3, 3, skip=True, max_length=1).subtree_chunk(0, 1)


# --- sampling ----------------------------------------------------------------------------------


def test_sampling_is_reproducible_from_a_generator():
    a = pk.sample_paths(6, 4, 50, skip=True, generator=torch.Generator().manual_seed(3))
    b = pk.sample_paths(6, 4, 50, skip=True, generator=torch.Generator().manual_seed(3))
    c = pk.sample_paths(6, 4, 50, skip=True, length=2, generator=torch.Generator().manual_seed(3))
    d = pk.sample_paths(6, 4, 50, skip=True, length=2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.equal(c, d)


def within_binomial_range(observed, expected_probability, total, alpha=1e-7):
    """Whether ``observed`` successes of ``total`` draws of probability p lie within the binomial's
    central range: neither tail, P[X ≤ observed] nor P[X ≥ observed], below ``alpha`` (about 5.3σ
    where the normal approximation holds; computed exactly, since a cell of 0.6 expected draws, as
    length 0 of 3^8 paths has, is far from normal: the 5σ band used before failed about once in
    15,000 runs of the length test, computed from the binomial tails)."""
    p = expected_probability
    if p <= 0 or p >= 1:
        return observed == (0 if p <= 0 else total)
    k = torch.arange(total + 1, dtype=torch.float64)
    log_pmf = (
        math.lgamma(total + 1)
        - torch.lgamma(k + 1)
        - torch.lgamma(total - k + 1)
        + k * math.log(p)
        + (total - k) * math.log1p(-p)
    )
    pmf = log_pmf.exp()
    return min(float(pmf[: observed + 1].sum()), float(pmf[observed:].sum())) >= alpha


@pytest.mark.parametrize("skip", [False, True])
def test_uniform_sampling_matches_the_length_distribution(skip):
    layers, heads, samples = 8, 3, 40_000
    paths = pk.sample_paths(layers, heads, samples, skip=skip)
    assert paths.shape == (samples, layers) and paths.dtype == torch.long
    assert int(paths.min()) >= (-1 if skip else 0) and int(paths.max()) < heads
    counts = pk.count_by_length(layers, heads, skip=skip)
    total = sum(counts)
    observed = torch.bincount((paths >= 0).sum(1), minlength=layers + 1).tolist()
    for k in range(layers + 1):
        assert within_binomial_range(observed[k], counts[k] / total, samples), (
            k,
            observed[k],
            counts[k] / total * samples,
        )
    # Every choice at every layer is equally likely.
    choices = heads + int(skip)
    for layer in range(layers):
        freq = torch.bincount(paths[:, layer] + int(skip), minlength=choices).tolist()
        assert all(within_binomial_range(f, 1 / choices, samples) for f in freq)


def test_fixed_length_sampling_picks_distinct_uniform_layers():
    layers, heads, k, samples = 7, 4, 3, 30_000
    paths = pk.sample_paths(layers, heads, samples, skip=True, length=k)
    taken = paths >= 0
    assert bool((taken.sum(1) == k).all())
    for layer in range(layers):
        assert within_binomial_range(int(taken[:, layer].sum()), k / layers, samples)
    head_freq = torch.bincount(paths[taken], minlength=heads).tolist()
    assert all(within_binomial_range(f, 1 / heads, samples * k) for f in head_freq)


def test_sampling_bad_arguments():
    with pytest.raises(ValueError, match=r"expected length in \[0, 4\], got 5"):
        pk.sample_paths(4, 2, 10, skip=True, length=5)
    with pytest.raises(ValueError, match="need skip=True"):
        pk.sample_paths(4, 2, 10, length=2)
    with pytest.raises(ValueError, match="expected num_samples >= 0, got -1"):
        pk.sample_paths(4, 2, -1)
    with pytest.raises(TypeError, match=r"expected generator to be a torch.Generator .* got str 'seed'"):
        pk.sample_paths(4, 2, 3, generator="seed")
    assert pk.sample_paths(4, 2, np.int64(3)).shape == (3, 4)


@pytest.mark.parametrize("length", [None, 2])
def test_sampling_without_replacement_is_a_uniform_subset(length):
    # 3 layers, 2 heads, skip: 27 paths in all, 12 of length 2. Both branches: enumerate-and-permute
    # (most of the set) and draw-and-drop-repeats (a small part of it).
    generator = torch.Generator().manual_seed(0)
    size = 27 if length is None else 12
    for num_samples in (size // 4, size - 1):
        counts = torch.zeros(size)
        every = pk.PathTree.complete(3, 2, skip=True).paths()
        if length is not None:
            every = every[(every != -1).sum(1) == length]
        rounds = 2000
        for _ in range(rounds):
            drawn = pk.sample_paths(3, 2, num_samples, skip=True, length=length, generator=generator, replace=False)
            assert drawn.shape == (num_samples, 3) and torch.unique(drawn, dim=0).shape[0] == num_samples
            counts += (drawn[:, None, :] == every[None]).all(-1).sum(0)
        # Each path is in the subset with probability num_samples / size.
        expected = rounds * num_samples / size
        spread = (rounds * num_samples / size * (1 - num_samples / size)) ** 0.5
        assert bool(((counts - expected).abs() <= 5 * spread + 1).all()), counts
    with pytest.raises(ValueError, match=f"expected num_samples <= {size} with replace=False"):
        pk.sample_paths(3, 2, size + 1, skip=True, length=length, replace=False)


def test_the_paths_of_one_length_are_listed_without_the_shorter_ones():
    """Most of the paths of one length, without replacement: only those paths are listed, in the
    order of the complete tree's (the same draws as filtering every path of at most that length),
    so a long network asks no more memory than the samples do. 12 of the 24 paths of length 23
    through 24 layers took 18 s and 6.6 GB when every path of length <= 23 was listed."""
    from pathkernels.core.paths import _enumerate_paths_of_length

    for layers, heads in itertools.product(range(1, 5), range(1, 4)):
        every = pk.PathTree.complete(layers, heads, skip=True).paths()
        for length in range(layers + 1):
            want = every[(every != -1).sum(1) == length]
            assert torch.equal(_enumerate_paths_of_length(layers, heads, length), want), (layers, heads, length)
    start = time.perf_counter()
    drawn = pk.sample_paths(24, 1, 12, skip=True, length=23, replace=False, generator=torch.Generator().manual_seed(1))
    assert time.perf_counter() - start < 5
    assert drawn.shape == (12, 24) and torch.unique(drawn, dim=0).shape[0] == 12
    assert bool(((drawn != -1).sum(1) == 23).all())
    drawn = pk.sample_paths(30, 2, 20, skip=True, length=2, replace=False)  # the draw-and-drop branch
    assert bool(((drawn != -1).sum(1) == 2).all()) and torch.unique(drawn, dim=0).shape[0] == 20


@pytest.mark.parametrize("skip", [True, False])
def test_leaf_lengths_of_complete_trees_in_blocks_and_ranges(skip):
    """The aligned blocks the engine streams (the low digits' pattern, plus the prefix's heads) and
    any other range give the heads each leaf takes."""
    tree = pk.PathTree.complete(4, 3, skip=skip)
    lengths = (tree.paths() != -1).sum(1)
    choices = 4 if skip else 3
    for depth in range(5):
        block = choices**depth
        for start in range(0, tree.num_leaves, block):
            assert torch.equal(tree.leaf_lengths(start, start + block), lengths[start : start + block])
    for start, stop in ((0, 7), (5, 41), (13, tree.num_leaves)):
        assert torch.equal(tree.leaf_lengths(start, stop), lengths[start:stop])
    # A set of paths: its leaves are its distinct paths, sorted.
    paths = torch.tensor([[2, -1, 0, 1], [-1, -1, -1, -1], [2, -1, 0, 1], [0, 1, 2, 0]])
    explicit = pk.PathTree.from_paths(paths, num_heads=3)
    assert explicit.leaf_lengths(0, 3).tolist() == [0, 4, 3]


def test_counts_are_refused_beyond_the_bits_they_may_take(monkeypatch):
    """Counts of more than MAX_COUNT_BITS bits together are refused, whatever way they are counted:
    H^L alone, (H+1)^L alone, or the L+1 (or max_length+1) terms by length. 80 s went into
    counting 10^4 layers of 10^4 heads by length before the bound."""
    import pathkernels.core.paths as paths

    monkeypatch.setattr(paths, "MAX_COUNT_BITS", 100)
    assert pk.count_paths(100, 2) == 2**100  # 100 bits: H^L, one term
    assert pk.count_by_length(100, 2)[-1] == 2**100
    assert pk.count_paths(50, 3, skip=True) == 4**50  # (H+1)^L, one term of 100 bits
    for call in (
        lambda: pk.count_paths(101, 2),
        lambda: pk.count_by_length(101, 2),
        lambda: pk.count_paths(51, 3, skip=True),
        lambda: pk.count_paths(50, 3, skip=True, max_length=25),  # terms of up to 87 bits, 26 of them
        lambda: pk.count_by_length(50, 3, skip=True),
        lambda: pk.count_by_length(10**6, 2, skip=True, max_length=120),  # 121 terms, each a bit at least
    ):
        with pytest.raises(ValueError, match=r"^pathkernels\.count_(paths|by_length): the counts of num_layers="):
            call()
    # The terms are sized one by one (log2 C(L, k) H^k): few short paths of many layers are small
    # numbers, whatever (H+1)^L would be.
    assert pk.count_paths(50, 3, skip=True, max_length=1) == 1 + 50 * 3
    assert pk.count_paths(10**6, 12, skip=True, max_length=1) == 1 + 12 * 10**6


def test_a_count_beyond_use_is_refused_at_once():
    """count_paths(6·10^7, 3) computed 3^(6·10^7), 9.5·10^7 bits, for 36 s to 5 minutes; its
    by-length counts, or those of 2^31 − 1 layers with a small max_length, built a list of every
    layer first (a minute, 17 GB). Counts beyond MAX_COUNT_BITS are refused in under a second,
    naming the function and the sizes; short paths of many layers are counted as fast."""
    import time

    for call, where in (
        (lambda: pk.count_paths(6 * 10**7, 3), "count_paths"),
        (lambda: pk.count_paths(6 * 10**7, 3, skip=True), "count_paths"),
        (lambda: pk.count_by_length(6 * 10**7, 3, skip=True), "count_by_length"),
        (lambda: pk.count_paths(2**31 - 1, 3, skip=True, max_length=10**6), "count_paths"),
        (lambda: pk.count_by_length(2**31 - 1, 3, skip=True, max_length=1), "count_by_length"),
        (lambda: pk.PathTree.complete(6 * 10**7, 3), "PathTree.complete"),
    ):
        started = time.perf_counter()
        with pytest.raises(ValueError, match=rf"^pathkernels\.{where}: .*num_layers=[\d,]+ layers"):
            call()
        assert time.perf_counter() - started < 1.0, where
    started = time.perf_counter()
    assert pk.count_paths(2**31 - 1, 3, skip=True, max_length=1) == 1 + 3 * (2**31 - 1)
    assert pk.count_paths(2**31 - 1, 3, max_length=1) == 0
    assert time.perf_counter() - started < 1.0


def test_counts_without_skip_and_a_max_length_below_the_layers_agree():
    """Without skip every path takes L heads, so max_length < L keeps none: count_paths said 8 for
    (3, 2, max_length=1) where count_by_length said zeros; both count 0 now, and PathTree.complete,
    which cannot hold an empty set, refuses it and says why."""
    for layers, heads, max_length in ((3, 2, 1), (3, 2, 0), (5, 4, 4)):
        assert pk.count_paths(layers, heads, max_length=max_length) == 0
        assert pk.count_by_length(layers, heads, max_length=max_length) == [0] * (layers + 1)
        assert pk.count_paths(layers, heads, max_length=max_length) == sum(
            pk.count_by_length(layers, heads, max_length=max_length)
        )
        with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.complete: without skip .* keeps no path"):
            pk.PathTree.complete(layers, heads, max_length=max_length)
    assert pk.count_paths(3, 2, max_length=3) == 8 == sum(pk.count_by_length(3, 2, max_length=3))


def test_counts_of_more_than_4300_digits_are_written_by_their_size():
    """Python refuses to write an int of more than 4,300 digits: a refusal that quoted such a count
    raised "Exceeds the limit (4300 digits)" instead of its own message."""
    from pathkernels.core._memory import format_count

    assert format_count(23_298_085_122_481) == "23,298,085,122,481"
    assert format_count(10**6000) == "about 1.00·10^6,000"
    assert format_count(3 * 10**5000 + 7) == "about 3.00·10^5,000"
    assert format_count(-(10**101)) == "-about 1.00·10^101"
    assert format_count(31**30) == "550,618,520,345,910,837,374,536,871,905,139,185,678,862,401"  # 45 digits
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.complete: the tree has about 1\.00·10\^6,000 paths"):
        pk.PathTree.complete(3000, 100)  # 100^3000
    with pytest.raises(
        ValueError, match=r"^pathkernels\.count_paths: expected num_layers in .*, got about 1\.00·10\^5,000"
    ):
        pk.count_paths(10**5000, 2)
    with pytest.raises(TypeError, match=r"^pathkernels\.count_paths: expected skip to be True or False, got int about"):
        pk.count_paths(2, 2, skip=10**5000)
    with pytest.raises(ValueError, match=r"^pathkernels\.sample_paths: num_samples=about 1\.00·10\^5,000 paths"):
        pk.sample_paths(3, 2, 10**5000)


@pytest.mark.parametrize("kind", ["complete", "short", "explicit"])
def test_path_and_leaf_ranges_outside_the_tree_are_refused(kind):
    """path_range(0, 10^6) of a 27-path tree wrapped round to a million paths; negative and float
    bounds were taken (as slices clamp them, or arange counts from them)."""
    tree = {
        "complete": pk.PathTree.complete(3, 2, skip=True),
        "short": pk.PathTree.complete(3, 2, skip=True, max_length=1),
        "explicit": pk.PathTree.from_paths([[0, 1, -1], [1, 1, 1], [0, 1, -1]]),
    }[kind]
    assert torch.equal(tree.path_range(0, tree.num_paths), tree.paths())
    assert tree.path_range(1, 1).shape == (0, 3)
    for method, count in (
        ("path_range", tree.num_paths),
        ("leaf_range", tree.num_leaves),
        ("leaf_lengths", tree.num_leaves),
    ):
        call = getattr(tree, method)
        for start, stop in ((0, 10**6), (0, count + 1), (2, 1), (count + 1, count + 2)):
            with pytest.raises(
                ValueError, match=rf"^pathkernels\.PathTree\.{method}: expected 0 <= start <= stop <= {count} "
            ):
                call(start, stop)
        with pytest.raises(ValueError, match=rf"^pathkernels\.PathTree\.{method}: expected start >= 0, got -3"):
            call(-3, 2)
        for start, stop, name in ((0.5, 2, "start"), (0, 2.0, "stop"), (None, 2, "start"), (True, 2, "start")):
            with pytest.raises(TypeError, match=rf"^pathkernels\.PathTree\.{method}: expected {name} to be an int"):
                call(start, stop)
        assert call(0, count).shape[0] == count


def test_from_paths_refuses_heads_beyond_the_int_range():
    """[[2**62, 0]] made a tree of 2^62 + 1 heads; num_heads=2**62 likewise."""
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.from_paths: expected heads in \[-1, 2147483647\)"):
        pk.PathTree.from_paths([[2**62, 0]])
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.from_paths: expected num_heads <= 2147483647"):
        pk.PathTree.from_paths([[1, 0]], num_heads=2**62)
    with pytest.raises(TypeError, match=r"^pathkernels\.PathTree\.from_paths: expected paths as an integer tensor"):
        pk.PathTree.from_paths([[2**63, 0]])  # beyond int64
    assert pk.PathTree.from_paths([[2**31 - 2, 0]]).num_heads == 2**31 - 1


def test_short_trees_of_huge_sizes_are_refused_before_they_allocate(monkeypatch):
    """max_length=0 over 2^31 − 1 heads built an arange of every head (16 GiB); 2^31 − 1 layers the
    completions [L + 1, k + 1] (16 GiB): an allocator error, or the machine's memory. (As on a
    machine with 64 GiB free, whatever this one has.)"""
    import pathkernels.core._memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 64 << 30)
    assert pk.PathTree.complete(3, 2**31 - 1, skip=True, max_length=0).paths().tolist() == [[-1, -1, -1]]
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.complete: the [\d,]+ paths of at most max_length=1"):
        pk.PathTree.complete(2**31 - 1, 1, skip=True, max_length=1)
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.complete: the counts of num_layers="):
        pk.PathTree.complete(2**31 - 1, 1, skip=True)  # counted by count_paths, refused in complete's name
