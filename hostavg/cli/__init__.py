"""The command line: ``hostavg train`` and ``hostavg bench``, with their demo models and data sets."""

from hostavg.cli.main import main

__all__ = ["main"]
