"""The suite's own machinery (tests/conftest.py): the `job` guard, the `backend` fixture."""

import os
import sys

import pytest

import conftest


def test_a_test_that_starts_a_job_without_the_job_marker_fails():
    with pytest.raises(pytest.fail.Exception) as failed:
        conftest.job_env()
    message = str(failed.value)
    assert "test_a_test_that_starts_a_job_without_the_job_marker_fails starts a job" in message
    assert "is not marked `job`: add @pytest.mark.job" in message


def test_a_test_marked_job_gets_the_jobs_environment(request):
    request.node.add_marker(pytest.mark.job)  # what @pytest.mark.job does, without a job
    env = conftest.job_env(TESTKIT_EXAMPLE="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == conftest.ROOT
    assert (env["OMPI_ALLOW_RUN_AS_ROOT"], env["TESTKIT_EXAMPLE"]) == ("1", "1")


def test_a_process_that_is_no_job_needs_no_marker():
    env = conftest.python_env(TESTKIT_EXAMPLE="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == conftest.ROOT
    assert env["TESTKIT_EXAMPLE"] == "1"


def test_outside_a_test_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(conftest, "_running", None)  # as at collection time
    conftest.require_job_marker()


def test_the_backend_fixture_is_keras_backend_with_its_framework_imported(backend):
    assert backend == conftest.BACKEND == os.environ.get("KERAS_BACKEND", "tensorflow")
    assert conftest.FRAMEWORKS[backend] in sys.modules


def test_a_backend_whose_framework_is_missing_skips_and_an_unknown_one_fails(monkeypatch):
    monkeypatch.setitem(conftest.FRAMEWORKS, "absent", "no_such_framework_here")
    with pytest.raises(pytest.skip.Exception, match="KERAS_BACKEND=absent: "
                                                    "no_such_framework_here is not installed"):
        conftest.import_backend("absent")
    with pytest.raises(pytest.fail.Exception, match="KERAS_BACKEND='mxnet' is not a backend this "
                                                    "suite tests; expected one of tensorflow"):
        conftest.import_backend("mxnet")
