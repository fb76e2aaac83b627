"""The ``backend`` fixture: every contract test runs once per backend of ``backends.BACKENDS``."""

import pytest
from backends import BACKENDS, Backend


@pytest.fixture(params=BACKENDS, ids=[b.id for b in BACKENDS])
def backend(request) -> Backend:
    return request.param
