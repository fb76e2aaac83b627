"""The documentation runs as written: every ```python block of the README and of docs/, page by
page; the site builds with --strict; the API reference covers every public name; the performance
tables are those of the runs kept beside them; the docstrings' examples run."""

import doctest
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
#: Pages whose code runs as one script under ``mpiexec -n 2``, as the page says to run it.
UNDER_MPI = {"docs/guides/mpi.md"}
#: The public namespaces whose every name the API reference documents.
NAMESPACES = ("hostavg", "hostavg.keras", "hostavg.hooks", "hostavg.plot", "hostavg.stats")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def blocks(page: str) -> list[tuple[int, str]]:
    """The page's ```python blocks, in order, with the line each one's code starts on."""
    text = (ROOT / page).read_text()
    return [(text.count("\n", 0, m.start(1)), m[1]) for m in FENCE.finditer(text)]


def script(page: str) -> str:
    """The page's blocks as one program whose line numbers are the page's, so that a traceback
    points into the page."""
    lines: list[str] = []
    for start, code in blocks(page):
        lines += [""] * (start - len(lines)) + code.splitlines()
    return "\n".join(lines) + "\n"


def run_page(page: str) -> dict:
    """Runs the page's blocks in order in one namespace; returns it."""
    namespace = {"__name__": "__main__"}
    exec(compile(script(page), str(ROOT / page), "exec"), namespace)
    return namespace


#: What some pages must also have done, beyond running.
CHECKS = {
    # The Keras quickstart's names last: an apply and a step; fit's 4 steps an epoch for 5 epochs.
    "README.md": lambda ns, out: (ns["res"].step == 2 and len(ns["res"].micro) == 4
                                  and len(ns["history"].steps) == 20
                                  and out.count("micro-batch loss") == 8
                                  and "optimizer.iterations: 1" in out and "'accuracy'" in out),
    # The TF1 guide's tf.data recipe: 4 steps of 4 micro-batches of 64 from the iterator, checked;
    # a check on a copy; a queue's step, checked; fetches: a summary and a mean per micro-batch.
    # The resume example: a fit that failed in an on_applied hook at step 6, resumed, ends with
    # the weights of a fit that was not stopped.
    "docs/guides/training.md": lambda ns, out: (
        "stopped at step 6 ; history up to it: 6 steps\nTrue\n" in out),
    # The edge of stability: full-batch gradient descent's sharpness climbs to 1 from below,
    # then stays within 20% of it.
    "docs/guides/inspecting.md": lambda ns, out: (
        ns["sharpness"].iloc[0] < 0.9 and ns["sharpness"].max() >= 1
        and ns["sharpness"][ns["sharpness"].index >= ns["sharpness"][ns["sharpness"] >= 1]
                            .index[0]].between(0.8, 1.2).all()),
    "docs/guides/tf1.md": lambda ns, out: (
        ns["data_res"].step == 4 and [m.size for m in ns["data_res"].micro] == [64] * 4
        and "4 256" in out and out.count("self-check passed") == 4
        and ns["q_res"].size == 256
        and [tuple(map(type, f)) for f in ns["res"].fetched] == [(bytes, np.float32)] * 4),
}


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p) and p not in UNDER_MPI])
def test_page_runs(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where a page writes its files
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = run_page(page)
    if page in CHECKS:
        assert CHECKS[page](namespace, capsys.readouterr().out), page


@pytest.mark.slow  # a fresh TensorFlow process
def test_the_readme_prints_no_tensorflow_log_lines(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's shell
    run = subprocess.run([sys.executable, "-c", script("README.md")], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr


@pytest.mark.slow  # two ranks, each a fresh TensorFlow process
@pytest.mark.parametrize("page", sorted(UNDER_MPI))
def test_page_runs_over_two_mpi_ranks(page, tmp_path):
    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                           f"{os.environ['PATH']}")
    if mpiexec is None:
        pytest.skip("no mpiexec: pip install -e '.[mpi]'")
    program = tmp_path / "page.py"
    program.write_text(script(page))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.run([mpiexec, "--oversubscribe", "-n", "2", sys.executable, str(program)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 ranks, step" in run.stdout, run.stdout   # rank 0 got to the end


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with ``mkdocs build --strict`` (a warning fails the build). Not
    ``-q``: it silences the warnings before strict mode counts them, so the build would pass."""
    pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                            "-d", str(site)], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=300)
    warnings = re.findall(r"^WARNING\b.*", build.stdout + build.stderr, re.M)
    assert build.returncode == 0 and not warnings, "\n".join(warnings) or build.stderr
    return site


def test_the_api_reference_documents_every_public_name(site):
    anchors = set()
    for page in (site / "reference").rglob("*.html"):
        anchors |= set(re.findall(r'id="(hostavg[\w.]*)"', page.read_text()))
    missing = []
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            ids = {f"{namespace}.{name}",
                   f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}",
                   getattr(obj, "__name__", None)}  # a namespace documented on its own page
            if not ids & anchors:
                missing.append(f"{namespace}.{name}")
    assert not missing, f"no entry in docs/reference/ for {missing}: add a `::: name` line"


def built(site, target: str) -> Path:
    """Where ``docs/<target>`` ends up: a page's HTML in the site, else the file itself."""
    if target.endswith(".md"):
        return site / ("index.html" if target == "index.md" else f"{target[:-3]}/index.html")
    return site / target if (site / target).exists() else ROOT / "docs" / target


def test_the_readmes_links_into_docs_arrive(site):
    # The README is no page of the site, so mkdocs checks none of its links.
    broken = []
    for target, anchor in re.findall(r"\]\(docs/([\w/.-]+?)(?:#([\w-]+))?\)",
                                     (ROOT / "README.md").read_text()):
        page = built(site, target)
        if not page.exists() or (anchor and f'id="{anchor}"' not in page.read_text()):
            broken.append(f"docs/{target}" + (f"#{anchor}" if anchor else ""))
    assert not broken, f"README links to what docs/ lacks: {broken}"


def test_the_files_the_documentation_names_exist():
    # The code moves; pages that point into it must move with it.
    named = {(page, path) for page in PAGES for path in re.findall(
        r"\b((?:hostavg|tests|notebooks|docs)/(?:[\w-]+/)*(?:[\w-]+\.(?:py|md|ipynb|png|json))?)",
        (ROOT / page).read_text())}
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, missing


def test_the_performance_tables_are_those_of_the_runs_kept():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_performance.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


#: Every module whose docstrings hold examples (``>>>``).
DOCTESTED = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                   for p in (ROOT / "hostavg").rglob("*.py") if ">>> " in p.read_text())


@pytest.mark.parametrize("module", DOCTESTED)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), extraglobs={"np": np},
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, module
