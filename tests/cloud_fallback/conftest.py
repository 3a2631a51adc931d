"""Fixtures shared by the worker tests: a plain worker per module and its answers to PROMPTS run alone.
A module that needs another worker defines its own `worker` fixture, which takes precedence."""
import pytest

from tests.cloud_fallback.worker_fixtures import plain_worker, solo_runs


@pytest.fixture(scope="module")
def worker():
    w = plain_worker()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def solo(worker):
    """The plain worker's answers, each prompt run alone (one stream in flight at a time): (text, token ids,
    done frame)."""
    return solo_runs(worker)
