"""The house: packages by concept with imports that only run downward, no import cycles, no
mixins, no function reaching into another class's privates, short files, one caller of a
policy's victim choice, and docs/architecture.md naming exactly the packages that exist.

The layer rules are the table of ``docs/architecture.md``: a module may import its own
package and the packages its layer lists (imports inside functions count; those under
``if TYPE_CHECKING:`` do not; the generated ``kvstore._proto`` stubs are left out).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "tiers", "engine_adapter", "kernels")
MAX_LINES = 400
MAX_TOP_LEVEL = 12

KVSTORE_PARTS = ("common", "client", "config", "store", "policy", "agent", "cluster", "service", "tools", "_proto")
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "tiers": {"kernels"},
    "tiers.nvme": {"tiers", "kernels"},
    "tiers.mooncake": {"tiers", "kernels"},
    "kvstore": {"kvstore.common"},                       # the package itself and its aliases
    "kvstore._proto": set(),
    "kvstore.common": {"tiers"},
    "kvstore.policy": {"kvstore.common"},
    "kvstore.config": {"kvstore.common", "kvstore.policy"},
    "kvstore.client": {"kvstore.common", "kvstore._proto"},
    "kvstore.cluster": {"kvstore.common", "kvstore.policy", "tiers"},
    "kvstore.store": {"kvstore.common", "kvstore.policy", "kvstore.cluster", "tiers"},
    "kvstore.agent": {"kvstore.common", "kvstore.policy", "kvstore.config", "kvstore.store", "tiers"},
    "kvstore.service": {"kvstore.common", "kvstore.policy", "kvstore.config", "kvstore.store", "kvstore.agent",
                        "kvstore.cluster", "kvstore._proto", "tiers", "tiers.nvme", "tiers.mooncake"},
    "kvstore.tools": {"kvstore", *(f"kvstore.{p}" for p in KVSTORE_PARTS), "tiers", "tiers.nvme", "tiers.mooncake",
                      "engine_adapter", "engine_adapter.reference", "kernels"},
    "engine_adapter": {"kvstore.common", "kvstore.client", "kernels"},
    "engine_adapter.reference": {"engine_adapter", "kvstore.common", "kvstore.client", "kernels"},
    "engine_adapter.vllm": {"engine_adapter", "kvstore.common", "kvstore.client", "kernels"},
    "engine_adapter.sglang": {"engine_adapter", "kvstore.common", "kvstore.client", "kernels"},
}
"""Layer -> the layers it may import. Kept in step with the table in docs/architecture.md."""

ALIASES = {"kvstore.keys": "kvstore.common.keys", "kvstore.trajectory_keys": "kvstore.common.trajectory_keys",
           "kvstore.errors": "kvstore.common.errors", "engine_adapter.vllm_connector": "engine_adapter.vllm.connector",
           "engine_adapter.sglang_backend": "engine_adapter.sglang.backend"}
"""Old public module paths kept for users' code and engine configs: each is the module it names."""


