"""The chat page's markdown, its safety against model output, its kept conversations, copy buttons and
keyboard shortcuts: headless Chromium (page_driver.py) against a real `edge-runtime serve`.

The markup test needs an answer with exact content (markdown, `<script>`, `<img onerror>`, `javascript:`
links) from the real server: the page asks a question once (answered by the model and stored in the
response cache), the test then rewrites that cache entry's stored text in the SQLite file, and the page asks
again: the server replays the rewritten answer as a cache hit, in many small deltas, through the same
/v1/stream path as any answer. So the answer is seeded, the server, the socket and the page are real.
"""
import json
import sqlite3

import httpx
import pytest

from edge_cli.serve_process import ServeProcess
from tests.edge_runtime.server.gateway_fixtures import KEY, ROOT
from tests.edge_runtime.server.page_driver import STORY, answer, api_answer, ask, open_page, screenshot, wait_for

CODE = "print('<script>alert(1)</script>')"
MARKDOWN = (
    "### Steps\n"
    "Use **bold** and *care* with `code`, not snake_case_names.\n\n"
    "- first <b>item</b>\n- second\n\n"
    "1. one\n2. two\n\n"
    f"```python\n{CODE}\n```\n\n"
    "> quoted\n\n"
    "See [the docs](https://example.com/docs) and [click](javascript:window.__xss=1) "
    "<script>window.__xss=2</script> <img src=x onerror=\"window.__xss=3\"> "
    "<a href=\"javascript:window.__xss=4\">link</a> [x](JaVaScRiPt:window.__xss=5) "
    "<svg onload=\"window.__xss=6\"></svg> <iframe src=\"javascript:window.__xss=7\"></iframe>"
)
QUESTION = 'Say hello <img src=x onerror="window.__xss=8">'
CTRL_SHIFT, ALT = 2 | 8, 1


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """A gateway with a response cache file."""
    path = tmp_path_factory.mktemp("cache") / "responses.sqlite3"
    s = ServeProcess(key=KEY, threads=2, cwd=ROOT, cache=str(path))
    yield s, path
    s.stop()


def seed(path, text: str, chunk: int = 5) -> None:
    """Rewrites every stored answer to `text`, in deltas of `chunk` characters (markup split across them)."""
    deltas = [[text[i:i + chunk], [i], "local"] for i in range(0, len(text), chunk)]
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT id, answer FROM entries").fetchall()
        assert rows, "nothing was stored"
        for rid, old in rows:
            db.execute("UPDATE entries SET answer = ? WHERE id = ?",
                       (json.dumps({**json.loads(old), "deltas": deltas}), rid))


def grant_clipboard(browser, g) -> None:
    browser.call("Browser.grantPermissions", origin=g.url,
                 permissions=["clipboardReadWrite", "clipboardSanitizedWrite"])
    browser.call("Emulation.setFocusEmulationEnabled", enabled=True)


def clipboard(browser) -> str:
    return browser.js("navigator.clipboard.readText()")


