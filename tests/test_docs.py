"""The reliability page names, for each guarantee, the test that proves it: every test file and
test function it names exists (so the page cannot drift from the suite unnoticed)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reliability.md"


def all_test_files() -> dict[str, list[pathlib.Path]]:
    out: dict[str, list[pathlib.Path]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        out.setdefault(p.name, []).append(p)
    return out


def functions_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def references(text: str) -> list[tuple[str | None, str | None]]:
    """(file, test-name pattern) pairs of the page: `path/test_x.py::test_y`, `test_x.py`,
    `::test_y` (the file of the reference before it on the same line) and `test_y` alone."""
    refs = []
    for line in text.splitlines():
        last_file = None
        for m in re.finditer(r"`([\w/.]*test_\w+\.py)?(::)?(test_\w+\*?)?`", line):
            file, sep, name = m.group(1), m.group(2), m.group(3)
            if file is None and name is None:
                continue
            if file:
                last_file = pathlib.Path(file).name
            refs.append((pathlib.Path(file).name if file else (last_file if sep else None), name))
    return refs


def test_every_test_the_reliability_page_names_exists():
    files = all_test_files()
    every_function = {f for paths in files.values() for p in paths for f in functions_of(p)}
    missing = []
    for file, name in references(PAGE.read_text()):
        if file is not None and file not in files:
            missing.append(file)
            continue
        if name is None:
            continue
        pool = {f for p in files[file] for f in functions_of(p)} if file else every_function
        pattern = re.compile(re.escape(name).replace(r"\*", ".*") + "$")
        if not any(pattern.match(f) for f in pool):
            missing.append(f"{file or '?'}::{name}")
    assert missing == []


def test_the_reference_reader_finds_files_and_functions():
    refs = references("| x | y | `a/test_one.py::test_two`, `::test_three*`, `test_four` |")
    assert refs == [("test_one.py", "test_two"), ("test_one.py", "test_three*"), (None, "test_four")]
