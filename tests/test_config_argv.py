"""The inverse of the parser (``options.config_argv``): for every command, the command line
it writes for random valid settings, parsed back by the real click command, gives the same
config. The oracle is the parser itself."""

import random
from typing import get_args, get_origin

import pytest

from speculators_peagle_plugin import options
from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.settings import build, flatten, leaves
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.datagen.join import JoinConfig
from speculators_peagle_plugin.demo.demo_config import DemoConfig
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.options import config_argv
from speculators_peagle_plugin.serving.check import CheckConfig
from speculators_peagle_plugin.serving.export import ExportConfig
from speculators_peagle_plugin.training.train_config import TrainConfig

# Every command that parses a config: its config class and its required settings
# (``TARGET``: a directory with a config.json, made by the ``files`` fixture).
COMMANDS = {
    "generate-data": (DataGenConfig, {"target": "TARGET", "prompts": "humaneval", "output": "o"}),
    "join-data": (JoinConfig, {"parts": ("a", "b"), "output": "o"}),
    "train": (TrainConfig, {"verifier_name_or_path": "m", "data_path": "d"}),
    "check": (CheckConfig, {"checkpoint": "c"}),
    "export": (ExportConfig, {"checkpoint": "c", "output": "o"}),
    "eval": (EvalConfig, {"target": "TARGET"}),
    "demo": (DemoConfig, {}),
}
NOT_CONFIG_COMMANDS = {"algorithms", "selftest", "vllm"}
INTS = (0, 1, 2, 3, 5, 8, 64, 4096)
FLOATS = (0.0, 0.25, 0.5, 1.0, 1e-4, 2.5, 1 / 3, 3.0)


class _Parsed(BaseException):
    """Carries the config the command built out of the command (past its error handler)."""


def _load(name: str, values: dict):
    """The config ``name`` builds from these settings, as its command builds it."""
    cls = COMMANDS[name][0]
    return DemoConfig.from_command(None, values) if cls is DemoConfig else build(cls, values)


def _parse(name: str, argv: list[str], monkeypatch):
    """The config the real ``speculators-peagle NAME ARGV`` builds, stopped before it runs."""

    def stop(config):
        raise _Parsed(config)

    monkeypatch.setattr(options, "check_output_paths", stop)
    with pytest.raises(_Parsed) as parsed:
        main.main([name, *argv], standalone_mode=False)
    return parsed.value.args[0]


@pytest.fixture
def files(tmp_path) -> tuple[str, str]:
    """A file and a model directory, for the settings that must name existing ones."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}\n")
    (tmp_path / "c.yaml").write_text("{}\n")
    return str(tmp_path / "c.yaml"), str(tmp_path / "target")


def _candidate(leaf, rng: random.Random, files: tuple[str, str]):
    """A random value of the setting's type (not necessarily one its config accepts)."""
    meta, hint = leaf.field.metadata, leaf.hint
    args = get_args(hint)
    if type(None) in args:
        if rng.random() < 0.25:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if "choices" in meta:
        return rng.choice(meta["choices"])
    if hint is bool:
        return rng.random() < 0.5
    if hint is int:
        return rng.choice(INTS)
    if hint is float:
        return rng.choice(FLOATS)
    words = (
        f"w{rng.randrange(100)}",
        f"d{rng.randrange(9)}/x y",
        *files,
        "humaneval[0:3]",
        "org/name",
    )
    if get_origin(hint) is tuple:
        item = INTS if get_args(hint)[0] is int else words
        return tuple(rng.choice(item) for _ in range(rng.randint(1, 3)))
    return rng.choice(words)


def _required(name: str, files: tuple[str, str]) -> dict:
    return {k: files[1] if v == "TARGET" else v for k, v in COMMANDS[name][1].items()}


def _random_values(name: str, seed: int, files: tuple[str, str]) -> dict:
    """Settings of ``name``'s flags, each changed to a random value where its config
    accepts it (in a random order, so that settings checked together vary too)."""
    cls, values = COMMANDS[name][0], _required(name, files)
    rng = random.Random(seed)
    flagged = [leaf for leaf in leaves(cls) if leaf.has_flag]
    for leaf in rng.sample(flagged, len(flagged)):
        candidate = {**values, leaf.key: _candidate(leaf, rng, files)}
        try:
            _load(name, candidate)
        except ValueError:
            continue
        values = candidate
    return values


