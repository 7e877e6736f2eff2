"""plan.py: the ZeRO memory arithmetic against figures computed by hand, and the recommendation."""
import pytest

import conftest  # noqa: F401  (puts the repo on sys.path)
import plan

GB = 1e9


def test_model_states_match_the_hand_computed_figures():
    states = plan.model_states(psi=1e9, largest=1e8, gpus_per_node=8, nodes=1)
    gpu = {option: g for option, (g, _) in states.items()}
    assert gpu["ZeRO-0"] == 16 * GB  # 2 + 2 + 12 bytes per parameter, all on every GPU
    assert gpu["ZeRO-1"] == 4 * GB + 12 * GB / 8  # the paper: optimizer state split 8 ways
    assert gpu["ZeRO-2"] == 2 * GB + 18 * GB / 8  # DeepSpeed: 16-bit weights whole, the rest split
    assert gpu["ZeRO-3"] == 4 * 1e8 + 18 * GB / 8  # the largest layer gathered, everything else split
    assert gpu["ZeRO-2 + CPU offload"] == 2 * GB  # only the 16-bit weights stay on the GPU
    assert gpu["ZeRO-3 + CPU offload"] == 4 * 1e8
    assert states["ZeRO-2 + CPU offload"][1] == 1e9 * 32 * 1.5  # max(4 x 8 GPUs, 16) bytes x 1.5 buffer
    assert states["ZeRO-3 + CPU offload"][1] == 1e9 * 18 * 1.5
    two_nodes = plan.model_states(psi=1e9, largest=1e8, gpus_per_node=8, nodes=2)
    assert two_nodes["ZeRO-1"][0] == 4 * GB + 12 * GB / 16


def test_activations_match_the_hand_computed_figures():
    # micro-batch 1, 1024 tokens, hidden 2048, 24 layers, vocab 50272 (OPT-1.3B)
    assert plan.activations(1, 1024, 2048, 24, 50272, False) == 34 * 1024 * 2048 * 24 + 10 * 1024 * 50272
    assert plan.activations(1, 1024, 2048, 24, 50272, True) == (2 * 1024 * 2048 * 24 + 34 * 1024 * 2048
                                                                + 10 * 1024 * 50272)


def test_parameter_counts_of_the_opt_shapes():
    assert plan.count_params(plan.load_config("facebook/opt-125m"))[0] == 125_239_296
    assert plan.count_params(plan.load_config("facebook/opt-1.3b"))[0] == 1_315_758_080


def test_recommends_the_fastest_option_that_fits(capsys):
    assert plan.main(["--model", "facebook/opt-1.3b", "--gpus", "8", "--gpu-memory", "80"]) == 0
    assert "recommended: ZeRO-0" in capsys.readouterr().out
    assert plan.main(["--model", "facebook/opt-6.7b", "--gpus", "1", "--gpu-memory", "80", "--batch-size", "4",
                      "--gradient-checkpointing"]) == 0
    assert "recommended: ZeRO-2 + CPU offload" in capsys.readouterr().out
    assert plan.main(["--model", "facebook/opt-6.7b", "--gpus", "1", "--gpu-memory", "80", "--cpu-memory", "64",
                      "--batch-size", "4", "--gradient-checkpointing"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_bad_input(tiny):
    with pytest.raises(SystemExit, match="error: --gpus must be positive"):
        plan.main(["--model", tiny["model"], "--gpus", "0", "--gpu-memory", "80"])
    with pytest.raises(SystemExit, match="error: cannot load a config for 'no-such/model'"):
        plan.main(["--model", "no-such/model", "--gpus", "1", "--gpu-memory", "80"])
