"""hostavg's layers, kept by a walk over every module's imports (imports inside functions too).

Low to high; a module imports its own layer and those below, never one above:

0. ``core``: NumPy only.
1. ``compat``: what hostavg needs of each framework, one module per framework: its
   private APIs, each with a public fallback, and the public helpers that several
   parts share (both TensorFlow backends, the command line). Above ``core``, whose
   one exception type ``compat`` raises; below the engine, whose signal guard uses
   ``compat.python`` (CPython's ``_signal``), and below the backends, which use the
   rest. Its modules named for a framework import it, so the framework-free layers
   cannot import them (rule 3): one place per framework, reached from the backends only.
2. ``engine``: the step engine.
3. ``train`` and ``inspect``: the fit loop, checkpoints, hooks; records, plots, TensorBoard.
4. ``tf1`` and ``keras``: the backends and their faces.
5. ``cli``: the command line.
6. The public re-export layer: ``hostavg/__init__.py``, ``hooks.py``, ``plot.py``,
   ``stats.py``, ``__main__.py``. Only its version number (``from hostavg import
   __version__``, a constant) may be read from below.

The rules:

1. No module imports a layer above its own.
2. ``keras/`` never reaches ``tf1/`` and ``tf1/`` never reaches ``keras/``, even through
   another module: what both TensorFlow backends share is in ``compat.tensorflow``.
3. ``core``, ``engine``, ``train`` and ``inspect`` reach no framework (TensorFlow,
   Keras, JAX, tf_keras, torch), even through another hostavg module, and speak none:
   no string of their code holds a framework's word (:data:`FRAMEWORK_WORDS`: "feed
   dict", "session", "tf.", "keras", "jax", "placeholder", "Saver", ...; f-strings
   too) unless :data:`NEUTRAL` allows it, and no ``.framework`` is read. A message there
   says "batch", "micro-batch", "data", "model"; a framework's own words live on its
   backend (``Backend.advice``, :data:`hostavg.core.words.WORDS`), so a Keras user reads
   no TF1 word, and a new backend needs no edit of these layers. Docstrings are not
   read: they are written for whoever implements or calls these layers, and say what
   each backend puts behind a neutral word ("the target: a TF1 session, a Keras
   model"); what a user reads at run time, a message or a warning, is a string of code.
4. No import cycle: no module reaches itself through the modules it imports.

"Reach" follows every import, at module level or inside a function, and the
packages a module's import runs (``hostavg/__init__.py`` aside: rule 1 covers it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "hostavg"

#: Layer names, low to high; the modules at the top of the package are "public".
LAYERS = (("core",), ("compat",), ("engine",), ("train", "inspect"),
          ("tf1", "keras"), ("cli",), ("public",))
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
#: The modules at the top of the package: the public re-export layer.
PUBLIC = ("hostavg", "hostavg.__main__", "hostavg.hooks", "hostavg.plot", "hostavg.stats")
FACES = ("tf1", "keras")
FRAMEWORK_FREE = ("core", "engine", "train", "inspect")
#: Top-level packages that are a framework.
FRAMEWORKS = frozenset({"tensorflow", "keras", "jax", "jaxlib", "tf_keras", "torch"})
#: The words of one framework, found as words in any case: its name or module prefix (``tf.``,
#: ``keras.``, ``jax.``, ``jnp.``, ``lax.``), and TF1's nouns, which a Keras user does not
#: think in (a Keras batch is not a feed, its model no graph).
FRAMEWORK_WORDS = re.compile(
    r"\b(tensorflow|tf1?|tf_keras|keras|jax|jaxlib|jnp|lax|torch|feed[ _]dicts?|feeds?|sess|"
    r"sessions?|placeholders?|savers?|train[ _]ops?|update_ops|graphs?)\b", re.IGNORECASE)
#: (module, string) -> why a string of a framework-free layer holding a framework's word is
#: neutral after all.
NEUTRAL = {
    # A mode's name, the value of the argument average= (the TF1 face computes the mean "in
    # the graph" where asked), which the public AVERAGE_MODES lists: a name, not a message.
    ("hostavg.engine.protocols", "graph"):
        "AVERAGE_MODES: the name of a mode, as the caller writes it",
}
#: What every layer may read from the package root: constants, not code.
ROOT_CONSTANTS = frozenset({"__version__"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module in PUBLIC:
        return "public"
    return module.split(".")[1]


def _is_module(name: str) -> bool:
    return name in SOURCES


class Imports(ast.NodeVisitor):
    """What one module imports: hostavg modules (with the line), framework packages, and the
    framework names it says."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.hostavg: list[tuple[str, int]] = []
        self.frameworks: list[tuple[str, int]] = []
        self.names: list[tuple[str, int]] = []
        self.docstrings: set[int] = set()

    def _add(self, name: str, line: int) -> None:
        top = name.split(".")[0]
        if top == "hostavg":
            self.hostavg.append((name, line))
        elif top in FRAMEWORKS:
            self.frameworks.append((name, line))

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            parent = self.package.split(".")
            parent = parent[:len(parent) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if _is_module(target):
                self._add(target, node.lineno)
            elif not (base == "hostavg" and alias.name in ROOT_CONSTANTS):
                self._add(base, node.lineno)

    def _skip_docstring(self, node):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.docstrings.add(id(body[0].value))

    def visit(self, node):
        self._skip_docstring(node)
        return super().visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and id(node) not in self.docstrings:
            words = FRAMEWORK_WORDS.findall(node.value)
            if words:
                self.names.append((node.value, words, node.lineno))

    def visit_Attribute(self, node):
        if node.attr == "framework":
            self.names.append((".framework", ["framework"], node.lineno))
        self.generic_visit(node)


def _imports(module: str, source: str, is_package: bool = False) -> Imports:
    found = Imports(module, is_package)
    found.visit(ast.parse(source, module))
    return found


IMPORTS = {module: _imports(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")
           for module, path in SOURCES.items()}


def _runs(module: str) -> list[str]:
    """The hostavg modules that importing ``module`` runs directly: it and its packages, the
    package root aside."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def _edges(module: str) -> set[str]:
    return {run for name, _ in IMPORTS[module].hostavg for run in _runs(name)} \
        | set(_runs(module)) - {module}


def _path_to(module: str, found) -> list[str] | None:
    """The shortest chain of imports from ``module`` to a module for which ``found`` is true."""
    chains, seen = [[module]], {module}
    while chains:
        chain = chains.pop(0)
        if found(chain[-1]):
            return chain
        for nxt in sorted(_edges(chain[-1]) - seen):
            seen.add(nxt)
            chains.append(chain + [nxt])
    return None


def test_every_module_has_a_layer():
    assert SOURCES, f"no modules found under {PACKAGE}"
    unknown = sorted(m for m in SOURCES if layer_of(m) not in RANK)
    assert not unknown, f"modules in no layer (add their package to LAYERS): {unknown}"


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_module_imports_a_layer_above_its_own(module):
    rank = RANK[layer_of(module)]
    above = [f"line {line}: {name} ({layer_of(name)})" for name, line in IMPORTS[module].hostavg
             if RANK[layer_of(name)] > rank]
    assert not above, f"{module} ({layer_of(module)}) imports a higher layer: {above}"


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if layer_of(m) in FACES))
def test_one_face_never_reaches_into_the_other(module):
    other = next(face for face in FACES if face != layer_of(module))
    chain = _path_to(module, lambda m: layer_of(m) == other)
    assert chain is None, f"{module} reaches {other}/: {' -> '.join(chain)}"


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if layer_of(m) in FRAMEWORK_FREE))
def test_the_framework_free_layers_reach_no_framework(module):
    chain = _path_to(module, lambda m: bool(IMPORTS[m].frameworks))
    assert chain is None, (f"{module} reaches {IMPORTS[chain[-1]].frameworks[0][0]}: "
                           f"{' -> '.join(chain)}")


@pytest.mark.parametrize("module", sorted(m for m in SOURCES if layer_of(m) in FRAMEWORK_FREE))
def test_the_framework_free_layers_speak_no_framework(module):
    said = [f"line {line}: {words} in {text[:70]!r}" for text, words, line in IMPORTS[module].names
            if (module, text) not in NEUTRAL]
    assert not said, (f"{module} speaks a framework: {said}; say it in neutral words (batch, "
                      f"micro-batch, data, model), or take the framework's word from the "
                      f"backend's advice (hostavg.core.words.WORDS)")


def test_what_is_allowed_as_neutral_is_still_there():
    """An entry of NEUTRAL whose string is gone is removed with it, not kept to allow another."""
    found = {(m, text) for m in SOURCES for text, _, _ in IMPORTS[m].names}
    assert set(NEUTRAL) <= found, sorted(set(NEUTRAL) - found)


def _cycle() -> list[str] | None:
    """A chain of imports from a module back to itself, or None. A module's own packages,
    which importing it runs first, are no edge: a package may import its modules."""
    edges = {m: sorted({name for name, _ in IMPORTS[m].hostavg} - {m}) for m in SOURCES}
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        found = next(filter(None, map(visit, edges[module])), None)
        path.pop()
        done.add(module)
        return found

    return next(filter(None, map(visit, sorted(SOURCES))), None)


def test_no_module_reaches_itself_through_its_imports(monkeypatch):
    chain = _cycle()
    assert chain is None, f"an import cycle: {' -> '.join(chain)}"
    # The walk finds one: keras.common and keras.batch importing each other.
    monkeypatch.setitem(IMPORTS, "hostavg.keras.batch",
                        _imports("hostavg.keras.batch", "from hostavg.keras import common\n"))
    chain = _cycle()
    assert chain[0] == chain[-1] and set(chain) == {"hostavg.keras.batch", "hostavg.keras.common"}


def test_the_walk_sees_what_it_must():
    """Imports inside functions, relative ones, the root's version, framework words in strings
    (f-strings and prose too, in any case) and ``.framework`` reads are seen; docstrings are
    not read, nor a word inside another ("feedback", "tfa", "paragraph")."""
    found = _imports("hostavg.core.example", '''"""Advice for keras users lives elsewhere."""
import numpy as np
from hostavg import __version__
from . import errors
from .stats import StepStats


def advise(backend, n):
    """Names tf1 in a docstring only."""
    import tensorflow as tf
    from hostavg.tf1 import session
    return ADVICE["tf1"][backend.framework], tf, session, (
        f"{n} rows; reduce it with tf.reduce_mean", "pass at least one Feed Dict",
        "the Session is closed", f"give feedback on {n} paragraphs of tfa")
''')
    assert found.hostavg == [("hostavg.core.errors", 4), ("hostavg.core.stats", 5),
                             ("hostavg.tf1.session", 11)]
    assert found.frameworks == [("tensorflow", 10)]
    assert [(words, line) for _, words, line in found.names] == [
        (["tf1"], 12), (["framework"], 12), (["tf"], 13), (["Feed Dict"], 13),
        (["Session"], 14)]
    chain = _path_to("hostavg.keras.tensorflow", lambda m: bool(IMPORTS[m].frameworks))
    assert chain is not None and len(chain) <= 2
