"""Checks the shape of hostavg's definitions: short functions, short docstrings.

Walks every ``.py`` file under ``hostavg/`` with ``ast`` and reports:

- each function or method over ``MAX_FUNCTION`` code lines (its lines from
  ``def`` to its end, less blank lines, comment-only lines and the lines of
  any docstring inside it);
- each class docstring over ``MAX_CLASS_DOC`` lines;
- each module docstring over ``MAX_MODULE_DOC`` lines
  (a docstring's lines are those of its text, quotes not counted).

It prints the longest function and the longest class and module docstrings
with their sizes, and exits 1 if any limit is exceeded (0 otherwise).

Run from the repository root: ``python .ci/shape.py`` (or pass the folder).
"""

import ast
import pathlib
import sys
from typing import NamedTuple

MAX_FUNCTION = 60
MAX_CLASS_DOC = 30
MAX_MODULE_DOC = 20


class Size(NamedTuple):
    """One measured definition: how many lines it has, and where it is."""

    lines: int
    where: str


def docstring_node(node):
    """The docstring's expression node of a module, class or function, or None."""
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr):
        value = body[0].value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return body[0]
    return None


def docstring_lines(node):
    """How many lines the docstring of ``node`` has as text (0 without one)."""
    doc = ast.get_docstring(node)
    return 0 if doc is None else len(doc.splitlines())


def code_lines(function, lines, docstring_rows):
    """How many lines of ``function`` are code: not blank, comment or docstring."""
    return sum(
        1
        for row in range(function.lineno, function.end_lineno + 1)
        if row not in docstring_rows
        and lines[row - 1].strip()
        and not lines[row - 1].strip().startswith("#")
    )


def measure(path, root):
    """The functions, class docstrings and module docstring of one file."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines()
    name = path.relative_to(root).as_posix()
    docstring_rows = set()
    for node in ast.walk(tree):
        doc = docstring_node(node) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ) else None
        if doc is not None:
            docstring_rows.update(range(doc.lineno, doc.end_lineno + 1))
    functions, classes = [], []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(Size(code_lines(node, lines, docstring_rows), where))
        elif isinstance(node, ast.ClassDef):
            classes.append(Size(docstring_lines(node), where))
    return functions, classes, Size(docstring_lines(tree), name)


def report(root):
    """Prints the sizes and every excess; returns the number of excesses."""
    root = pathlib.Path(root)
    functions, classes, modules = [], [], []
    for path in sorted(root.rglob("*.py")):
        file_functions, file_classes, module = measure(path, root.parent)
        functions += file_functions
        classes += file_classes
        modules.append(module)
    excesses = 0
    for kind, sizes, limit in (
        ("function", functions, MAX_FUNCTION),
        ("class docstring", classes, MAX_CLASS_DOC),
        ("module docstring", modules, MAX_MODULE_DOC),
    ):
        longest = max(sizes, default=Size(0, "(none)"))
        print(f"longest {kind}: {longest.lines} lines (limit {limit}) {longest.where}")
        for size in sorted(sizes, reverse=True):
            if size.lines > limit:
                excesses += 1
                print(f"  over: {size.lines} lines {size.where}")
    return excesses


def main(argv):
    """Runs the report on ``argv[0]`` (default ``hostavg``); 1 on any excess."""
    root = argv[0] if argv else pathlib.Path(__file__).resolve().parent.parent / "hostavg"
    return 1 if report(root) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
