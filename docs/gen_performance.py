"""The performance page's tables, generated from ``hostavg bench --json`` runs kept in docs/performance/.

    python docs/gen_performance.py record NAME [hostavg bench options]
        runs ``python -m hostavg bench OPTIONS --json ...`` and keeps its numbers, with the
        command, the date, the machine and its load, as docs/performance/NAME.json
    python docs/gen_performance.py record NAME benchmarks/host_memory.py [its options]
        the same for that script (the host memory of a step)
    python docs/gen_performance.py
        rewrites every table of docs/explanation/performance.md from those files
    python docs/gen_performance.py --check
        exits 1 if a table on the page differs from what the files give (the tests run this)

A table sits on the page between ``<!-- bench: NAME -->`` and ``<!-- end bench -->``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

DOCS = Path(__file__).parent
RUNS = DOCS / "performance"
PAGE = DOCS / "explanation" / "performance.md"
TABLE = re.compile(r"(<!-- bench: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end bench -->)", re.S)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The commit of the code measured: HEAD, and "+changes" where hostavg/ differs from it."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=DOCS).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    return (head + ("+changes" if git("status", "--porcelain", "--", "../hostavg") else "")) \
        if head else None


#: Scripts whose runs can be kept, by path: the name of their table's kind.
SCRIPTS = {"benchmarks/host_memory.py": "host-memory"}


def record(name: str, options: list[str]) -> Path:
    """Runs hostavg bench (or a script of :data:`SCRIPTS`) with ``options``; keeps its JSON with
    where and when it ran."""
    script = options[0] if options and options[0] in SCRIPTS else None
    command = [sys.executable, str(DOCS.parent / script), *options[1:]] if script else \
        [sys.executable, "-m", "hostavg", "bench", *options]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        load_before, t0 = os.getloadavg()[0], time.perf_counter()
        subprocess.run([*command, "--json", str(out)], check=True)
        wall, load_after = time.perf_counter() - t0, os.getloadavg()[0]
        bench = json.loads(out.read_text())
    commit = _commit()
    shown = ["python", script, *options[1:]] if script else ["hostavg", "bench", *options]
    backend = os.environ.get("KERAS_BACKEND")
    run = {"command": " ".join(([f"KERAS_BACKEND={backend}"] if backend else []) + shown),
           **({"kind": SCRIPTS[script]} if script else {}),
           "date": datetime.date.today().isoformat(), "commit": commit,
           "wall_s": round(wall, 1),
           "load_average": [round(load_before, 2), round(load_after, 2)],
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(),
                       "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                           / 2**30),
                       "system": f"{platform.system()} {platform.machine()}",
                       "python": platform.python_version(), "tensorflow": _version("tensorflow"),
                       "keras": _version("keras"), "numpy": _version("numpy"),
                       "jax": _version("jax")},
           "bench": bench}
    RUNS.mkdir(exist_ok=True)
    path = RUNS / f"{name}.json"
    path.write_text(json.dumps(run, indent=1) + "\n")
    return path



def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms < 1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def caption(run: dict) -> str:
    """Where, when and how a run was made, in one paragraph."""
    m = run["machine"]
    before, after = run["load_average"]
    at = f" (hostavg at {run['commit']})" if run.get("commit") else ""
    return (f"`{run['command']}`, {run['date']}{at}: {m['cores']}-core {m['cpu']}, "
            f"{m['memory_gib']} GiB, {m['system']}, Python {m['python']}, {_frameworks(run)}, "
            f"NumPy {m['numpy']}; "
            f"load average {before} when it started and {after} when it ended; "
            f"{run['wall_s']:.0f} s in all.")


def _frameworks(run: dict) -> str:
    """The frameworks a run measured, with their versions."""
    m = run["machine"]
    if run.get("kind") == "host-memory":
        cases = {r["case"] for r in run["bench"]}
        on_jax = {c for c in cases if c.startswith("keras-jax")}
        used = [f"TensorFlow {m['tensorflow']}"] * bool(cases - on_jax) + [f"JAX {m['jax']}"] * bool(on_jax)
    else:
        used = [f"JAX {m['jax']}" if run["bench"].get("keras_backend") == "jax"
                else f"TensorFlow {m['tensorflow']}"]
    return f"{' and '.join(used)} on the CPU, Keras {m['keras']}"


def host_memory_table(run: dict) -> str:
    """A run of benchmarks/host_memory.py: what one step allocates on the host, per case."""
    rows = run["bench"]
    first = rows[0]
    mib = 2 ** 20
    lines = [caption(run), "",
             f"{first['model']} ({first['parameters']:,} parameters, a float32 gradient of "
             f"{first['parameters'] * 4 / mib:.1f} MiB), micro-batches of {first['micro']}; each "
             f"case in a fresh process, medians over the steps after one warm-up step:", "",
             "| case | k | NumPy peak (MiB) | RSS peak (MiB) | page faults per micro-batch "
             "| step |", "|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['case']} | {r['k']} | {r['numpy_peak'] / mib:.1f} | {r['rss_peak'] / mib:.1f} "
              f"| {r['faults_per_micro']:,.0f} | {_ms(r['step_s'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def per_sample_table(run: dict) -> str:
    """A run of ``hostavg bench --per-sample``: per_sample against compute, per face, and the
    peak memory of one per_sample by chunk size."""
    bench = run["bench"]
    mib = 2 ** 20
    lines = [caption(run), "",
             f"Each cell the median of {bench['repeats']} calls, interleaved, after one untimed "
             f"call of each:", "",
             "| model, samples | face | parameters | chunk_size | compute | per_sample | ratio |",
             "|---|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['model']}, {r['samples']} | `{r['face']}` | {r['parameters']:,} | "
              f"{r['chunk_size']:,} | {_ms(r['compute_s'])} | {_ms(r['per_sample_s'])} | "
              f"{r['ratio']:.1f}x |" for r in bench["timing"]]
    if bench.get("memory"):
        first = bench["memory"][0]
        lines += ["", f"Peak extra resident memory of one per_sample of {first['model']}, "
                      f"{first['samples']:,} samples, each in a fresh process:", "",
                  "| face | chunk_size | one chunk's float32 gradients | peak |",
                  "|---|--:|--:|--:|"]
        lines += [f"| `{r['face']}` | {r['chunk_size']:,} | {r['gradients_bytes'] / mib:.1f} MiB "
                  f"| {r['peak_bytes'] / mib:.1f} MiB |" for r in bench["memory"]]
    return "\n".join(lines) + "\n"


def table(run: dict) -> str:
    """A run's timings (median step time and ratio to each row's baseline) and its memory."""
    if run.get("kind") == "host-memory":
        return host_memory_table(run)
    if "timing" in run["bench"]:
        return per_sample_table(run)
    configs = run["bench"]["configs"]
    names = list(configs[0]["median_s"])
    baselines = sorted({c["baseline"] for c in configs})
    lines = ["| configuration | parameters | " + " | ".join(names) + " |",
             "|---|--:|" + "--:|" * len(names)]
    for c in configs:
        name = f"{c['model']} micro={c['micro_batch_size']} k={c['k']}"
        if c["optimizer"] != "adam":
            name += f" {c['optimizer']}"
        ratio = c["ratio_to_baseline"]
        cells = [f"{_ms(c['median_s'][n])} ({ratio[n]:.2f})" for n in names]
        lines.append(f"| {name} | {c['parameters']:,} | " + " | ".join(cells) + " |")
    out = [caption(run), "",
           "Each cell: the median step time over " + str(run["bench"]["repeats"])
           + " timed samples, and in parentheses its ratio to the row's baseline ("
           + " or ".join(f"`{b}`" for b in baselines) + ").", "", *lines]
    memory = run["bench"].get("memory")
    if memory:
        out += ["", f"Peak extra host memory of one step, {memory['config']}, each "
                    f"implementation in a fresh process:", "",
                "| implementation | MiB |", "|---|--:|"]
        out += [f"| {n} | {b / 2**20:.1f} |" for n, b in memory["peak_bytes"].items()]
        for n, by_k in memory.get("k_scaling", {}).items():
            out += [f"| {n}, k = {k} | {b / 2**20:.1f} |" for k, b in by_k.items()]
    return "\n".join(out) + "\n"


def generate(page: str) -> str:
    """``page`` with every table rebuilt from its run's file."""
    def rebuilt(m):
        run = json.loads((RUNS / f"{m['name']}.json").read_text())
        return m[1] + table(run) + m[4]
    return TABLE.sub(rebuilt, page)


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        print(record(argv[1], argv[2:]))
        return 0
    page = PAGE.read_text()
    new = generate(page)
    if argv == ["--check"]:
        if new != page:
            print(f"{PAGE} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
