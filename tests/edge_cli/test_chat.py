"""ChatSession keeps the conversation, /reset clears it, errors leave it usable."""
import io

from edge_cli.chat import ChatSession
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


def test_hybrid_chat_routes_marks_sources_and_shows_connectivity(native_backend):
    from types import SimpleNamespace

    from cloud_fallback.health import CircuitBreaker
    from edge_runtime.hybrid.runtime import HybridRuntime

    class Recorder(HybridRuntime):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.routes = []

        def stream(self, request):
            self.routes.append(request.route)
            return super().stream(request)

    offline = Recorder(native_backend, None, offline=True)
    session = ChatSession(native_backend, SamplingParams(max_tokens=4), runtime=offline)
    out = io.StringIO()
    session.run(io.StringIO("/route cloud\nHello\n/route sideways\n/status\n/route auto\nHi\n/bogus\n/quit\n"), out)
    text = out.getvalue()
    assert offline.routes == ["cloud", "auto"]
    assert "[route cloud (offline: answers stay on the device)]" in text and "[route cloud; use /route" in text
    assert "[offline; route cloud; 2 messages; sampling: greedy]" in text and "[unknown command /bogus" in text
    assert text.count("[local] ") == 2 and "[cloud]" not in text  # offline: a cloud hint still answers locally
    assert session.connectivity() == "offline"
    assert ChatSession(native_backend, SamplingParams(), runtime=HybridRuntime(native_backend)).connectivity() \
        == "device only"
    health = CircuitBreaker(failures_to_open=1)
    cloudy = HybridRuntime(native_backend, SimpleNamespace(health=health))
    assert ChatSession(native_backend, SamplingParams(), runtime=cloudy).connectivity() == "cloud"
    health.record_failure("unreachable")
    assert ChatSession(native_backend, SamplingParams(), runtime=cloudy).connectivity() == "cloud down"


def test_terminal_chat_answers_a_repeated_question_from_the_cache(tmp_path):
    """`edge-runtime chat` has the response cache in front: a second session asking the same first question
    (greedy) gets the stored answer, marked [cache]; --no-cache generates again."""
    import subprocess
    import sys

    from tests.edge_runtime.server.gateway_fixtures import ROOT

    def chat(*flags):
        p = subprocess.run([sys.executable, "-m", "edge_cli", "chat", "--draft", "none", "--temperature", "0",
                            "--max-tokens", "12", "--cache-path", str(tmp_path / "c.sqlite3"), *flags],
                           input="Name a fruit.\n/quit\n", capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr
        return p
    first, second, fresh = chat(), chat(), chat("--no-cache")
    assert "[local]" in first.stdout and "[route local" in first.stderr
    assert "[cache]" in second.stdout and "[route cache: exact cache hit]" in second.stderr
    answer = first.stdout.split("[local]", 1)[1].split("\n", 1)[0]
    assert answer.strip() and answer in second.stdout and "[local]" in fresh.stdout
