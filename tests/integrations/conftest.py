"""Integration tests import their support modules from this folder; ``big_daemon`` is a
daemon with a 512 MiB host tier for the end-to-end runs."""

import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _root_conftest():
    spec = importlib.util.spec_from_file_location("kvstore_tests_conftest", HERE.parent / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def big_daemon(tmp_path):
    from kvstore.serve import start_server

    d = start_server(_root_conftest().daemon_config(tmp_path, host="512MiB"))
    yield d
    d.stop(0)