def test_markdown_is_rendered_and_model_markup_stays_inert_seeded_cache_entry(browser, cached, tmp_path):
    g, path = cached
    assert "script-src 'self'" in httpx.get(g.url + "/").headers["content-security-policy"]
    open_page(browser, g)
    ask(browser, QUESTION, 16)
    cold, _ = answer(browser)
    assert cold["state"] == "done" and {p["source"] for p in cold["parts"]} == {"local"}
    seed(path, MARKDOWN)
    open_page(browser, g)
    browser.js("document.addEventListener('securitypolicyviolation', "
               "(e) => (window.__csp = window.__csp || []).push(e.violatedDirective))")
    ask(browser, QUESTION, 16)
    final, _ = answer(browser)  # a replay is too quick to poll while it streams: the page drew each delta
    assert final["state"] == "done" and final["raw"] == MARKDOWN
    assert {p["source"] for p in final["parts"]} == {"cache"} and "tokens replayed" in final["end"]
    # nothing the model (or the user) wrote ran, or even tried to: no flag, no dialog, no blocked script
    assert browser.js("[window.__xss === undefined, window.__csp === undefined, document.title]") == \
        [True, True, "edge-runtime chat"]
    found = browser.js("""(() => {
        const root = [document.getElementById('log'), document.getElementById('chat-list')];
        const all = root.flatMap((r) => [...r.querySelectorAll('*')]);
        return {tags: all.filter((e) => /^(SCRIPT|IMG|SVG|IFRAME|OBJECT|EMBED|B)$/i.test(e.tagName)).map((e) => e.tagName),
                on: all.filter((e) => [...e.attributes].some((a) => a.name.startsWith('on'))).length,
                links: [...document.querySelectorAll('#log a')].map((a) => [a.getAttribute('href'), a.textContent,
                                                                             a.target, a.rel])};
    })()""")
    assert found == {"tags": [], "on": 0, "links": [["https://example.com/docs", "the docs", "_blank",
                                                     "noopener noreferrer nofollow"]]}
    # the markup is shown as text, and the markdown is rendered
    shown = final["shown"]
    for literal in ("<script>window.__xss=2</script>", '<img src=x onerror="window.__xss=3">',
                    "[click](javascript:window.__xss=1)", "[x](JaVaScRiPt:window.__xss=5)"):
        assert literal in shown, literal
    assert browser.js("document.querySelectorAll('.msg.user .answer')[0].textContent") == QUESTION
    rendered = browser.js("""(() => {
        const m = [...document.querySelectorAll('.msg.assistant .answer')].pop();
        const t = (sel) => [...m.querySelectorAll(sel)].map((e) => e.textContent);
        return {h: t('h3, h4, h5, h6'), strong: t('strong'), em: t('em'), code: t(':not(pre) > code'), ul: t('ul > li'),
                ol: t('ol > li'), pre: t('pre > code[data-lang=python]'), quote: t('blockquote')};
    })()""")
    assert rendered == {"h": ["Steps"], "strong": ["bold"], "em": ["care"], "code": ["code"],
                        "ul": ["first <b>item</b>", "second"], "ol": ["one", "two"], "pre": [CODE],
                        "quote": ["quoted"]}
    browser.call("Emulation.setDeviceMetricsOverride", width=1100, height=820, deviceScaleFactor=1, mobile=False)
    try:  # the conversation list beside the answer, on a laptop-sized window
        screenshot(browser, "chat-page-desktop.png", tmp_path)
    finally:
        browser.call("Emulation.clearDeviceMetricsOverride")
    # copy buttons: the code block's code, and the whole answer as it came (markdown)
    grant_clipboard(browser, g)
    browser.js("[...document.querySelectorAll('.msg.assistant')].pop().querySelector('.copy-code').click()")
    wait_for(lambda: clipboard(browser) == CODE, 10, "the code in the clipboard")
    browser.js("[...document.querySelectorAll('.msg.assistant')].pop().querySelector('.copy-answer').click()")
    wait_for(lambda: clipboard(browser) == MARKDOWN, 10, "the answer in the clipboard")
    assert browser.js("[...document.querySelectorAll('.copy-answer')].pop().dataset.done") == "1"


def titles(browser) -> list[str]:
    return browser.js("[...document.querySelectorAll('#chat-list .open')].map((b) => b.textContent)")


