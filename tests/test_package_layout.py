"""The package's shape: no import cycle between mlcls modules (imports inside functions included), no module
over 450 lines, no folder holding more than 15 modules. Read from the source files with ``ast``; nothing is
imported."""

from __future__ import annotations

import ast
import re
from collections import Counter
from functools import cache
from pathlib import Path

import mlcls

PACKAGE_DIR = Path(mlcls.__file__).parent
MAX_MODULE_LINES = 450
MAX_FOLDER_MODULES = 15


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name (a package by its ``__init__.py``) -> file, for every ``.py`` outside configs/."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if "configs" in parts:
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


@cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the file ``path``, parsed once for every test of the module."""
    return ast.parse(path.read_text())


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The mlcls modules that module ``name`` (file ``path``) imports, its own packages left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    candidates = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            candidates += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; ``from module import name`` the module
            candidates += [f"{base}.{alias.name}" for alias in node.names] + [base]
    found = set()
    for candidate in candidates:
        while candidate and candidate not in modules:
            candidate = candidate.rpartition(".")[0]
        if candidate and candidate != name and not name.startswith(candidate + "."):
            found.add(candidate)
    return found


@cache
def mlcls_graph() -> dict[str, set[str]]:
    """mlcls's modules -> the mlcls modules each imports (read by the tests, never changed)."""
    files = module_files(PACKAGE_DIR)
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (module -> modules it imports) as ``[a, b, ..., a]``, or ``[]`` if none."""
    state: dict[str, str] = {}  # "open" while on the path of the search, "done" once all it reaches is
    for root in sorted(graph):
        if root in state:
            continue
        path, pending = [root], [iter(sorted(graph[root]))]
        state[root] = "open"
        while pending:
            successor = next(pending[-1], None)
            if successor is None:
                state[path.pop()] = "done"
                pending.pop()
            elif state.get(successor) == "open":
                return path[path.index(successor) :] + [successor]
            elif successor not in state:
                state[successor] = "open"
                path.append(successor)
                pending.append(iter(sorted(graph.get(successor, ()))))
    return []


def test_import_cycle_finds_a_cycle_and_only_a_cycle() -> None:
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_between_mlcls_modules() -> None:
    graph = mlcls_graph()
    assert graph["mlcls.data.loader"] >= {"mlcls.data.sampling", "mlcls.data.shards.loader"}  # read at all
    assert import_cycle(graph) == []


def test_no_module_over_450_lines() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_files(PACKAGE_DIR).items()}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_no_folder_over_15_modules() -> None:
    modules = [path for path in module_files(PACKAGE_DIR).values() if path.name != "__init__.py"]
    folders = Counter(path.parent for path in modules)
    assert {str(folder): n for folder, n in folders.items() if n > MAX_FOLDER_MODULES} == {}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` between modules folded onto mlcls's packages (``mlcls/<name>/``): package -> the other
    packages its modules import. Modules at the top (``mlcls.io``, ``mlcls.errors``, ...) belong to none."""
    packages = {path.name for path in PACKAGE_DIR.iterdir() if (path / "__init__.py").is_file()}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in packages else None

    folded: dict[str, set[str]] = {name: set() for name in packages}
    for module, imported in graph.items():
        for other in imported:
            a, b = package(module), package(other)
            if a and b and a != b:
                folded[a].add(b)
    return folded


def test_package_graph_folds_modules_onto_their_packages() -> None:
    graph = {"mlcls.engine.a": {"mlcls.data.b", "mlcls.io"}, "mlcls.data.b": {"mlcls.engine.c"}}
    folded = package_graph(graph)
    assert folded["engine"] == {"data"} and folded["data"] == {"engine"}
    assert import_cycle(folded) == ["data", "engine", "data"]


def test_no_two_packages_import_each_other() -> None:
    """The packages lean one way (cli on top; bench, reporting, inference above engine; engine above data,
    models, losses, metrics): no cycle between packages, which also rules out any pair importing each
    other."""
    folded = package_graph(mlcls_graph())
    assert folded["cli"] >= {"engine", "data"} and "cli" not in folded["engine"]  # read at all
    assert import_cycle(folded) == []


# Concerns that once had several homes (issue 36): each name is defined once in the whole package.
ONE_HOME = (
    "gpu_hours",
    "run_gpu_hours",
    "sweep_gpu_hours",
    "protocol_deviations",
    "flatten_config",
    "is_main",
)


