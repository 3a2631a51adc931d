"""bench spec's llama.cpp rows come from a worker process of its own (real llama.cpp, real subprocess)."""
import pytest

from edge_cli.bench.spec import LlamaWorker, Tally, _Rows, _run
from edge_runtime.errors import EdgeRuntimeError

PROMPT = "Name three colours of the rainbow."


def test_llama_worker_gives_llama_cpps_own_answer_from_another_process(model_path, llama_backend):
    worker = LlamaWorker(model_path, 2)
    try:
        there, here = Tally(), Tally()
        _run(_Rows(worker), "none", None, PROMPT, 12, there)
        _run(llama_backend, "none", None, PROMPT, 12, here)
        assert there.ids == here.ids and len(there.ids[0]) == 12  # greedy: the same tokens in both processes
        assert there.tokens == 11 and there.seconds > 0  # the decode time after the first token came back
        assert worker.proc.pid != __import__("os").getpid() and worker.proc.poll() is None
        with pytest.raises(EdgeRuntimeError, match="llama.cpp worker"):  # a bad request: a clear error ...
            _run(_Rows(worker), "mtp", None, PROMPT, 12, Tally())  # MTP needs the native engine
        _run(_Rows(worker), "none", None, PROMPT, 12, there)  # ... and the worker goes on
        assert there.ids[1] == here.ids[0]
    finally:
        worker.close()
    assert worker.proc.returncode == 0
