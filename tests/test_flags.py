"""The command line, parsed once (finetune/flags.py): both scripts take the same shared flags with the same defaults,
each piece holds what its modules read, --config FILE replays a recipe or a run under the flags given, and what is
wrong with a file is one line."""

import dataclasses
import json
import os

import pytest
from helpers import base_args, load_script, results

from finetune import flags

pytestmark = pytest.mark.quick  # in process: `make test-quick`

single, zero_script = load_script("single-gpu.py"), load_script("zero-optimization.py")
classifier = load_script("sequence_classification.py")


def actions(script):
    """{flag: (dest, default, choices, nargs, type)} of a script's parser (caught as parse_args builds it)."""
    caught = []
    original = flags.parse
    flags.parse = lambda p, argv=None, **kwargs: caught.append(p) or original(p, argv, **kwargs)
    try:
        script.parse_args([])
    finally:
        flags.parse = original
    return {
        a.option_strings[0]: (a.dest, a.default, a.choices, a.nargs, a.type)
        for a in caught[0]._actions
        if a.option_strings
    }


def test_both_scripts_take_the_shared_flags_with_the_same_defaults():
    """Each flag written once, as a field of its piece: both scripts build their parsers from the pieces, the same
    flags with the same defaults, and every flag lands in exactly one piece."""
    one, other = actions(single), actions(zero_script)
    assert set(one) <= set(other)
    different = {flag for flag in one if one[flag] != other[flag]}
    assert different == {"--output-dir"}, different  # out/single-gpu, out/zero
    assert set(other) - set(one) == {
        "--deepspeed",
        "--zero-stage",
        "--offload",
        "--nvme-path",
        "--dist-timeout",
        "--sequence-parallel",
        "--mends",
        "--local_rank",
    }
    config = zero_script.parse_args([])
    fields = [f.name for piece in config.pieces() for f in dataclasses.fields(piece)]
    dests = {dest for dest, *_ in other.values()} - {"help", "local_rank"}
    assert sorted(fields) == sorted(dests)  # each once: --seed is the training's alone
    for piece in config.pieces():  # the parsed values are the fields' defaults (but the script's own output folder)
        for field in dataclasses.fields(piece):
            # (the script's own output folder; the data's cache where $DATA_CACHE says, read as the piece is made)
            expected = {"output_dir": "out/zero", "cache_dir": os.environ["DATA_CACHE"]}.get(field.name, field.default)
            assert getattr(piece, field.name) == expected, field.name
    assert single.parse_args([]).zero is None and config.sequence_parallel == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.lr = 1.0  # a resolved value is a new Config (Config.resolved), never written into this one
    resolved = config.resolved(lr=2e-5, seed=7, precision="bf16")
    assert (resolved.train.lr, resolved.train.seed, resolved.model.precision) == (2e-5, 7, "bf16")
    assert config.train.lr is None and config.model.precision == "auto"


def test_a_recipe_file_sets_the_defaults_and_the_command_line_wins(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 3.0e-4\nbatch-size: 4\npacking: none\nreport_to: [tensorboard]\nzero_stage: 2\n")
    config = single.parse_args(["--config", str(recipe), "--batch-size", "2"])
    assert (config.train.lr, config.train.batch_size, config.data.packing, config.run.report_to) == (
        3e-4,
        2,
        "none",
        ("tensorboard",),
    )  # zero_stage: zero-optimization.py's, left to it
    assert zero_script.parse_args(["--config", str(recipe)]).zero.zero_stage == 2
    for text, said in [
        ("lr: 1e-4\nbatch_sise: 4\n", "batch_sise is not a flag of this script"),
        ("packing: loose\n", "packing 'loose' is not one of isolated, stream, none"),
        ("- lr\n", "holds no mapping of flag names to values"),
        ("lr: [1\n", "not YAML"),
    ]:
        recipe.write_text(text)
        with pytest.raises(SystemExit, match=f"^error: --config {recipe}: .*{said}"):
            single.parse_args(["--config", str(recipe)])
    with pytest.raises(SystemExit, match="^error: --config .*nope.json: "):
        single.parse_args(["--config", str(tmp_path / "nope.json")])


def test_a_run_replayed_from_its_run_json_trains_the_same(tiny, tmp_path):
    """run.json keeps the run's flags as they ran (the precision and the learning rate resolved): --config replays
    them into another folder (how the run was started: --resume, --overwrite, is not replayed) to the same losses."""
    first = tmp_path / "first"
    single.main(base_args(tiny, first, **{"--max-steps": 3, "--save-every": 3, "--lr": None, "--seed": 3}))
    record = json.loads((first / "checkpoints" / "step-3" / "run.json").read_text())
    assert record["args"]["lr"] == 5e-5 and record["args"]["precision"] == "fp32" and record["args"]["seed"] == 3
    again = tmp_path / "again"
    single.main(["--config", str(first / "checkpoints" / "step-3" / "run.json"), "--output-dir", str(again)])
    assert results(again)["losses"] == results(first)["losses"] and len(results(first)["losses"]) == 3
    replayed = json.loads((again / "checkpoints" / "step-3" / "run.json").read_text())["args"]
    assert {k: v for k, v in replayed.items() if k not in ("output_dir", "config")} == {
        k: v for k, v in record["args"].items() if k not in ("output_dir", "config")
    }


def test_the_classifier_takes_the_shared_pieces_with_its_own_defaults(tmp_path):
    """sequence_classification.py on the same contract: its flags are fields of the shared pieces (the same name, the
    same meaning, written once), its defaults its own; --config replays its run.json (what flat() keeps: its flags
    alone)."""
    taken = actions(classifier)
    fields = {f.name: piece for piece in flags.PIECES.values() for f in dataclasses.fields(piece)}
    assert {dest for dest, *_ in taken.values()} - {"help", "local_rank"} <= set(fields)
    shared = actions(single)
    for flag in set(taken) & set(shared) - {
        "--dataset",
        "--text-column",
        "--model",
        "--batch-size",
        "--lr",
        "--weight-decay",
        "--epochs",
        "--output-dir",
    }:
        assert taken[flag] == shared[flag], flag  # the rest as the causal scripts have it
    config = classifier.parse_args([])
    assert (config.data.dataset, config.model.model, config.classifier.label_column, config.zero.deepspeed) == (
        "imdb",
        "distilbert-base-uncased",
        "label",
        None,
    )
    assert classifier.parse_args(["--deepspeed"]).zero.deepspeed == zero_script.parse_args([]).zero.deepspeed
    recorded = tmp_path / "run.json"
    again = classifier.parse_args(["--lr", "3e-4", "--max-length", "96", "--report-to", "tensorboard"])
    recorded.write_text(json.dumps({"args": again.flat()}))
    assert set(again.flat()) == {dest for dest, *_ in taken.values()} - {"help", "local_rank"}
    assert classifier.parse_args(["--config", str(recorded)]).flat() == {**again.flat(), "config": str(recorded)}
