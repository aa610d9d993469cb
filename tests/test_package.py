"""Package surface: top-level seed API, the entry point, the console script."""

import ast
import importlib
import inspect
import re
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from click.testing import CliRunner

import speculators_peagle_plugin
from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.plugin import PEAGLE

# The seed API (NeMo AutoModel's peagle_* modules): where each name lives here, and the
# arguments the seed gives it, in order (ours may add keyword arguments after them).
SEED_API = {
    "speculators_peagle_plugin.core.peagle_data": {
        "generate_cod_sample_indices": ["seq_length", "loss_mask", "num_depths",
                                        "down_sample_ratio", "down_sample_ratio_min"],
        "assign_cod_segments": ["anchor_pos", "depth", "seq_length", "num_segments"],
    },
    "speculators_peagle_plugin.core.peagle_attention": {
        "create_peagle_mask_mod": ["anchor_pos", "depth", "lengths", "total_seq_len"],
    },
    "speculators_peagle_plugin.kernels.flex": {
        "_peagle_compile_supported": ["q", "k", "v"],
        "_peagle_flex_attention": ["q", "k", "v", "block_mask", "scale"],
        "_peagle_flex_attention_compiled": None,
        "_peagle_flex_attention_compile_failed": None,
        "logger": None,
    },
    "speculators_peagle_plugin.model.peagle_draft": {
        "_PeagleAttentionMixin.forward_peagle": ["combined_states", "position_ids", "block_mask"],
        "_PeagleDecoderLayerMixin.forward_peagle": ["input_embeds", "hidden_states",
                                                    "position_ids", "block_mask"],
        "_PeagleVanillaLayerMixin.forward_peagle": ["hidden_states", "position_ids",
                                                    "block_mask"],
        "_PeagleDraftMixin._init_peagle_parameters": ["config"],
        "_PeagleDraftMixin._run_draft_layer": ["layer_fn", "args", "kwargs"],
        "_PeagleDraftMixin.build_peagle_block_mask": ["anchor_pos", "depth", "lengths",
                                                      "total_seq_len"],
        "_PeagleDraftMixin.forward_peagle": ["sampled_input_ids", "sampled_projected_hidden",
                                             "position_ids", "block_mask"],
        "_PeagleDraftMixin.masked_projected_hidden": [],
    },
    "speculators_peagle_plugin.training.peagle_trainer": {
        "PEagleTrainerModule": ["draft_model", "selected_token_ids", "selected_token_mask",
                                "num_depths", "mask_token_id", "down_sample_ratio",
                                "down_sample_ratio_min", "sequence_partitions"],
        "PEagleTrainerModule.forward": ["input_ids", "attention_mask", "loss_mask",
                                        "aux_hidden_states", "target_logits", "peagle_segment"],
        "PEagleTrainerModule.build_peagle_plan": ["loss_mask"],
        "PEagleTrainerModule._forward_peagle_segment": ["input_ids", "attention_mask",
                                                        "aux_hidden_states", "target_logits",
                                                        "peagle_segment"],
        "PEagleTrainerModule._peagle_position_loss": ["input_ids_row", "aux_row",
                                                      "target_logits_row", "anchor_pos", "depth",
                                                      "orig_positions", "loss_positions",
                                                      "row_length", "seq_len"],
        "_PeaglePlan": ["units", "total_den"],
        "_kl_div_loss": ["logits", "target_logits"],
    },
}


@pytest.mark.parametrize("module", sorted(SEED_API))
def test_seed_names_keep_their_modules_and_arguments(module):
    mod = importlib.import_module(module)
    for name, args in SEED_API[module].items():
        obj = mod
        for part in name.split("."):
            obj = getattr(obj, part)
        if args is not None:
            params = [p for p in inspect.signature(obj).parameters if p != "self"]
            assert params[: len(args)] == args, name


def test_seed_functions_import_from_the_top_level():
    import speculators_peagle_plugin as top

    for name in ("generate_cod_sample_indices", "assign_cod_segments", "create_peagle_mask_mod"):
        assert getattr(top, name) is getattr(
            importlib.import_module(
                "speculators_peagle_plugin.core."
                + ("peagle_attention" if name == "create_peagle_mask_mod" else "peagle_data")
            ),
            name,
        )


def test_seed_api_re_exports_every_seed_name_from_its_owner(monkeypatch):
    from speculators_peagle_plugin import seed_api
    from speculators_peagle_plugin.kernels import flex

    pairs = {
        (f"speculators_peagle_plugin.{owner}", name)
        for names in seed_api.SEED_NAMES.values()
        for name, owner in names.items()
    }
    # the same names (a method's class), in the same modules, as SEED_API above
    assert pairs == {
        (module, name.split(".")[0]) for module, names in SEED_API.items() for name in names
    }
    for module, name in pairs:
        assert getattr(seed_api, name) is getattr(importlib.import_module(module), name), name
    assert {name for _, name in pairs} <= set(dir(seed_api))
    monkeypatch.setattr(flex, "_peagle_flex_attention_compile_failed", True)
    assert seed_api._peagle_flex_attention_compile_failed is True  # the flag's current value
    with pytest.raises(AttributeError):
        seed_api.not_a_seed_name  # noqa: B018


