"""Design section 2: lower layers never import higher ones (checked statically over every module)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tandem"
ALLOWED = {
    "core": set(),
    "weights": {"core"},
    "sandbox": {"core"},
    "model": {"core"},
    "env": {"core", "sandbox"},
    "engine": {"core", "model", "weights"},
    "train": {"core", "model", "weights"},
    "rollout": {"core", "env", "engine"},
    "orchestrator": {"core", "weights", "sandbox", "model", "env", "engine", "train", "rollout"},
    "cli": None,  # may import everything
    "bench": None,
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for n in names:
            parts = n.split(".")
            if parts[0] == "tandem" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_package_imports_a_higher_layer():
    violations = []
    for package, allowed in ALLOWED.items():
        if allowed is None:
            continue
        for path in sorted((SRC / package).rglob("*.py")):
            for dep in imported_packages(path) - allowed - {package}:
                violations.append(f"{path.relative_to(SRC)} imports tandem.{dep}")
    assert not violations, "\n".join(violations)
