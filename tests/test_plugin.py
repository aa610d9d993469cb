"""Algorithm discovery through entry points, and registration with speculators."""

import sys

import pytest
from click.testing import CliRunner
from tiny import tiny_config

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.model.build import (
    SPECULATORS_REGISTRY_NAME,
    register_with_speculators,
)
from speculators_peagle_plugin.plugin import PEAGLE
from speculators_peagle_plugin.training.algorithm import discover_algorithms, load_algorithm


def test_a_third_party_algorithm_is_discovered_listed_and_loaded(third_party_algorithm):
    assert set(discover_algorithms()) >= {"peagle", "dummy"}
    assert load_algorithm("dummy").summary == "a third-party drafting algorithm (test)"
    assert load_algorithm("peagle") is PEAGLE
    result = CliRunner().invoke(main, ["algorithms"])
    assert result.exit_code == 0, result.output
    names = [line.split("\t")[0] for line in result.output.splitlines()]
    assert names == ["dummy", "peagle"]


def test_unknown_algorithm_names_the_installed_ones(third_party_algorithm):
    with pytest.raises(ValueError, match=r"Unknown algorithm 'nope'; installed: dummy, peagle\."):
        load_algorithm("nope")


def test_train_cli_refuses_an_unknown_algorithm(tmp_path):
    result = CliRunner().invoke(
        main,
        ["train", "--algorithm", "nope", "--verifier-name-or-path", str(tmp_path),
         "--data-path", str(tmp_path)],
    )
    assert result.exit_code == 1
    assert "Unknown algorithm 'nope'; installed:" in result.output


def test_registration_is_idempotent_and_leaves_speculators_peagle_first():
    from speculators.model import SpeculatorModel
    from speculators.models.peagle import PEagleDraftModel as SpeculatorsPEagle

    from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel

    assert register_with_speculators() == SPECULATORS_REGISTRY_NAME
    assert register_with_speculators() == SPECULATORS_REGISTRY_NAME
    registry = SpeculatorModel.registry
    assert registry[SPECULATORS_REGISTRY_NAME] is PEagleDraftModel
    assert registry["peagle"] is SpeculatorsPEagle
    # speculators' loader still resolves a "peagle" config to its own class (interop).
    chosen = SpeculatorModel.registered_model_class_from_config(tiny_config())
    assert chosen is SpeculatorsPEagle


def test_a_name_taken_by_another_class_is_refused():
    from speculators.model import SpeculatorModel

    register_with_speculators()
    original = SpeculatorModel.registry[SPECULATORS_REGISTRY_NAME]

    class Other:
        pass

    SpeculatorModel.registry[SPECULATORS_REGISTRY_NAME] = Other
    try:
        with pytest.raises(ValueError, match="another plugin claims this name"):
            register_with_speculators()
    finally:
        SpeculatorModel.registry[SPECULATORS_REGISTRY_NAME] = original


def test_importing_the_package_loads_nothing_heavy():
    import subprocess

    code = (
        "import sys, speculators_peagle_plugin;"
        "print('speculators' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_cli_starts_without_importing_vllm():
    """vLLM takes seconds to import: only the commands that start an engine may load it."""
    import subprocess

    code = (
        "import sys, speculators_peagle_plugin.cli, speculators_peagle_plugin.data;"
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
