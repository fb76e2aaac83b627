"""The ``backend`` fixture: every contract test runs once per backend of ``backends.BACKENDS``.

A test marked ``@pytest.mark.needs(feature)`` is a strict xfail on each backend
that lists ``feature`` as missing (or as a bug), and an ordinary test on the
others: when the feature lands, the XPASS fails and says which entry to remove.
"""

import pytest
from backends import BACKENDS, Backend


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs(feature): the test needs a feature some backends lack (backends.py)")


@pytest.fixture(params=BACKENDS, ids=[b.id for b in BACKENDS])
def backend(request) -> Backend:
    return request.param


def pytest_collection_modifyitems(items):
    for item in items:
        backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
        if not isinstance(backend, Backend):
            continue
        for mark in item.iter_markers("needs"):
            for feature in mark.args:
                reason = backend.lacks(feature)
                if reason is not None:
                    item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