def test_conversations_survive_a_reload_and_are_switched_and_deleted(browser, gw):
    open_page(browser, gw)
    ask(browser, "Name the capital of France.", 8)
    first, _ = answer(browser)
    browser.press("O", "KeyO", 79, CTRL_SHIFT)  # Ctrl+Shift+O: a new chat
    assert browser.js("[chat.messages.length, document.querySelectorAll('#log .msg').length]") == [0, 0]
    ask(browser, "Name a primary colour.", 8)
    second, _ = answer(browser)
    assert first["state"] == second["state"] == "done" and first["raw"] and second["raw"]
    open_page(browser, gw, new_chat=False)  # a reload: the newest conversation is on screen, whole
    assert titles(browser)[:2] == ["Name a primary colour.", "Name the capital of France."]
    shown, _ = answer(browser, timeout=5)
    assert (shown["raw"], shown["end"], shown["parts"]) == (second["raw"], second["end"], second["parts"])
    browser.js("document.querySelectorAll('#chat-list .open')[1].click()")  # switch to the first
    shown, _ = answer(browser, timeout=5)
    assert (shown["raw"], shown["end"], shown["parts"]) == (first["raw"], first["end"], first["parts"])
    assert browser.js("document.querySelector('.msg.user .answer').textContent") == "Name the capital of France."
    browser.press("ArrowUp", "ArrowUp", 38, ALT)  # Alt+Up: the conversation above in the list
    assert browser.js("chat.title") == "Name a primary colour."
    browser.press("ArrowDown", "ArrowDown", 40, ALT)
    assert browser.js("chat.title") == "Name the capital of France."
    browser.js("document.querySelector('#chat-list li .delete').click()")  # delete the newest
    assert titles(browser)[:1] == ["Name the capital of France."]
    open_page(browser, gw, new_chat=False)
    assert "Name a primary colour." not in titles(browser) and titles(browser)[0] == "Name the capital of France."
    stored = browser.js("JSON.parse(localStorage.getItem('edge-runtime.chats')).map((c) => c.title)")
    assert stored == titles(browser)


def test_an_answer_streaming_when_the_page_reloads_is_resumed_whole(browser, gw):
    expected = api_answer(gw, [{"role": "user", "content": STORY}], 160)["choices"][0]["message"]["content"]
    open_page(browser, gw)
    ask(browser, STORY, 160)
    final, _ = answer(browser, midway=lambda: open_page(browser, gw, new_chat=False), after=40)
    assert final["midway"] and final["state"] == "done", final
    assert final["raw"] == expected and final["raw"].startswith(final["midway"])


def test_keyboard_shortcuts_send_stop_focus_and_copy(browser, gw):
    open_page(browser, gw)
    grant_clipboard(browser, gw)
    browser.js("document.getElementById('temperature').value = '0'; document.activeElement.blur()")
    browser.press("/", "Slash", 191, text="/")  # "/" puts the cursor in the question box
    assert browser.js("document.activeElement.id") == "prompt"
    assert browser.js("document.getElementById('prompt').value") == ""
    browser.call("Input.insertText", text=STORY)
    browser.js("document.getElementById('max-tokens').value = '400'")
    browser.press("Enter", "Enter", 13, text="\r")  # Enter sends
    final, _ = answer(browser, midway=lambda: browser.press("Escape", "Escape", 27))  # Esc stops
    assert final["midway"] and final["state"] == "cancelled" and final["raw"]
    assert browser.js("chat.messages.map((m) => m.role)") == ["user", "assistant"]
    browser.press("C", "KeyC", 67, CTRL_SHIFT)  # Ctrl+Shift+C copies the last answer
    wait_for(lambda: clipboard(browser) == final["raw"], 10, "the last answer in the clipboard")


def test_the_pages_files_are_served_with_their_policy_and_nothing_else_is(gw):
    for name, kind in (("chat.js", "text/javascript"), ("markdown.js", "text/javascript"), ("chat.css", "text/css")):
        r = httpx.get(f"{gw.url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.text) > 500, name
        assert r.headers["x-content-type-options"] == "nosniff"
    for name in ("index.html", "nope.js", "..%2Fapp.py", "%2E%2E%2F%2E%2E%2Fcache%2Fstore.py"):
        assert httpx.get(f"{gw.url}/static/{name}").status_code == 404, name