def test_each_concern_is_defined_once() -> None:
    defined = Counter(
        node.name
        for path in module_files(PACKAGE_DIR).values()
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    )
    assert {name: defined[name] for name in ONE_HOME} == dict.fromkeys(ONE_HOME, 1)


# torch.distributed's collectives: called from mlcls/collectives.py only (plus the process group's set-up).
COLLECTIVES = {"all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list"}
COLLECTIVES |= {"gather", "barrier", "reduce_scatter", "all_to_all", "scatter"}


def test_collectives_have_one_home() -> None:
    callers = set()
    for name, path in module_files(PACKAGE_DIR).items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
                owner = ast.unparse(node.value)
                if owner in ("dist", "torch.distributed"):
                    callers.add(name)
    assert callers == {"mlcls.collectives"}


def test_every_test_the_package_cites_exists() -> None:
    """A ``test_*`` cited in the package's text (in double backquotes) is a test function or module of
    tests/ (old: data/shards/loader.py cited ``test_data_shard_loader``, which never existed)."""
    tests_dir = Path(__file__).parent
    defined = {path.stem for path in tests_dir.glob("test_*.py")}
    for path in tests_dir.glob("test_*.py"):  # the text, not the syntax tree: parsing 200 files takes seconds
        defined |= set(re.findall(r"^\s*def (test_\w+)\(", path.read_text(), re.MULTILINE))
    cited = {
        name
        for path in module_files(PACKAGE_DIR).values()
        for name in re.findall(r"``(test_\w+)``", path.read_text())
    }
    assert cited - defined == set()


def module_level_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The mlcls modules that running module ``name`` (file ``path``) imports: the imports of its body outside
    functions, classes and ``if TYPE_CHECKING:`` blocks, each with the packages above it (importing
    ``a.b.c`` runs ``a`` and ``a.b`` first), its own packages included."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(parsed(path).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            pending += node.orelse
        elif isinstance(node, ast.If | ast.Try | ast.With):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            if isinstance(node, ast.Try):
                pending += [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            base = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names] + [base]
            for candidate in names:
                while candidate and candidate not in modules:
                    candidate = candidate.rpartition(".")[0]
                while candidate.startswith("mlcls"):
                    found.add(candidate)
                    candidate = candidate.rpartition(".")[0]
    return found - {name}


def imported_on_import(root: str) -> set[str]:
    """Every mlcls module that ``import root`` runs: the packages above it and, from each module run, its
    module-level imports (:func:`module_level_imports`), transitively."""
    files = module_files(PACKAGE_DIR)
    parts = root.split(".")
    pending = [".".join(parts[: k + 1]) for k in range(len(parts))]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        pending += module_level_imports(name, files[name], set(files))
    return seen


def test_imported_on_import_follows_module_level_imports_only() -> None:
    ran = imported_on_import("mlcls.data.pipeline.dali")
    assert {"mlcls", "mlcls.data", "mlcls.data.pipeline", "mlcls.data.pipeline.fast"} <= ran  # packages too
    # mlcls.data imports the GPU pipeline inside build_backend_transform only, when data.backend=gpu
    assert "mlcls.data.pipeline.gpu" in data_imports()["mlcls.data.views"] | mlcls_graph()["mlcls.data"]
    assert "mlcls.data.pipeline.gpu" not in ran


def test_the_default_loader_imports_no_backend_of_its_own() -> None:
    """``import mlcls.data.loader`` (every training run) runs no module of the GPU-decoding, DALI or packed
    shards backends, nor the JPEG header reader only the GPU decoding needs: they are imported where their
    backend is chosen (issue 51; ``python -X importtime -c "import mlcls.data.loader"`` shows the same)."""
    backends = ("mlcls.data.pipeline.gpu", "mlcls.data.pipeline.dali", "mlcls.data.pipeline.jpeg")
    ran = imported_on_import("mlcls.data.loader")
    assert {
        name for name in ran if name.startswith(backends) or name.startswith("mlcls.data.shards")
    } == set()


def data_imports() -> dict[str, set[str]]:
    """mlcls.data's modules -> the mlcls.data modules each imports anywhere (in functions too), its own
    packages included, which the import graph leaves out."""
    files = module_files(PACKAGE_DIR)
    imports = {}
    for name, path in files.items():
        if not name.startswith("mlcls.data."):
            continue
        found = set()
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                candidates = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in files:
                    candidate = candidate.rpartition(".")[0]
                if candidate.startswith("mlcls.data") and candidate != name:
                    found.add(candidate)
        imports[name] = found
    return imports


