"""klppo.algorithms is pure tensor math: no process groups, no models, no config (ARCHITECTURE.md)."""

import ast
from pathlib import Path

import klppo.algorithms

FORBIDDEN = ("torch.distributed", "transformers", "klppo.config")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # from torch import distributed
    return names


def test_algorithms_import_no_distributed_models_or_config() -> None:
    files = sorted(Path(klppo.algorithms.__file__).parent.rglob("*.py"))
    assert len(files) >= 5
    for path in files:
        for name in _imports(path):
            bad = [f for f in FORBIDDEN if name == f or name.startswith(f + ".")]
            assert not bad, f"{path.name} imports {name}"
            if name.startswith("klppo.") or name == "klppo":
                assert name.startswith("klppo.algorithms"), (
                    f"{path.name} imports {name}: algorithms imports only itself"
                )
