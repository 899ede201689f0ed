"""The layering DESIGN.md promises: model files speak math and logical names only (parallelism is
injected into them), no module imports another's private names, and each module imports only
modules above it in data-flow order, subpackage by subpackage.

Modules are named by their dotted path under `parallax` ('config', 'model.layers', ...)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "parallax"

# The data-flow order: the config and its rules, then the subpackages (model math, what runs over
# the mesh, a training run, reading a layout without running it), then the command line.
ORDER = [
    "config", "schedules", "parallelism",
    "model.logical", "model.layers", "model.vocab", "model.kernels", "model.attention", "model.fp8", "model.fp8_state", "model.moe", "model.transformer",
    "parallel.mesh", "parallel.targets", "parallel.sharding", "parallel.fused_attention", "parallel.expert_parallel", "parallel.pipeline", "parallel.pipeline_tables", "parallel.residuals", "parallel.split_backward", "parallel.stage_slices", "parallel.pipeline_1f1b",
    "train.distributed", "train.optim", "train.train_state",
    "train.tokenizer", "train.sources", "train.prepare", "train.data", "train.input", "train.train_step", "train.build",
    "train.checkpoint", "train.metrics", "train.tracker", "train.goodput", "train.profiler", "train.loop",
    "interop.hf_layout", "interop.hf", "infer.decode", "infer.sample", "infer.evaluate",
    "analysis.cost", "analysis.collectives", "analysis.hlo", "analysis.overlap", "analysis.gemms", "analysis.heap", "analysis.audit", "analysis.presets", "analysis.plan",
    "cli", "__main__",
]
SUBPACKAGES = ("model", "parallel", "train", "interop", "infer", "analysis")
# Single-device math: what they import, even through other modules and inside functions, must
# not reach the modules that know the mesh, and they never name a mesh axis.
PARALLEL = ("parallel.",)
MESH_AXES = ("data", "tensor", "pipe", "expert")


def _modules(package: Path = PACKAGE) -> list[str]:
    """Every module under `package` as a dotted name (package __init__ files excluded)."""
    return sorted(".".join(p.relative_to(package).with_suffix("").parts) for p in package.rglob("*.py")
                  if p.name != "__init__.py")


def _path(package: Path, name: str) -> Path:
    return package.joinpath(*name.split(".")).with_suffix(".py")


def _tree(package: Path, name: str) -> ast.Module:
    return ast.parse(_path(package, name).read_text())


def _imported(package: Path, tree: ast.Module, here: str = "") -> list[tuple[str, list[str]]]:
    """(parallax module, names taken from it) for every import anywhere in the file, functions
    included. `import parallax.a.b` takes no names; `from parallax.a import b` takes module a.b
    when that is a module, else names from a."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                base = here.split(".")[: max(len(here.split(".")) - node.level, 0)]
                module = ".".join(["parallax", *base] + ([module] if module else []))
            if module != "parallax" and not module.startswith("parallax."):
                continue
            inner = module.split(".", 1)[1] if "." in module else ""
            for a in node.names:
                sub = f"{inner}.{a.name}" if inner else a.name
                if _path(package, sub).exists() or (not inner and a.name in SUBPACKAGES) or sub in ORDER:
                    found.append((sub, []))  # a module imported by name
                else:
                    found.append((inner, [a.name]))
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".", 1)[1], []) for a in node.names if a.name.startswith("parallax.")]
    return [(m, names) for m, names in found if m and m not in SUBPACKAGES]


def _parallax_imports(package: Path, name: str) -> set[str]:
    return {module for module, _ in _imported(package, _tree(package, name), name)}


def _reached(package: Path, name: str) -> dict[str, list[str]]:
    """Every parallax module `name` reaches through imports -> one import path to it."""
    paths, todo = {name: [name]}, [name]
    while todo:
        here = todo.pop()
        if not _path(package, here).exists():
            continue
        for dep in sorted(_parallax_imports(package, here)):
            if dep not in paths:
                paths[dep] = paths[here] + [dep]
                todo.append(dep)
    del paths[name]
    return paths


def _model_violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for name in _modules(package):
        if not name.startswith("model."):
            continue
        for dep, path in _reached(package, name).items():
            if dep.startswith(PARALLEL):
                bad.append(f"parallax.{name} reaches parallax.{dep}: {' -> '.join(path)}")
        for node in ast.walk(_tree(package, name)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MESH_AXES:
                bad.append(f"parallax.{name} names mesh axis {node.value!r} (line {node.lineno})")
    return bad


def _private_imports(package: Path = PACKAGE) -> list[str]:
    """Underscore names one parallax module takes from another, by import or as an attribute of
    an imported module (`import parallax.x as m; m._y`)."""
    bad = []
    for name in _modules(package):
        tree = _tree(package, name)
        for module, names in _imported(package, tree, name):
            bad += [f"parallax.{name} imports parallax.{module}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("parallax.")})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallax"):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"parallax.{name} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def test_every_module_has_a_place_in_the_order():
    assert set(_modules()) <= set(ORDER), set(_modules()) - set(ORDER)


def test_the_order_keeps_each_subpackage_together():
    packages = [name.split(".")[0] for name in ORDER if "." in name]
    assert packages == sorted(packages, key=SUBPACKAGES.index)


def test_modules_import_only_modules_above_them():
    for name in _modules():
        for dep in _parallax_imports(PACKAGE, name):
            assert dep in ORDER, f"parallax.{name} imports parallax.{dep}, which is not a module"
            assert ORDER.index(dep) < ORDER.index(name), f"parallax.{name} imports parallax.{dep}"


def test_model_files_reach_no_parallelism_and_name_no_mesh_axis():
    assert _model_violations() == []


def test_no_module_imports_another_modules_private_names():
    assert _private_imports() == []


def test_modules_stay_readable():
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path


def test_the_checkers_catch_violations(tmp_path):
    # A model file that reaches the mesh only through a helper imported inside a function, names
    # an axis, and takes a private name; the helper reaches sharding through `from parallax.parallel import`.
    for sub in ("model", "parallel"):
        (tmp_path / sub).mkdir()
    (tmp_path / "model" / "layers.py").write_text(
        "def f():\n    from parallax.model.helper import g\n    return g\n\nAXIS = 'tensor'\n"
    )
    (tmp_path / "model" / "helper.py").write_text(
        "from parallax.parallel import sharding\nfrom parallax.model.layers import _hidden\n")
    (tmp_path / "parallel" / "sharding.py").write_text("import parallax.parallel.mesh as m\nx = m._AXES\n")
    (tmp_path / "parallel" / "mesh.py").write_text("")
    assert _parallax_imports(tmp_path, "model.layers") == {"model.helper"}
    assert set(_reached(tmp_path, "model.layers")) == {"model.helper", "parallel.sharding", "parallel.mesh"}
    found = _model_violations(tmp_path)
    assert any("reaches parallax.parallel.sharding: model.layers -> model.helper -> parallel.sharding" in v
               for v in found), found
    assert any("model.layers reaches parallax.parallel.mesh" in v for v in found), found
    assert any("names mesh axis 'tensor'" in v for v in found), found
    assert sorted(_private_imports(tmp_path)) == [
        "parallax.model.helper imports parallax.model.layers._hidden",
        "parallax.parallel.sharding uses parallax.parallel.mesh._AXES"]
