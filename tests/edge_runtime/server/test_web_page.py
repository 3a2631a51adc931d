"""The chat page at / in a real headless Chromium (page_driver.py), against real `edge-runtime serve` processes.

The page sends `params: {max_tokens, temperature}` from its settings row; the tests set temperature 0, so its
answer is the greedy one: it must equal the gateway's own /v1/chat/completions answer at temperature 0.

Checked: on load the header shows the device and cloud state from /health and the settings the server's
sampling defaults (the tests then type temperature 0); text arrives progressively, in spans with data-source="local", equal to the API's answer, with
the route and its reason shown; the API key goes in `hello` (a wrong one is reported); Stop cancels; a
dropped page connection is reopened and resumed with nothing lost or repeated; with a cloud worker and
route=cloud the spans say cloud; and SIGKILLing the worker mid-answer shows a .handoff marker
(cloud -> local) followed by local spans, the whole still the greedy answer.
The module skips when no chromium binary is found.
"""
import json
import os
import re

import httpx
import pytest

from cloud_fallback.launcher import WorkerProcess
from tests.edge_runtime.server.gateway_fixtures import Gateway
from tests.edge_runtime.server.page_driver import STORY, answer, api_answer, ask, open_page, screenshot, wait_for


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """A worker and a gateway that uses it. The hand-off test kills the worker: it runs last."""
    w = WorkerProcess()
    token = tmp_path_factory.mktemp("tok") / "token"
    token.write_text(w.token)
    try:
        g = Gateway("--cloud", w.url, "--cloud-token-file", str(token))
    except BaseException:
        w.stop()
        raise
    yield w, g
    g.stop()
    w.stop()


def test_the_answer_streams_in_local_spans_and_equals_the_greedy_api_answer(browser, gw):
    question = "Explain how a rainbow forms."
    expected = api_answer(gw, [{"role": "user", "content": question}], 40)
    open_page(browser, gw)
    health = httpx.get(gw.url + "/health").json()
    d = health["sampling_defaults"]
    # on load: the device and cloud state, and the server's sampling defaults in the settings (not greedy)
    wait_for(lambda: browser.js("document.getElementById('state').textContent").startswith("device: "), 30, "state")
    assert "device only" in browser.js("document.getElementById('state').textContent")
    wait_for(lambda: float(browser.js("document.getElementById('temperature').value")) == d["temperature"], 30,
             "the default temperature")
    note = browser.js("document.getElementById('sampling-note').textContent")
    assert d["source"] in note and f"top-k {d['top_k']}" in note and d["temperature"] > 0
    ask(browser, question, 40)
    final, seen = answer(browser)
    assert final["state"] == "done", final
    assert final["text"] == expected["choices"][0]["message"]["content"]
    assert len(seen) >= 3 and len(seen[0]) < len(final["text"]), seen  # the text grew over several polls ...
    assert all(b.startswith(a) and b != a for a, b in zip(seen, seen[1:])) and final["text"].startswith(seen[-1])
    assert {p.get("source") for p in final["parts"]} == {"local"}
    assert final["route"].startswith("route: local (") and expected["x_hybrid"]["route_reason"] in final["route"]
    assert f"{expected['usage']['completion_tokens']} tokens" in final["end"]
    m = re.search(r"first token (\d+) ms · ([\d.]+) tok/s · local · 0 hand-offs", final["end"])
    assert m and int(m[1]) > 0 and float(m[2]) > 0, final["end"]  # the answer's own figures, under it
    assert browser.js("document.querySelectorAll('.msg.user .answer')[0].textContent") == question