def test_every_command_that_parses_a_config_is_covered():
    assert set(main.commands) == set(COMMANDS) | NOT_CONFIG_COMMANDS


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", COMMANDS)
def test_argv_parsed_back_by_the_command_is_the_same_config(name, seed, files, monkeypatch):
    cls = COMMANDS[name][0]
    expected = _load(name, _random_values(name, seed, files))
    every = flatten(expected)  # every flag, defaults included
    argv = config_argv(cls, {leaf.key: every[leaf.key] for leaf in leaves(cls) if leaf.has_flag})
    assert _parse(name, argv, monkeypatch) == expected, argv


@pytest.mark.parametrize("name", COMMANDS)
def test_random_settings_leave_few_flags_at_their_defaults(name, files):
    """The round trip is tested on changed values, not on defaults alone."""
    cls = COMMANDS[name][0]
    defaults = flatten(_load(name, _required(name, files)))
    flagged = {leaf.key for leaf in leaves(cls) if leaf.has_flag} - set(COMMANDS[name][1])
    changed = set()
    for seed in range(4):
        values = flatten(_load(name, _random_values(name, seed, files)))
        changed |= {k for k in flagged if values[k] != defaults[k]}
    assert len(changed) >= len(flagged) * 3 // 4, sorted(flagged - changed)


def test_a_config_file_goes_first_and_values_keep_their_order():
    argv = config_argv(
        TrainConfig, {"seed": 3, "autocast": "none", "max_steps": None}, config_file="c.yaml"
    )
    assert argv == [
        "--config",
        "c.yaml",
        "--seed",
        "3",
        "--autocast",
        "none",
        "--max-steps",
        "none",
    ]


def test_switches_negations_and_lists():
    argv = config_argv(
        EvalConfig,
        {
            "enforce_eager": True,
            "baseline": False,
            "drafts": ("a", "b"),
            "concurrency": (1, 16),
            "in_process": False,
            "interleave": True,
        },
    )
    assert argv == [
        "--enforce-eager",
        "--no-baseline",
        "--draft",
        "a",
        "--draft",
        "b",
        "--concurrency",
        "1,16",
    ]
    assert config_argv(TrainConfig, {"fsdp": False, "save_best": None}) == ["--no-fsdp"]
    assert config_argv(CheckConfig, {"checkpoint": "c", "num_speculative_tokens": 4}) == [
        "c",
        "-k",
        "4",
    ]


@pytest.mark.parametrize(
    ("cls", "values", "match"),
    [
        (TrainConfig, {"num_depth": 3}, "'num_depth' is no flag of TrainConfig"),
        (EvalConfig, {"seed": 1}, "'seed' is no flag of EvalConfig"),  # a key only
        (EvalConfig, {"baseline": True, "enforce_eager": False}, None),
        (EvalConfig, {"in_process": None}, "in_process must be of type bool"),
        (TrainConfig, {"save_best": None, "no_resume_from_checkpoint": False}, None),
        (TrainConfig, {"run_name": "None"}, "--run-name reads 'None' as None"),
        (EvalConfig, {"prompt_sets": ()}, "--prompts cannot give prompt_sets"),
    ],
)
def test_what_a_command_line_cannot_say_is_refused(cls, values, match):
    if match is None:
        assert config_argv(cls, values) == []  # the defaults, left unsaid
        return
    with pytest.raises(ValueError, match=match):
        config_argv(cls, values)


def test_values_are_read_as_a_config_file_gives_them(tmp_path):
    """A list for a tuple (as ``record.json`` holds settings), a path for a string."""
    argv = config_argv(EvalConfig, {"ks": [4], "concurrency": [1, 16], "output_dir": tmp_path})
    assert argv == ["-k", "4", "--concurrency", "1,16", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="max_new_tokens must be of type int"):
        config_argv(EvalConfig, {"max_new_tokens": [4]})
