"""Package surface: top-level seed API, the entry point, the console script."""

from importlib.metadata import entry_points

from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.plugin import PEAGLE


def test_seed_functions_import_from_the_top_level():
    pass


def test_entry_point_resolves_to_the_algorithm_object():
    (ep,) = [e for e in entry_points(group="speculators.algorithms") if e.name == "peagle"]
    algo = ep.load()
    assert algo is PEAGLE and algo.name == "peagle"


def test_cli_lists_installed_algorithms():
    result = CliRunner().invoke(main, ["algorithms"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("peagle\t")
