"""Multi-process runs (gloo, 2 and 3 processes started by the test) equal single-process runs."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pathkernels as pk
from pathkernels.core.distributed import leaf_range

sys.path.insert(0, str(Path(__file__).parent))
import itertools

import distributed_worker as worker

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
EQUAL_CASES = [
    "skip",
    "max_length",
    "explicit",
    "no_skip_all_ranks",
    "stratified",
    "uniform",
    "statistics",
    "float32_range",
]
FAILING_CASES = ["rank1_raises", "mismatched_attn", "mismatched_seed", "skip"]  # the group survives errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cases: list[str], tmp_path: Path, timeout: float = 180) -> list[dict]:
    store = tmp_path / "store"  # a file store: no rank hosts a server that could go away before the others
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, worker.__file__, str(r), str(world), str(store), str(outs[r]), *cases],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log[-3000:]}"
    return [torch.load(out, weights_only=False) for out in outs]


def single_process(case: str):
    return worker.summary(worker.run(case, rank=0))


def assert_same(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for key in got:
        if isinstance(got[key], torch.Tensor) and got[key].is_floating_point():
            # The same algorithm; thread counts and chunk edges may change the last bit of a GEMM.
            torch.testing.assert_close(got[key], expected[key], rtol=1e-12, atol=1e-15)
        elif isinstance(got[key], torch.Tensor):
            assert torch.equal(got[key], expected[key]), key
        elif key == "table":
            assert got[key].keys() == expected[key].keys()
            for column, values in got[key].items():
                assert values == pytest.approx(expected[key][column], rel=1e-12, nan_ok=True), column
        else:
            assert got[key] == expected[key]


@pytest.mark.parametrize("world", [2, 3])
def test_results_equal_a_single_process_run(world, tmp_path):
    pytest.importorskip("pandas")  # the decompositions' tables
    ranks = launch(world, EQUAL_CASES, tmp_path)
    for case in EQUAL_CASES:
        expected = single_process(case)
        status, got = ranks[0][case]
        assert status == "ok", (case, ranks[0][case])
        assert_same(got, expected)
        for other in ranks[1:]:
            if case.endswith("all_ranks"):
                assert_same(other[case][1], expected)
            else:
                assert other[case] == ("ok", None)


def test_a_failing_rank_stops_every_rank_and_mismatches_are_named(tmp_path):
    ranks = launch(2, FAILING_CASES, tmp_path, timeout=120)
    # rank 1's own error, and the same error type on rank 0, naming rank 1.
    assert ranks[1]["rank1_raises"][:2] == ("error", "ValueError")
    assert "memory_budget=100 bytes is too small" in ranks[1]["rank1_raises"][2]
    assert ranks[0]["rank1_raises"][:2] == ("error", "ValueError")
    assert "rank 1 failed: ValueError" in ranks[0]["rank1_raises"][2]
    for rank in ranks:
        status, kind, message = rank["mismatched_attn"]
        assert (status, kind) == ("error", "ValueError") and "inputs differ (attn of rank 1 != rank 0)" in message
        status, kind, message = rank["mismatched_seed"]
        assert (status, kind) == ("error", "ValueError") and "paths_sha1" in message and "same seed" in message
    # After those errors the group still works.
    assert_same(ranks[0]["skip"][1], single_process("skip"))


def test_leaf_ranges_are_balanced_and_cover_the_leaves():
    for total in (0, 1, 7, 10, 1000):
        for world in (1, 2, 3, 8):
            ranges = [leaf_range(total, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [stop - start for start, stop in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_group_false_or_uninitialised_is_one_process():
    attn = worker.network()[0]
    tree = pk.PathTree.complete(4, 3, skip=True)
    torch.testing.assert_close(
        pk.path_residuals(attn, tree, group=False).residual, pk.path_residuals(attn, tree).residual
    )
    with pytest.raises(ValueError, match="got a process group, but torch.distributed is not initialised"):
        pk.path_residuals(attn, tree, group=object())


def test_cli_paths_under_torchrun_matches_one_process():
    pytest.importorskip("pandas")
    args = ["paths", "--layers", "4", "--heads", "3", "--width", "16", "--tokens", "8"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "pathkernels", *args], capture_output=True, text=True, timeout=120, check=True, env=env
    ).stdout
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "pathkernels",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    two = run.stdout
    assert "split over 2 processes" in two
    table = lambda out: out[out.index("\n length") :].strip()
    assert table(two) == table(one)


def test_launched_group_creates_and_destroys_the_torchrun_group(monkeypatch):
    with pk.distributed.launched_group() as distributed:  # not under torchrun: nothing to do
        assert distributed is False and not dist.is_initialized()
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="inside"), pk.distributed.launched_group() as distributed:
        assert distributed is False and dist.is_initialized() and dist.get_world_size() == 1
        raise RuntimeError("inside")
    assert not dist.is_initialized()  # destroyed on the way out, even after an error
