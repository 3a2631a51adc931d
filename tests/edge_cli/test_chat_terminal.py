"""`edge-runtime chat` in a pseudo-terminal on the real model, as a person types into it: the summary line,
/save and /load, input over several lines, and what it says instead of a silent wait."""
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from tests.edge_cli.test_main import ROOT

SUMMARY = re.compile(r"\[(\d+) tokens · first token (\d+) ms · ([\d.]+) tok/s · ([a-z >-]+) · (\d+) hand-offs?\]")


class Terminal:
    def __init__(self, *args: str):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "edge_cli", "chat", "--draft", "none", "--temperature", "0",
                                      "--no-cache", *args], stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                                     start_new_session=True)
        os.close(slave)
        self.master, self.seen = master, ""

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def until(self, pattern: str, timeout: float = 240) -> str:
        """Everything read up to and including the first match of `pattern` after what earlier calls consumed."""
        deadline = time.time() + timeout
        while not (m := re.search(pattern, self.seen)):
            if time.time() > deadline:
                raise AssertionError(f"no {pattern!r} in {self.seen[-2000:]!r}")
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace").replace("\r\n", "\n")
                except OSError:
                    break
        out, self.seen = self.seen[:m.end()], self.seen[m.end():]
        return out

    def close(self) -> None:
        self.send("/quit\n")
        try:
            self.proc.wait(30)
        finally:
            self.proc.kill()
            os.close(self.master)


@pytest.fixture
def term():
    terms = []
    yield lambda *a: terms.append(Terminal(*a)) or terms[-1]
    for t in terms:
        t.close()


def test_each_answer_ends_with_a_summary_line(term):
    t = term("--max-tokens", "12")
    t.until(r"\(device only\) > ")
    t.send("Name a fruit.\n")
    m = re.search(SUMMARY, t.until(SUMMARY.pattern))
    assert 1 <= int(m.group(1)) <= 12 and int(m.group(2)) > 0 and float(m.group(3)) >= 0
    assert m.group(4) == "local" and m.group(5) == "0"


def test_save_and_load_round_trip_and_several_lines_of_input(term, tmp_path):
    path = tmp_path / "talk.json"
    t = term("--max-tokens", "8")
    t.until(r"> ")
    t.send('"""\nfirst line\nsecond line\n"""\n')
    t.until(SUMMARY.pattern)
    t.send("and a third \\\nline\n")
    t.until(SUMMARY.pattern)
    t.send(f"/save {path}\n")
    t.until(r"\[saved 4 messages to .*\]")
    saved = json.loads(path.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2
    assert saved["messages"][0]["content"] == "first line\nsecond line"
    assert saved["messages"][2]["content"] == "and a third \nline"
    t.send("/reset\n/status\n")
    t.until(r"\[device only; route auto; 0 messages; sampling: greedy\]")
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard", "content": 1}]}')
    t.send(f"/load {tmp_path / 'bad.json'}\n/load {tmp_path / 'missing.json'}\n/status\n")
    t.until(r"\[cannot load .*bad\.json: expected")
    t.until(r"\[cannot load .*missing\.json: No such file")
    t.until(r"0 messages; sampling")  # a bad file changes nothing
    t.send(f"/load {path}\n/status\n")
    t.until(r"\[loaded 4 messages from .*\]")
    t.until(r"4 messages; sampling")
    t.send("Thanks.\n")
    t.until(SUMMARY.pattern)
    t.send(f"/save {path}\n")
    t.until(r"\[saved 6 messages")
    again = json.loads(path.read_text())["messages"]
    assert again[:4] == saved["messages"] and again[4]["content"] == "Thanks."


def test_a_cloud_that_is_down_is_said_and_the_device_answers(term, tmp_path):
    token = tmp_path / "token"
    token.write_text("secret")
    t = term("--max-tokens", "6", "--cloud", "ws://127.0.0.1:9", "--cloud-token-file", str(token), "--route", "cloud")
    t.until(r"\) > ")
    t.send("Name a colour.\n")
    out = t.until(SUMMARY.pattern)
    assert re.search(r"\[cloud down: cloud unreachable .*; the device answers\] \[local\]", out), out


def test_a_long_wait_for_the_first_token_is_said(term, tmp_path):
    """A conversation of about 1,500 tokens takes well over 0.2 s to read before the first token."""
    history = [{"role": r, "content": " ".join(["The quick brown fox jumps over the lazy dog."] * 15)}
               for r in ("user", "assistant") * 6]
    (tmp_path / "long.json").write_text(json.dumps({"messages": history}))
    t = term("--max-tokens", "4", "--busy-notice", "0.2")
    t.until(r"> ")
    t.send(f"/load {tmp_path / 'long.json'}\n")
    t.until(r"\[loaded 12 messages")
    t.send("Summarize.\n")
    out = t.until(SUMMARY.pattern)
    assert "[no token yet after 0.2 s: the device is busy (a long prompt, or the machine is loaded)]" in out
