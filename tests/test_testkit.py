"""The suite's own machinery (tests/conftest.py): the `job` marker's guard and its helpers."""

import os

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
    env = conftest.job_env(MGPU_EXAMPLE="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == conftest.ROOT
    assert (env["OMPI_ALLOW_RUN_AS_ROOT"], env["MGPU_EXAMPLE"]) == ("1", "1")


def test_a_process_that_is_no_job_needs_no_marker():
    env = conftest.python_env(MGPU_EXAMPLE="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == conftest.ROOT
    assert env["MGPU_EXAMPLE"] == "1"


def test_outside_a_test_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(conftest, "_running", None)  # as at collection time
    conftest.require_job_marker()
