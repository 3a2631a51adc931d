"""ChatSession keeps the conversation, /reset clears it, errors leave it usable."""
import io

from edge_runtime.chat import ChatSession
from edge_runtime.request import SamplingParams


class Spy:
    """Wraps a real backend and records the messages of each request."""

    def __init__(self, backend):
        self.backend, self.name, self.seen = backend, backend.name, []

    def stream_sync(self, request, cancel=None):
        self.seen.append([dict(m) for m in request.messages])
        return self.backend.stream_sync(request, cancel)


def test_history_is_kept_and_reset_clears_it(native_backend):
    spy = Spy(native_backend)
    session = ChatSession(spy, SamplingParams(max_tokens=8))
    out = io.StringIO()
    session.run(io.StringIO("My name is Ada.\nWhat is my name?\n/reset\nHello\n/quit\n"), out)
    first, second, third = spy.seen
    assert [m["role"] for m in first] == ["user"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0]["content"] == "My name is Ada." and second[1]["content"]  # the streamed answer
    assert second[1]["content"] in out.getvalue()
    assert third == [{"role": "user", "content": "Hello"}] and "[history cleared]" in out.getvalue()


def test_too_long_message_reports_error_and_keeps_going(model_path):
    from edge_runtime.backends.native import NativeBackend

    small = NativeBackend(model_path, n_ctx=48, compile=False)
    session = ChatSession(small, SamplingParams(max_tokens=4))
    out = io.StringIO()
    session.run(io.StringIO("word " * 80 + "\nHi\n/quit\n"), out)
    text = out.getvalue()
    assert "[error: prompt is" in text and "context window is 48" in text
    assert [m["role"] for m in session.messages] == ["user", "assistant"]  # the failed turn was dropped
