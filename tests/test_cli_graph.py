"""``pathkernels graph``, ``attribute --transcoders`` and ``scores --transcoders`` on a fixture with a transcoder
set written here in circuit-tracer's layout: what they print and write, and what they refuse."""

import json

import pytest
import torch
from test_cli import run  # main in process: exit code, stdout, stderr lines

from pathkernels.adapters.transcoders import random_transcoders
from pathkernels.analysis.graph_files import CIRCUIT_TRACER_KEYS

pytest.importorskip("transformers")
pytest.importorskip("pandas")
yaml = pytest.importorskip("yaml")
safetensors = pytest.importorskip("safetensors.torch")


def write_circuit_tracer_set(folder, layers: int = 4, width: int = 64, features: int = 16):
    """A random JumpReLU set for the MLP's argument, as circuit-tracer's files hold one."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    set_ = random_transcoders(layers, width, features, generator=generator, dtype=torch.float32)
    for layer in range(layers):
        safetensors.save_file(
            {
                "W_enc": set_.w_enc[layer].T.contiguous(),
                "W_dec": set_.w_dec[layer][layer].contiguous(),
                "b_enc": set_.b_enc[layer],
                "b_dec": set_.b_dec[layer],
                "activation_function.threshold": set_.threshold[layer],
            },
            str(folder / f"layer_{layer}.safetensors"),
        )
    config = {
        "model_kind": "transcoder_set",
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "hook_mlp_out",
        "transcoders": [f"layer_{layer}.safetensors" for layer in range(layers)],
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_graph_writes_the_files_circuit_tools_read(tmp_path, capsys):
    folder = write_circuit_tracer_set(tmp_path / "transcoders")
    out = tmp_path / "out"
    argv = ["graph", "--model", "gpt2_4l", "--example", "--transcoders", str(folder), "--out", str(out)]
    code, printed, errors = run([*argv, "--paths-per-link", "2", "--top", "5"], capsys)
    assert code == 0, errors
    assert "Attribution graph of" in printed and "most influential features and errors" in printed
    exact = printed.split("its node's value (to ")[1].split(")")[0]
    assert float(exact) < 1e-10
    record = torch.load(out / "graph.pt", weights_only=False)
    assert set(record) == set(CIRCUIT_TRACER_KEYS)
    document = json.loads((out / "graph.json").read_text())
    assert document["links"] and document["nodes"]
    assert any("pathkernels_paths" in link for link in document["links"])
    assert json.loads((out / "graph-metadata.json").read_text())["graphs"][0]["slug"] == "graph"
    for name in ("graph.png", "graph_nodes.csv", "graph_edges.csv"):
        assert (out / name).stat().st_size > 0


def test_attribute_follows_paths_through_the_features(tmp_path, capsys):
    folder = write_circuit_tracer_set(tmp_path / "transcoders")
    argv = ["attribute", "--model", "gpt2_4l", "--example", "--transcoders", str(folder), "--top", "3"]
    code, printed, errors = run([*argv, "--max-length", "2"], capsys)
    assert code == 0, errors
    assert "through at most 2 steps" in printed
    assert "L0 MLP error" in printed and "L0 transcoder bias" in printed

    def enumerated(text: str) -> int:
        return int(text.split("paths: the ")[1].split(" ")[0].replace(",", ""))

    code, plain, errors = run(["attribute", "--model", "gpt2_4l", "--example", "--max-length", "2"], capsys)
    assert code == 0, errors
    assert enumerated(printed) > enumerated(plain)  # the features' paths too


def test_scores_split_a_heads_score_through_the_features(tmp_path, capsys):
    """``scores --transcoders``: the groups by steps, every pair listed (few paths below layer 1)
    or searched, with paths through layer 0's features, and the sums the model's own score."""
    folder = write_circuit_tracer_set(tmp_path / "transcoders")
    argv = ["scores", "--model", "gpt2_4l", "--example", "--transcoders", str(folder), "--layer", "1", "--top", "40"]
    code, printed, errors = run(argv, capsys)
    assert code == 0, errors
    exact = printed.split("|sum of pairs − model| ")[1].split(")")[0]
    assert float(exact) < 1e-10
    assert "via 1 step" in printed and "L0 MLP error" in printed
    assert " F" in printed.split("pairs (query path · key path)")[1]  # a pair through a feature
    code, plain, errors = run(["scores", "--model", "gpt2_4l", "--example", "--layer", "1"], capsys)
    assert code == 0, errors

    def per_side(text: str) -> int:
        return int(text.split(" paths per side")[0].split(" ")[-1].replace(",", ""))

    assert per_side(printed) > per_side(plain)  # the features' paths too


@pytest.mark.parametrize(
    "argv, message",
    [
        (["attribute", "--transcoders", "nowhere"], "--transcoders nowhere needs --model"),
        (["scores", "--transcoders", "nowhere"], "--transcoders nowhere needs --model"),
        (["attribute", "--model", "gpt2_4l", "--transcoders", "nowhere"], "--transcoders nowhere: no such folder"),
        (["graph", "--model", "gpt2_4l"], "the following arguments are required: --transcoders"),
        (["graph", "--model", "gpt2_4l", "--transcoders", ".", "--node-threshold", "1.5"], "expected a number in"),
        (["attribute", "--model", "gpt2_4l", "--example", "--transcoders", "TC", "--max-length", "9"],
         "expected at most the model's 8 steps"),
    ],
)  # fmt: skip
def test_what_the_graph_commands_refuse(argv, message, tmp_path, capsys):
    argv = [str(write_circuit_tracer_set(tmp_path / "tc")) if arg == "TC" else arg for arg in argv]
    code, printed, errors = run(argv, capsys)
    assert code == 2
    assert message in "\n".join(errors)


def test_a_set_that_does_not_fit_the_model_is_refused_by_name(tmp_path, capsys):
    folder = write_circuit_tracer_set(tmp_path / "transcoders", width=32)
    code, _, errors = run(["graph", "--model", "gpt2_4l", "--example", "--transcoders", str(folder)], capsys)
    errors = "\n".join(errors)
    assert code == 2
    assert "--transcoders" in errors and "d_in=32" in errors and "width is 64" in errors


def write_circuit_tracer_clt(folder, layers: int = 4, width: int = 64, features: int = 16):
    """A random cross-layer JumpReLU set reading the stream entering each MLP's norm, in
    circuit-tracer's cross-layer files (``W_enc_{i}``: ``[F, d]``; ``W_dec_{i}``: ``[F, L − i, d]``)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    set_ = random_transcoders(layers, width, features, generator=generator, dtype=torch.float32, cross_layer=True)
    for layer in range(layers):
        encoder = {
            f"W_enc_{layer}": set_.w_enc[layer].T.contiguous(),
            f"b_enc_{layer}": set_.b_enc[layer],
            f"b_dec_{layer}": set_.b_dec[layer],
            f"threshold_{layer}": set_.threshold[layer],
        }
        decoder = torch.stack([set_.w_dec[layer][target] for target in range(layer, layers)], 1)
        safetensors.save_file(encoder, str(folder / f"W_enc_{layer}.safetensors"))
        safetensors.save_file({f"W_dec_{layer}": decoder.contiguous()}, str(folder / f"W_dec_{layer}.safetensors"))
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "hook_resid_mid"}
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "feature_output_hook": "hook_mlp_out"}))
    return folder


def test_the_commands_follow_a_cross_layer_sets_steps(tmp_path, capsys):
    """``attribute`` and ``graph`` with a cross-layer set in circuit-tracer's files: the paths through
    its steps counted, the graph's rows exact."""
    folder = write_circuit_tracer_clt(tmp_path / "clt")
    argv = ["attribute", "--model", "gpt2_4l", "--example", "--transcoders", str(folder), "--top", "3"]
    code, printed, errors = run([*argv, "--max-length", "2"], capsys)
    assert code == 0, errors
    assert "through at most 2 steps" in printed and "L2 transcoder bias" in printed
    value, own = printed.split(" = ")[1].split(" (the model's own: ")
    assert value == own.split(")")[0]  # the paths' sum, printed as the model's own logit
    out = tmp_path / "out"
    code, printed, errors = run(["graph", "--model", "gpt2_4l", "--example", "--transcoders", str(folder),
                                 "--out", str(out), "--top", "3"], capsys)  # fmt: skip
    assert code == 0, errors
    assert float(printed.split("its node's value (to ")[1].split(")")[0]) < 1e-10
    assert json.loads((out / "graph.json").read_text())["nodes"]