def _luminance(css_color: str) -> float:
    r, g, b = (int(x) for x in re.findall(r"\d+", css_color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_a_phone_sized_window_and_the_systems_dark_mode(browser, gw, tmp_path):
    """At 390 px wide nothing scrolls sideways, a long answer included; with the system in dark mode the page
    is dark and keeps its contrast. Screenshots of both go to tmp (and to $EDGE_RUNTIME_SCREENSHOTS if set)."""
    try:
        for scheme in ("light", "dark"):
            browser.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": scheme}])
            browser.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
            open_page(browser, gw)
            wait_for(lambda: browser.js("document.getElementById('state').textContent").startswith("device: "), 30,
                     "state")
            ask(browser, "Explain how a rainbow forms.", 60)
            final, _ = answer(browser)
            assert final["state"] == "done" and final["text"]
            screenshot(browser, f"chat-page-{scheme}.png", tmp_path)
            browser.js("document.querySelector('.msg.assistant .answer [data-source]').textContent += "
                       "' ' + 'x'.repeat(300)")  # an unbroken word, as code or a URL would be
            width = browser.js("[document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], width
            # the conversations are a menu here: hidden until the button opens them
            assert browser.js("getComputedStyle(document.getElementById('chats')).display") == "none"
            browser.js("document.getElementById('toggle-chats').click()")
            assert browser.js("getComputedStyle(document.getElementById('chats')).display") == "flex"
            assert browser.js("document.querySelector('#chat-list .open').textContent") == "Explain how a rainbow forms."
            assert browser.js("document.getElementById('chats').getBoundingClientRect().right <= innerWidth")
            browser.js("document.querySelector('#chat-list .open').click()")  # choosing one closes the menu
            assert browser.js("getComputedStyle(document.getElementById('chats')).display") == "none"
            bg = browser.js("getComputedStyle(document.body).backgroundColor")
            fg = browser.js("getComputedStyle(document.body).color")
            assert (_luminance(bg) < 0.2) == (scheme == "dark") and abs(_luminance(bg) - _luminance(fg)) > 0.6, (bg, fg)
    finally:
        browser.call("Emulation.clearDeviceMetricsOverride")
        browser.call("Emulation.setEmulatedMedia", features=[])


def test_the_conversation_is_kept_and_stop_cancels(browser, gw):
    open_page(browser, gw)
    ask(browser, "Name the capital of France.", 12)
    first, _ = answer(browser)
    ask(browser, STORY, 400)
    final, _ = answer(browser, midway=lambda: browser.js("document.getElementById('stop').click()"))
    assert first["state"] == "done" and "Paris" in first["text"] and final["midway"]
    assert final["state"] == "cancelled" and "cancelled" in final["end"] and final["text"]
    roles = browser.js("chat.messages.map((m) => m.role)")
    assert roles == ["user", "assistant", "user", "assistant"]
    assert browser.js("document.getElementById('send').disabled") is False


def test_a_dropped_connection_is_resumed_with_nothing_lost_or_repeated(browser, gw):
    question = "Describe, step by step, how to bake bread at home."
    expected = api_answer(gw, [{"role": "user", "content": question}], 80)["choices"][0]["message"]["content"]
    open_page(browser, gw)
    ask(browser, question, 80)
    final, _ = answer(browser, midway=lambda: browser.js("window.oldSocket = ws; ws.close()"))  # the page sees it go
    assert final["midway"] and len(final["midway"]) < len(final["text"])
    assert final["state"] == "done" and final["text"] == expected
    assert browser.js("ws !== null && ws !== window.oldSocket && ws.readyState === WebSocket.OPEN")


def test_a_wrong_api_key_is_reported(browser, gw):
    open_page(browser, gw)
    ask(browser, "Hello?", 4, key="wrong")
    final, _ = answer(browser, timeout=30)
    assert final["state"] == "error" and "unauthorized" in final["status"] and not final["text"]


def test_route_cloud_shows_cloud_spans(browser, cloud):
    _, g = cloud
    question = "Name the capital of France."
    expected = api_answer(g, [{"role": "user", "content": question}], 24, route="cloud")
    assert expected["x_hybrid"]["route"] == "cloud"
    open_page(browser, g)
    ask(browser, question, 24, route="cloud")
    final, _ = answer(browser)
    assert final["state"] == "done" and final["text"] == expected["choices"][0]["message"]["content"]
    assert {p.get("source") for p in final["parts"]} == {"cloud"} and not any("handoff" in p for p in final["parts"])
    assert final["route"].startswith("route: cloud (") and "cloud" in final["route"][len("route: cloud ("):]


def test_killing_the_worker_mid_answer_shows_a_handoff_then_local_spans(browser, cloud):
    worker, g = cloud
    expected = api_answer(g, [{"role": "user", "content": STORY}], 200, route="local")["choices"][0]["message"]
    open_page(browser, g)
    ask(browser, STORY, 200, route="cloud")
    final, _ = answer(browser, midway=worker.kill)
    assert final["midway"] and final["state"] == "done", final
    kinds = [("handoff", p["from"], p["to"]) if "handoff" in p else p["source"] for p in final["parts"]]
    assert kinds[0] == "cloud" and ("handoff", "cloud", "local") in kinds, kinds
    after = kinds[kinds.index(("handoff", "cloud", "local")) + 1:]
    assert after and set(after) == {"local"}, kinds
    assert "cloud \u2192 local · 1 hand-off" in final["end"], final["end"]
    marker = next(p for p in final["parts"] if "handoff" in p)
    assert marker["handoff"].startswith("cloud \u2192 local: ") and len(marker["handoff"]) > len("cloud → local: ")
    # the device continued from exactly the cloud's text: the whole is still the greedy answer
    assert final["text"] == expected["content"]
