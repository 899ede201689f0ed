"""The layering DESIGN.md promises: model files speak math and logical names only (parallelism is
injected into them), no module imports another's private names, and each module imports only
modules above it in data-flow order."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "parallax"

# DESIGN.md's data-flow order (modules not built yet are simply absent).
ORDER = [
    "config", "parallelism", "distributed", "logical", "mesh", "sharding", "layers", "attention", "fp8", "moe",
    "expert_parallel", "model", "pipeline", "pipeline_1f1b", "optim", "train_state", "data", "train_step", "build",
    "checkpoint", "metrics", "loop", "cost", "audit", "presets", "plan", "cli", "__main__",
]
# Single-device math: what they import, even through other modules and inside functions, must
# not reach the modules that know the mesh, and they never name a mesh axis.
MODEL_FILES = ["layers", "attention", "moe", "fp8", "model", "logical"]
PARALLEL_FILES = {"mesh", "sharding", "expert_parallel", "pipeline", "pipeline_1f1b"}
MESH_AXES = ("data", "tensor", "pipe", "expert")


def _modules(package: Path = PACKAGE) -> list[str]:
    return sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")


def _tree(package: Path, name: str) -> ast.Module:
    return ast.parse((package / f"{name}.py").read_text())


def _imported(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(parallax module, names taken from it) for every import anywhere in the file, functions
    included. `import parallax.x` takes no names; `from parallax import x` takes module x."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: inside the package
                module = f"parallax.{module}" if module else "parallax"
            if module == "parallax":
                found += [(a.name, []) for a in node.names]
            elif module.startswith("parallax."):
                found.append((module.split(".")[1], [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".")[1], []) for a in node.names if a.name.startswith("parallax.")]
    return found


def _parallax_imports(package: Path, name: str) -> set[str]:
    return {module for module, _ in _imported(_tree(package, name))}


def _reached(package: Path, name: str) -> dict[str, list[str]]:
    """Every parallax module `name` reaches through imports -> one import path to it."""
    paths, todo = {name: [name]}, [name]
    while todo:
        here = todo.pop()
        if not (package / f"{here}.py").exists():
            continue
        for dep in sorted(_parallax_imports(package, here)):
            if dep not in paths:
                paths[dep] = paths[here] + [dep]
                todo.append(dep)
    del paths[name]
    return paths


def _model_violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for name in MODEL_FILES:
        if not (package / f"{name}.py").exists():
            continue
        for dep, path in _reached(package, name).items():
            if dep in PARALLEL_FILES:
                bad.append(f"parallax/{name}.py reaches parallax.{dep}: {' -> '.join(path)}")
        for node in ast.walk(_tree(package, name)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MESH_AXES:
                bad.append(f"parallax/{name}.py names mesh axis {node.value!r} (line {node.lineno})")
    return bad


def _private_imports(package: Path = PACKAGE) -> list[str]:
    """Underscore names one parallax module takes from another, by import or as an attribute of
    an imported module (`import parallax.x as m; m._y`)."""
    bad = []
    for name in _modules(package):
        tree = _tree(package, name)
        for module, names in _imported(tree):
            bad += [f"parallax/{name}.py imports parallax.{module}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("parallax.")})
            elif isinstance(node, ast.ImportFrom) and node.module == "parallax":
                aliases.update({a.asname or a.name: f"parallax.{a.name}" for a in node.names})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"parallax/{name}.py uses {aliases[node.value.id]}.{node.attr}")
    return bad


def test_every_module_has_a_place_in_the_order():
    assert set(_modules()) <= set(ORDER), set(_modules()) - set(ORDER)


def test_modules_import_only_modules_above_them():
    for name in _modules():
        for dep in _parallax_imports(PACKAGE, name):
            assert ORDER.index(dep) < ORDER.index(name), f"parallax/{name}.py imports parallax.{dep}"


def test_model_files_reach_no_parallelism_and_name_no_mesh_axis():
    assert _model_violations() == []


def test_no_module_imports_another_modules_private_names():
    assert _private_imports() == []


def test_modules_stay_readable():
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path


def test_the_checkers_catch_violations(tmp_path):
    # A model file that reaches the mesh only through a helper imported inside a function, names
    # an axis, and takes a private name; the helper reaches sharding through `from parallax import`.
    (tmp_path / "layers.py").write_text(
        "def f():\n    from parallax.helper import g\n    return g\n\nAXIS = 'tensor'\n"
    )
    (tmp_path / "helper.py").write_text("from parallax import sharding\nfrom parallax.layers import _hidden\n")
    (tmp_path / "sharding.py").write_text("import parallax.mesh as m\nx = m._AXES\n")
    (tmp_path / "mesh.py").write_text("")
    assert _parallax_imports(tmp_path, "layers") == {"helper"}
    assert set(_reached(tmp_path, "layers")) == {"helper", "sharding", "mesh"}
    found = _model_violations(tmp_path)
    assert any("reaches parallax.sharding: layers -> helper -> sharding" in v for v in found), found
    assert any("reaches parallax.mesh" in v for v in found), found
    assert any("names mesh axis 'tensor'" in v for v in found), found
    assert sorted(_private_imports(tmp_path)) == [
        "parallax/helper.py imports parallax.layers._hidden", "parallax/sharding.py uses parallax.mesh._AXES"]
