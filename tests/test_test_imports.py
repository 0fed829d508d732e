"""The test tree imports its helpers as the `tests` package, so no installed distribution can shadow them
(PyPI's `kernels`, pulled in by transformers 5, once replaced tests/kernels and broke collection)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.check_scripts import ROOT

TESTS = ROOT / "tests"
SOURCES = sorted(TESTS.rglob("*.py"))
# Top-level names that exist inside tests/ (modules and folders): importing one bare would find whatever
# sys.path offers first, maybe an installed package of that name.
LOCAL_NAMES = {p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()}


def _imported_modules(source: str) -> list[tuple[int, str]]:
    """Every absolute module name imported anywhere in the source, also inside functions and in string
    literals that hold a script for `python -c`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            with contextlib.suppress(SyntaxError):
                found += [(node.lineno, module) for _, module in _imported_modules(node.value)]
    return found


def test_the_tests_package_is_this_tree() -> None:
    import tests

    assert Path(tests.__file__).resolve() == TESTS / "__init__.py"
    for folder in (p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("*.py"))):
        assert (folder / "__init__.py").is_file(), f"{folder.name}/ is not a package of tests/"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_helper_imports_resolve_inside_tests(path: Path) -> None:
    """No bare import of a name that lives in tests/, and every `tests.…` import resolves to a file there."""
    for line, module in _imported_modules(path.read_text()):
        top = module.split(".")[0]
        if top == "tests":
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin is not None, f"{path.name}:{line}: {module} not found"
            assert Path(spec.origin).resolve().is_relative_to(TESTS), f"{path.name}:{line}: {module} -> {spec.origin}"
        else:
            assert top not in LOCAL_NAMES or (top == "sharding" and _is_project_package(top)), (
                f"{path.name}:{line}: bare `import {module}` names something in tests/; import it as tests.{module}"
            )


def _is_project_package(name: str) -> bool:
    """`sharding` is both the project's package and tests/sharding/; the bare name must mean the project's."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve() == ROOT / name / "__init__.py"


def test_collection_survives_installed_packages_named_like_test_folders(tmp_path: Path) -> None:
    """Installed distributions called `kernels` and `tests` (both exist on PyPI) sit on the path ahead of
    site-packages; the kernel tests still collect, from this tree."""
    for name in ("kernels", "tests"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the installed {name} was imported')\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
        + ["tests/kernels/test_paged_attention.py", "tests/kernels/test_cpu_paged_attention.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "installed" not in done.stdout