# What the datasets lie below: the input pipelines and the packed shards read them, never the reverse.
ABOVE_DATASETS = ("mlcls.data.pipeline", "mlcls.data.shards")


def test_data_imports_run_one_way() -> None:
    """Inside mlcls/data/ no arrow runs back up (issue 51): the datasets import nothing of the input
    pipelines or the packed shards, and no module imports the package itself (``mlcls.data``, which builds
    datasets from all of them)."""
    imports = data_imports()
    assert "mlcls.data.datasets.base" in imports["mlcls.data.views"]  # read at all
    back_up = {
        (name, other)
        for name, imported in imports.items()
        for other in imported
        if other == "mlcls.data"
        or (name.startswith("mlcls.data.datasets.") and other.startswith(ABOVE_DATASETS))
    }
    assert back_up == set()


def test_no_resolver_is_registered_at_import() -> None:
    """A resolver reading manifests while a config resolves is registered where configs are composed
    (``mlcls.cli.overrides.register_resolvers``), never as a side effect of importing mlcls/data."""
    registering = {
        name
        for name, path in module_files(PACKAGE_DIR).items()
        if name.startswith("mlcls.data") and "register_new_resolver" in path.read_text()
    }
    assert registering == set()


# The test files that test no one module of mlcls: the project's files around the package (the Dockerfile,
# the docs' stated defaults, scripts/gpu_check.sh) and the suite's own rules (this file, the time budget).
NOT_A_MODULE = frozenset(
    {"test_dockerfile", "test_docs_defaults", "test_gpu_check", "test_package_layout", "test_suite_budget"}
)


def module_test_names(package_dir: Path) -> set[str]:
    """The names a test file may take after ``test_``: ``<module>`` for a top-level module, ``<package>`` for
    a package (``mlcls/losses/__init__.py``: ``losses``), ``<package>_<module>`` for a module or sub-package
    anywhere under a package, the folders between left out (``mlcls/data/datasets/coco.py``:
    ``data_coco``)."""
    names = set()
    for name in module_files(package_dir):
        parts = name.split(".")[1:]
        if parts:
            names.add(parts[0] if len(parts) == 1 else f"{parts[0]}_{parts[-1]}")
    return names


def top_packages(package_dir: Path) -> set[str]:
    """The names of mlcls's packages (``data``, ``losses``, ...), whose tests' names take no aspect."""
    return {path.parent.name for path in package_dir.glob("*/__init__.py")}


def named_module(stem: str, names: set[str], packages: set[str]) -> str | None:
    """The name in ``names`` that the test file ``stem`` (``test_...``) is for, or None: the name itself or,
    where a module's tests fill several files, the name and an aspect (``test_engine_checkpoint_fuzz``).
    A top-level package takes no aspect: ``test_data_anything`` would name no module and still pass."""
    name = stem.removeprefix("test_")
    for candidate in sorted(names, key=len, reverse=True):
        if name == candidate or (name.startswith(candidate + "_") and candidate not in packages):
            return candidate
    return None


def test_named_module_takes_a_module_and_an_aspect_but_no_bare_package() -> None:
    names = module_test_names(PACKAGE_DIR)
    packages = top_packages(PACKAGE_DIR)
    assert {"io", "losses", "data_coco", "data_shards", "engine_trainer", "models_text_query"} <= names
    assert named_module("test_data_coco", names, packages) == "data_coco"
    assert named_module("test_engine_checkpoint_fuzz", names, packages) == "engine_checkpoint"
    assert named_module("test_losses", names, packages) == "losses"
    assert named_module("test_data_shards_checks", names, packages) == "data_shards"
    assert named_module("test_losses_madeup", names, packages) is None
    assert named_module("test_trainer", names, packages) is None


def test_every_test_file_names_its_module() -> None:
    """Each ``tests/test_*.py`` is named for the module it tests (tests/conftest.py states the convention),
    so that a module's tests are found by its name; the few that test no module are listed above."""
    names = module_test_names(PACKAGE_DIR)
    packages = top_packages(PACKAGE_DIR)
    stems = {path.stem for path in Path(__file__).parent.glob("test_*.py")}
    assert stems >= NOT_A_MODULE, "a listed file is gone: take it off NOT_A_MODULE"
    unnamed = sorted(s for s in stems - NOT_A_MODULE if named_module(s, names, packages) is None)
    assert not unnamed, f"test files named for no module of mlcls: {unnamed}"