def modname(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_files() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_proto" not in p.parts)


FILES = project_files()
MODULES = {modname(p): p for p in FILES}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def layer_of(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] == "kvstore":
        return f"kvstore.{parts[1]}" if len(parts) > 1 and parts[1] in KVSTORE_PARTS else "kvstore"
    if parts[0] in ("tiers", "engine_adapter"):
        sub = ".".join(parts[:2])
        is_package = (ROOT / pathlib.Path(*parts[:2]) / "__init__.py").exists() if len(parts) > 1 else False
        return sub if is_package else parts[0]
    return parts[0]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    return {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for x in ast.walk(n)}


def imports_of(mod: str) -> set[str]:
    """Project modules ``mod`` imports anywhere in its file (inside functions too)."""
    tree, path = TREES[mod], MODULES[mod]
    skip = _type_checking_nodes(tree)
    names: list[str] = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            names.extend(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = mod.split(".")
                base = base if path.name == "__init__.py" else base[:-1]
                base = base[: len(base) - (n.level - 1)]
                root = ".".join(base + ([n.module] if n.module else []))
            else:
                root = n.module or ""
            names.append(root)
            names.extend(f"{root}.{a.name}" for a in n.names)
    out = set()
    for name in names:
        if name.split(".")[0] not in PACKAGES or name.startswith("kvstore._proto"):
            continue
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != mod and not mod.startswith(name + "."):   # a module's own parent package
            out.add(name)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_imports_only_run_downward():
    bad = []
    for mod, deps in GRAPH.items():
        here = layer_of(mod)
        for dep in deps:
            there = layer_of(dep)
            if there == here or there in ALLOWED[here]:
                continue
            if MODULES[mod].name == "__init__.py" and dep.startswith(mod + "."):
                continue                     # a package's front door may name its own subpackages
            if ALIASES.get(mod) == dep:
                continue
            bad.append(f"{mod} ({here}) imports {dep} ({there})")
    for mod in MODULES:
        assert layer_of(mod) in ALLOWED, f"{mod}: layer {layer_of(mod)} is not in the layer table"
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert strongly_connected(GRAPH) == []


def test_every_alias_is_the_module_it_names():
    import importlib

    for old, new in ALIASES.items():
        if old.startswith("engine_adapter."):
            continue                         # importing the engine plug-ins needs the engine
        assert importlib.import_module(old) is importlib.import_module(new)


def test_the_cycle_check_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    out: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for mod, tree in TREES.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                out.setdefault(n.name, []).append((mod, n))
    return out


def _defined_attributes(cls: ast.ClassDef) -> set[str]:
    names = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                and n.value.id == "self":
            names.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return names


def mixins() -> list[str]:
    """Classes used as a base whose methods read ``self.x`` that neither they nor their own
    bases define (a mixin relying on its host), and classes named ``*Mixin``."""
    classes = _classes()
    bases_used = {ast.unparse(b).rpartition(".")[2] for defs in classes.values() for _, c in defs for b in c.bases}
    found = []
    for name, defs in classes.items():
        for mod, cls in defs:
            if name.endswith("Mixin"):
                found.append(f"{mod}.{name}")
                continue
            if name not in bases_used:
                continue
            own_bases = [ast.unparse(b).rpartition(".")[2] for b in cls.bases]
            if any(b not in classes and b not in ("object",) for b in own_bases):
                continue                     # a base from outside the project: not ours to judge
            defined = _defined_attributes(cls)
            todo = list(own_bases)
            while todo:
                b = todo.pop()
                for _, bc in classes.get(b, []):
                    defined |= _defined_attributes(bc)
                    todo.extend(ast.unparse(x).rpartition(".")[2] for x in bc.bases)
            read = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
            missing = read - defined
            if missing:
                found.append(f"{mod}.{name} uses {sorted(missing)}")
    return found


def test_no_mixins():
    assert mixins() == []


PRIVATE_OK = {"_replace", "_asdict", "_fields", "_make", "_getframe", "_exit", "_name_", "_value_"}


def private_reaches() -> list[str]:
    """Module-level functions that read or write ``obj._x`` of an object they were given."""
    found = []
    for mod, tree in TREES.items():
        imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        for fn in tree.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                        and n.attr not in PRIVATE_OK and isinstance(n.value, ast.Name)
                        and n.value.id not in imported and n.value.id not in ("self", "cls")):
                    found.append(f"{mod}.{fn.name}: {n.value.id}.{n.attr}")
    return found


def test_no_function_reaches_into_another_class():
    assert private_reaches() == []


def test_victims_are_chosen_in_one_module():
    callers = set()
    for mod, tree in TREES.items():
        if layer_of(mod) == "kvstore.policy":
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "victim":
                callers.add(mod)
    assert callers == {"kvstore.store.room"}


def test_files_are_short():
    long = [f"{p.relative_to(ROOT)} {n}" for p in FILES if (n := p.read_text().count("\n")) > MAX_LINES]
    assert long == []


def test_kvstore_top_level_is_small():
    top = sorted(p.name for p in (ROOT / "kvstore").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def package_dirs() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")
                  if "_proto" not in p.parts)


@pytest.mark.parametrize("package", package_dirs())
def test_every_package_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 8, f"{package}/__init__.py needs a docstring saying what it owns"


def test_the_architecture_page_names_every_package_and_only_those():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:kvstore|tiers|engine_adapter|kernels)(?:/\w+)*)/(?![\w.])", text))
    existing = set(package_dirs())
    assert existing - named == set(), "packages missing from docs/architecture.md"
    assert {n for n in named if not (ROOT / n).is_dir()} == set(), "docs/architecture.md names folders that do not exist"
    for layer in ALLOWED:
        assert layer.replace(".", "/") + "/" in text, f"docs/architecture.md has no row for {layer}"
