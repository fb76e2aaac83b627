"""TensorFlow as both its backends and the command line meet it: imported quietly, errors, read ops.

Imports no TensorFlow itself (:func:`import_tensorflow` does, when called), so
``import hostavg`` stays free of it.
"""

from __future__ import annotations

import os
import sys

__all__ = ["READ_OPS", "first_line", "import_tensorflow"]

#: Ops that take a variable (its resource handle) only to read it.
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
                      "VarIsInitializedOp", "IsVariableInitialized"})

#: What TF_CPP_MIN_LOG_LEVEL becomes unless it was set: fatal errors only. TensorFlow's
#: own errors reach Python as exceptions; what its C++ core logs at start-up ("failed
#: call to cuInit" on a machine without a GPU) is noise to most.
QUIET_LEVEL = "3"


def import_tensorflow():
    """TensorFlow, imported without the log lines its C++ core prints while it loads.

    If ``TF_CPP_MIN_LOG_LEVEL`` is set, yours wins and TensorFlow is imported
    as it is. Otherwise it is set to ``"3"`` (TensorFlow's C++ core logs
    fatal errors only) and, while TensorFlow loads, the process's standard
    error (file descriptor 2) goes to ``/dev/null``: the lines printed there
    before TensorFlow sets its logging up ("oneDNN custom operations are
    on", "Could not find cuda drivers") ignore ``TF_CPP_MIN_LOG_LEVEL``. An
    exception raised by the import propagates as usual. The CLI and the
    notebooks import TensorFlow this way; to see every line, set
    ``TF_CPP_MIN_LOG_LEVEL=0``.

    Example::

        import hostavg
        tf = hostavg.import_tensorflow()
    """
    if "tensorflow" in sys.modules or "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        import tensorflow
        return tensorflow
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = QUIET_LEVEL
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 to silence
        import tensorflow
        return tensorflow
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        import tensorflow
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return tensorflow


def first_line(error) -> str:
    """The line of a TensorFlow error message that says what went wrong."""
    for line in str(getattr(error, "message", error)).splitlines():
        line = line.strip()
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ",
                                         "Node: ")):
            return line
    return str(error)
