"""``--set KEY=VALUE``: dotted keys into the run config, typed by its schema, checked like the
file, and the effective config is what a run stores (and what ``--resume`` compares)."""

import json

import pytest

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend.config_overrides import load_config, parse_overrides, resume_config
from fedsim.frontend.experiment import load_run_config

CONFIG = """
name = "tiny"
seed = 3
rounds = 2

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch-size = 16
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = 5

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 1.0

[engine]
backend = "local"
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    return path


def test_values_are_typed_by_the_schema(config_file):
    config = load_config(
        config_file,
        parse_overrides(
            [
                "strategy.options.noise_multiplier=1.2",  # a free table: TOML's float
                "seed=4",
                "strategy.sampling=poisson",  # a bare word for a choice of strings
                "name=2024",  # a string key keeps the text, not the integer
                "model.hidden=[32, 16]",
                "privacy.metrics_in_clear=true",
                "client.batch_size=8",  # written over the file's batch-size
                "strategy.options.kind=banded",  # a new option, as written
            ]
        ),
    )
    assert config.strategy.options == {
        "clipping_norm": 1.0,
        "noise_multiplier": 1.2,
        "kind": "banded",
    }
    assert isinstance(config.strategy.options["noise_multiplier"], float)
    assert config.seed == 4 and config.data.seed == 4 and config.client.seed == 4
    assert config.strategy.sampling == "poisson" and config.name == "2024"
    assert config.model.hidden == (32, 16) and config.privacy.metrics_in_clear is True
    assert config.client.batch_size == 8


@pytest.mark.parametrize(
    ("token", "needles"),
    [
        # an unknown key: named, with the keys of its table
        ("strategy.clients_per_rnd=3", ["strategy.clients_per_rnd", "clients_per_round, name"]),
        ("nosuch=1", ["nosuch", "checkpoint_every", "strategy"]),
        # a wrong type: key, value and the type
        (
            "strategy.clients_per_round=abc",
            ["--set strategy.clients_per_round", "'abc'", "integer"],
        ),
        ("data.alpha=[1, 2]", ["--set data.alpha", "[1, 2]", "number"]),
        ("privacy.metrics_in_clear=1", ["--set privacy.metrics_in_clear", "1", "true or false"]),
        ("model.kind=lstm", ["--set model.kind", "'lstm'", "'logreg'"]),
        # a list key given one value: what it allows in words, and how one item is written
        ("model.channels=4", ["--set model.channels", "4", "a list of integers", "[4]"]),
        ("model.hidden=x", ["--set model.hidden", "'x'", "a list of integers"]),
        # a range checked with the whole config, still under the flag
        ("strategy.clients_per_round=50", ["--set strategy.clients_per_round", "50", "20"]),
        ("rounds=0", ["--set rounds", "0", ">= 1"]),
        # a value is no table; a token without '='
        ("rounds.x=1", ["rounds.x", "rounds is a value, not a table"]),
        ("seed", ["--set", "'seed'", "key=value"]),
    ],
)
def test_bad_overrides_name_the_key_value_and_what_is_allowed(config_file, token, needles):
    with pytest.raises(ConfigError) as err:
        load_config(config_file, parse_overrides([token]))
    assert str(err.value).startswith("--set")
    for needle in needles:
        assert needle in str(err.value)


def test_the_same_key_twice_is_refused(config_file):
    with pytest.raises(ConfigError, match="already set by --set client.batch-size=4"):
        parse_overrides(["client.batch-size=4", "client.batch_size=8"])


def test_the_effective_config_is_stored_and_resume_compares_it(tmp_path, config_file, capsys):
    out = tmp_path / "run"
    sets = ["--set", "seed=4", "--set", "strategy.clients_per_round=6"]
    assert main(["run", str(config_file), "--out", str(out), "--no-progress", *sets]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert stored["seed"] == 4 and stored["data"]["seed"] == 4
    assert stored["strategy"]["clients_per_round"] == 6
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert records[1]["train"]["clients"] == 6  # the run ran the overridden config
    # the same overrides are the stored config; another value is refused, naming the key
    saved = load_run_config(out, resume_config(out, config_file, parse_overrides(sets[1::2])))
    assert saved.seed == 4
    assert load_run_config(out, resume_config(out, None, parse_overrides(["seed=4"]))).seed == 4
    capsys.readouterr()
    code = main(["run", "--resume", str(out), "--no-progress", "--set", "seed=5"])
    assert code == 2
    assert "these keys differ: seed" in capsys.readouterr().err
    code = main(["run", str(config_file), "--resume", str(out), "--no-progress", "--set", "seed=4"])
    assert code == 2  # the file gives clients_per_round 5, the run stored 6
    assert "these keys differ: strategy.clients_per_round" in capsys.readouterr().err


def test_a_list_key_given_one_value_is_told_in_words(config_file):
    """``--set model.channels=4`` once said ``a list of tuple``: the error names the items
    in words and shows the one-item list, with no Python type name in it."""
    with pytest.raises(ConfigError) as err:
        load_config(config_file, parse_overrides(["model.channels=4"]))
    message = str(err.value)
    assert "tuple" not in message and "int" not in message.replace("integers", "")
    assert message.endswith("a list of integers, in brackets (one item is written [4])")