def test_all_lists_public_names_only():
    """A private name the seeds list is re-exported by ``seed_api``, not by an ``__all__``."""
    package = Path(speculators_peagle_plugin.__file__).parent
    private = []
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names = ast.literal_eval(node.value)
                private += [f"{path.relative_to(package)}: {n}" for n in names if n.startswith("_")]
    assert not private, private


# Layers a layer never imports though they sit below it: training needs no engine and no
# serving (the model card it writes into each checkpoint is model/'s).
SKIPPED_LAYERS = {"training": {"engine", "serving"}}


def test_layers_import_only_downward():
    """A module of a layer imports only from the layers below it (docs/api.md), and never
    from the layers ``SKIPPED_LAYERS`` names for it."""
    level = {"common": 0, "core": 1, "kernels": 2, "model": 3, "engine": 4, "serving": 4,
             "data": 4, "datagen": 5, "training": 6, "evaluation": 6, "selftest": 7,
             "demo": 7}
    package = Path(speculators_peagle_plugin.__file__).parent
    wrong = []
    for path in package.rglob("*.py"):
        layer = path.relative_to(package).parts[0]
        if layer not in level:
            continue  # cli.py, plugin.py, seed_api.py, __init__.py sit on top
        text = path.read_text()
        for used in re.findall(r"from (?:\.\.|speculators_peagle_plugin\.)(\w+)", text):
            upward = used != layer and level.get(used, -1) >= level[layer]
            if used in ("cli", "plugin") or upward or used in SKIPPED_LAYERS.get(layer, ()):
                wrong.append(f"{path.relative_to(package)} imports {used}")
    assert not wrong, wrong


def _imports(package: Path) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, every import counted: at the top,
    inside a function, under ``TYPE_CHECKING``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        used = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                used |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                source = ".".join(base + (node.module.split(".") if node.module else []))
                for alias in node.names:  # a submodule imported by name, else its package
                    found = f"{source}.{alias.name}"
                    used.add(found if found in modules else source)
        graph[name] = (used & modules.keys()) - {name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """No import circle among the package's modules, however far round, ``TYPE_CHECKING``
    and function-level imports included: each module reads without the ones above it."""
    graph = _imports(Path(speculators_peagle_plugin.__file__).parent)
    circles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        for used in sorted(graph[name]):
            if used in path:
                circles.append(" -> ".join(path[path.index(used):] + [used]))
            elif used not in done:
                visit(used, [*path, used])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not circles, circles


def test_every_subpackage_docstring_names_its_modules():
    """Each subpackage has a docstring, and it names every module of the subpackage."""
    package = Path(speculators_peagle_plugin.__file__).parent
    unnamed = []
    for init in package.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = {name for pair in re.findall(r"``(\w+)``|:mod:`\.(\w+)`", doc) for name in pair}
        for module in init.parent.glob("*.py"):
            if module.stem not in ("__init__", "__main__") and module.stem not in named:
                unnamed.append(f"{init.parent.name}/{module.name}")
    assert not unnamed, unnamed


def test_a_module_over_400_lines_warns_and_one_over_450_fails():
    """Every Python module of the tree (package, eval, tools, tests) reads in one sitting: past 400
    lines a warning says to split it on a seam; past 450 it fails."""
    repo = Path(__file__).resolve().parents[1]
    sizes = {str(p.relative_to(repo)): len(p.read_text().splitlines())
             for top in ("speculators_peagle_plugin", "eval", "tools", "tests")
             for p in (repo / top).rglob("*.py")}
    assert len(sizes) > 100 and max(sizes.values()) > 200  # the tree was read
    for name, n in sorted(sizes.items()):
        if n > 400:
            warnings.warn(f"{name} has {n} lines (over 400): split it on a seam", stacklevel=1)
    assert not [f"{name}: {n}" for name, n in sizes.items() if n > 450]


def _function_lengths(package: Path) -> dict[str, int]:
    """Every function's lines, ``def`` to its last line (decorators aside), by name."""
    lengths = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{path.relative_to(package)}:{node.lineno} {node.name}"
                lengths[name] = node.end_lineno - node.lineno + 1
    return lengths


def test_no_function_is_over_80_lines_and_at_most_12_are_over_60():
    """A long function is cut on its seams: none over 80 lines in the package, and at most
    12 over 60."""
    lengths = _function_lengths(Path(speculators_peagle_plugin.__file__).parent)
    (cod,) = [n for name, n in lengths.items() if name.endswith(" generate_cod_sample_indices")]
    assert cod > 50  # counted whole: its signature, docstring and body
    assert not {name: n for name, n in lengths.items() if n > 80}
    over_60 = sorted((n, name) for name, n in lengths.items() if n > 60)
    assert len(over_60) <= 12, over_60


def test_entry_point_resolves_to_the_algorithm_object():
    (ep,) = [e for e in entry_points(group="speculators.algorithms") if e.name == "peagle"]
    algo = ep.load()
    assert algo is PEAGLE and algo.name == "peagle"


def test_cli_lists_installed_algorithms():
    result = CliRunner().invoke(main, ["algorithms"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("peagle\t")
