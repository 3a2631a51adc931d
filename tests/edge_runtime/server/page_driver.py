"""Drives the chat page at / in a real headless Chromium over the Chrome DevTools Protocol.

Chromium (Debian's `chromium`; $CHROMIUM names another binary) is driven with the `websockets` package:
the tests type a question, click Send and poll the DOM. `ask` types temperature 0 over the server's
default, so an answer can be compared with the gateway's own greedy /v1/chat/completions answer.
"""
import base64
import json
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
from websockets.sync.client import connect

from tests.edge_runtime.server.gateway_fixtures import KEY, stop_group

STORY = "Write a very long story about a dragon who learns to paint."


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """Headless Chromium with one page, attached over a flat CDP session."""

    def __init__(self, binary: str, profile: str):
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}", "--no-sandbox",
             "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-dev-shm-usage", "--no-proxy-server", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stderr: list[str] = []
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.stderr.append(line)
                if "DevTools listening on ws://" in line:
                    found.set()
        threading.Thread(target=read, daemon=True).start()
        if not found.wait(60):
            self.close()
            raise RuntimeError("chromium did not start: " + "".join(self.stderr)[-2000:])
        url = re.search(r"DevTools listening on (ws://\S+)", "".join(self.stderr))[1]
        # NOTE: entered as a context manager (closed in close()): websockets >= 17 warns otherwise
        self.ws = connect(url, max_size=None, proxy=None, open_timeout=30).__enter__()
        self.last_id, self.session = 0, None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, timeout: float = 30, **params):
        """A command to the page's session (a `Browser.` or `Target.` one goes to the browser itself)."""
        self.last_id += 1
        msg = {"id": self.last_id, "method": method, "params": params}
        if self.session and not method.startswith(("Browser.", "Target.")):
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:  # events (none enabled but target ones) are skipped
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def press(self, key: str, code: str, vk: int, modifiers: int = 0, text: str | None = None) -> None:
        """A key pressed and released (modifiers: Alt 1, Ctrl 2, Meta 4, Shift 8)."""
        keys = {"key": key, "code": code, "windowsVirtualKeyCode": vk, "modifiers": modifiers}
        self.call("Input.dispatchKeyEvent", type="keyDown", **keys,
                  **({"text": text} if text else {}))
        self.call("Input.dispatchKeyEvent", type="keyUp", **keys)

    def close(self):
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        stop_group(self.proc, 10)


def wait_for(check, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def api_answer(g, messages, max_tokens, route="auto") -> dict:
    r = httpx.post(g.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                   json={"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                         "route": route})
    assert r.status_code == 200, r.text
    return r.json()


def open_page(b: Browser, g, new_chat: bool = True) -> None:
    """Loads the page; it shows the last conversation kept in the browser, so by default a new one is begun
    (an answer is then the same as the API's to the question alone)."""
    b.call("Page.navigate", url=g.url + "/")
    url = json.dumps(g.url + "/")
    wait_for(lambda: b.js(f"location.href === {url} && document.readyState === 'complete' && "
                          f"typeof chat !== 'undefined' && !!chat"), 30, "the page")
    if new_chat:
        b.js("newChat()")


def ask(b: Browser, question: str, max_tokens: int, route: str = "auto", key: str = KEY) -> None:
    """Greedy (temperature 0 typed over the server's default), so the answer can be compared with the API's."""
    b.js(f"""(() => {{
        const t = document.getElementById('temperature');
        t.value = '0'; t.dispatchEvent(new Event('input'));
        document.getElementById('route').value = {json.dumps(route)};
        document.getElementById('max-tokens').value = '{max_tokens}';
        const k = document.getElementById('api-key');
        k.value = {json.dumps(key)}; k.dispatchEvent(new Event('change'));
        document.getElementById('prompt').focus(); }})()""")
    b.call("Input.insertText", text=question)  # typed, as a keyboard would
    b.js("document.getElementById('send').click()")


SNAPSHOT = """(() => {
    const m = [...document.querySelectorAll('.msg.assistant')].pop();
    if (!m) return null;
    const parts = [...m.querySelectorAll('.answer [data-source], .answer .handoff')].map((e) =>
        e.classList.contains('handoff') ? {handoff: e.textContent, from: e.dataset.from, to: e.dataset.to}
                                        : {source: e.dataset.source, text: e.textContent});
    const msg = chat.messages.find((x) => x.id === m.dataset.mid);
    return {state: m.dataset.state, route: m.querySelector('.route').textContent, parts,
            end: m.querySelector('.end').textContent, status: document.getElementById('status').textContent,
            raw: msg ? msg.content : '', shown: m.querySelector('.answer').textContent};
})()"""


def answer(b: Browser, midway=None, after: int = 20, timeout=240.0):
    """Poll the last answer until it ends: (final snapshot, texts seen while streaming).
    `midway()` runs once, when the answer has more than `after` characters (to stop, drop, reload or kill
    something mid-answer); the final snapshot's "midway" is the text it had then (None: it ended first)."""
    seen, ran, deadline = [], None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = b.js(SNAPSHOT)
        if snap is not None:
            snap["text"] = snap["raw"]  # the answer's markdown as it came; `parts` and `shown` are the rendering
            if snap["state"] != "streaming":
                return {**snap, "midway": ran}, seen
            if snap["text"] and (not seen or seen[-1] != snap["text"]):
                seen.append(snap["text"])
            if midway is not None and ran is None and len(snap["text"]) > after:
                ran = snap["text"]
                midway()
        time.sleep(0.02)
    raise AssertionError(f"the answer did not end: {b.js(SNAPSHOT)}")


def screenshot(b: Browser, name: str, folder) -> None:
    """A PNG of the page into `folder`, and into $EDGE_RUNTIME_SCREENSHOTS if set (the README's come from there)."""
    png = base64.b64decode(b.call("Page.captureScreenshot", format="png")["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for where in [folder] + ([os.environ["EDGE_RUNTIME_SCREENSHOTS"]] if os.environ.get("EDGE_RUNTIME_SCREENSHOTS") else []):
        with open(os.path.join(where, name), "wb") as f:
            f.write(png)
