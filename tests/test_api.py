"""The public API: what is exported, and that the host math never imports TensorFlow."""

import subprocess
import sys

import hostavg

PUBLIC = {"ACCUMULATE_MODES", "AVERAGE_MODES", "Accumulator", "ArgumentError", "Callback",
          "Curvature", "DiagnosisWarning", "OutlierWarning", "EarlyStopping", "StepError",
          "Gradients", "History", "HostavgError", "MicroBatch", "NoiseScale", "ResumeWarning",
          "SparseGradient",
          "StepLog", "StepResult", "StepStats", "StopTraining", "Trainer", "VariableSpec",
          "hooks", "import_tensorflow", "load_record", "plot", "private_apis", "split", "stats", "step_together", "__version__"}

#: hostavg.hooks: the built-in hooks and what they share.
HOOKS = {"ClipGlobalNorm", "ClipMicroBatchNorm", "Curvature", "Diagnose", "DiagnosisWarning",
         "Drop", "Freeze", "Hook", "LivePlot", "OutlierWarning", "Record", "Search",
         "SkipBadSamples", "SkipNonFinite", "TensorBoard", "WatchOutliers"}


def test_all_is_exactly_the_public_api_and_every_name_resolves():
    assert set(hostavg.__all__) == PUBLIC
    for name in hostavg.__all__:
        assert getattr(hostavg, name) is not None
    assert not {"Wiring", "conform", "numpy_reduce", "resolve_feed"} & set(dir(hostavg))
    assert set(hostavg.hooks.__all__) == HOOKS
    assert all(getattr(hostavg.hooks, name) is not None for name in HOOKS)


def test_the_framework_free_layers_import_no_framework():
    """hostavg, its core, engine, training loop and inspection run without TensorFlow, Keras, JAX or torch."""
    code = ("import sys, pkgutil, importlib, numpy as np, hostavg\n"
            "import hostavg.core, hostavg.engine, hostavg.train, hostavg.inspect\n"
            "for package in (hostavg.core, hostavg.engine, hostavg.train, hostavg.inspect):\n"
            "    for info in pkgutil.iter_modules(package.__path__):\n"
            "        importlib.import_module(f'{package.__name__}.{info.name}')\n"
            "import hostavg.hooks, hostavg.plot, hostavg.stats\n"
            "acc = hostavg.Accumulator({'w': hostavg.VariableSpec((2,), np.dtype('float32'), False)})\n"
            "acc.add({'w': np.ones(2)}, weight=2); acc.mean(); hostavg.split({'x': np.ones(3)}, 2)\n"
            "hostavg.stats.noise_scale(np.ones((2, 3)), [1, 2]); hostavg.NoiseScale()\n"
            "hostavg.AVERAGE_MODES, hostavg.ACCUMULATE_MODES, hostavg.MicroBatch, hostavg.StepResult\n"
            "from hostavg.hooks import SkipNonFinite, ClipGlobalNorm, Drop, Record, TensorBoard\n"
            "hostavg.engine.step.Engine({'w': hostavg.VariableSpec((), np.dtype('float32'), False)},\n"
            "                           hooks=[SkipNonFinite(), ClipGlobalNorm(1.0)])\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in\n"
            "             ('tensorflow', 'keras', 'jax', 'torch', 'tf_keras'))\n"
            "assert not bad, f'the framework-free layers imported {bad[:3]}'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_version_is_written_once_and_the_changelog_has_its_section():
    """setup.py reads hostavg.__version__; CHANGELOG.md has a section for it and for 0.1.0."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[-1] == hostavg.__version__
    sections = re.findall(r"^## \[([^\]]+)\]", (root / "CHANGELOG.md").read_text(), re.M)
    assert sections[0] == hostavg.__version__ and sections[-1] == "0.1.0"
