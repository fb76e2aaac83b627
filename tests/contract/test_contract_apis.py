"""The contract suite runs once normally and once with HOSTAVG_PUBLIC_API_ONLY=1 (test_compat):
each run uses exactly the framework APIs the switch allows."""

import os

import backends  # noqa: F401 - imports every backend's framework, so their APIs are detected

import hostavg


def test_the_private_apis_in_use_are_those_the_switch_allows():
    if os.environ.get("HOSTAVG_PUBLIC_API_ONLY") == "1":
        assert hostavg.private_apis() == ()
    else:
        assert hostavg.private_apis(), "no private API detected: the fast paths are all off"
