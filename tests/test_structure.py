"""The layering DESIGN.md promises: model files speak logical names only, and each module imports
only modules above it in data-flow order."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "parallax"

# DESIGN.md's data-flow order (modules not built yet are simply absent).
ORDER = [
    "config", "distributed", "mesh", "sharding", "layers", "attention", "fp8", "moe", "expert_parallel", "model",
    "pipeline", "pipeline_1f1b", "optim", "train_state", "data", "train_step", "checkpoint", "metrics", "cost", "audit", "presets", "plan",
    "train", "__main__",
]
MODEL_FILES = ["layers", "attention", "model", "moe", "fp8"]
MESH_AXES = ("data", "tensor", "pipe", "expert")


def _modules():
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _parallax_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parallax."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("parallax.")}
    return found


def test_every_module_has_a_place_in_the_order():
    assert set(_modules()) <= set(ORDER), set(_modules()) - set(ORDER)


def test_modules_import_only_modules_above_them():
    for name in _modules():
        for dep in _parallax_imports(PACKAGE / f"{name}.py"):
            assert ORDER.index(dep) < ORDER.index(name), f"parallax/{name}.py imports parallax.{dep}"


def test_no_mesh_axis_names_in_model_files():
    for name in MODEL_FILES:
        path = PACKAGE / f"{name}.py"
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in MESH_AXES, f"parallax/{name}.py names mesh axis {node.value!r}"
            if isinstance(node, ast.ImportFrom) and node.module == "parallax.mesh":
                raise AssertionError(f"parallax/{name}.py imports the mesh module")


def test_modules_stay_readable():
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from parallax.train import main\nx = 'tensor'\n")
    assert _parallax_imports(bad) == {"train"}
    assert any(isinstance(n, ast.Constant) and n.value == "tensor" for n in ast.walk(ast.parse(bad.read_text())))
