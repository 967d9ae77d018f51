"""The chat page at `/` (issue 33), in a real browser: headless Chromium driven by Selenium against
`lily-engine serve`, mostly on the scripted backend (fixed replies: reasoning, Markdown, an HTML
injection, a long answer to stop) and once on the synthetic `small` model on the CPU.

Needs Debian's `chromium` and `chromium-driver` (scripts/test.sh installs them in CI) and the
`selenium` package; without a browser the tests skip here and fail in CI. A screenshot of the page
after an answer is saved to target/webui-screenshot.png (CI keeps it; docs/webui.png is a copy).
"""

import json
import os
import re
import shutil
import time

import httpx
import pytest

from conftest import Server, target_dir

IN_CI = os.environ.get("CI") in ("true", "1")


def _missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -r scripts/requirements-pytest.txt)"
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "no chromium / chromedriver (apt-get install chromium chromium-driver)"
    return None


if (_why := _missing()) is not None:
    if IN_CI:
        pytest.fail(f"CI runs the browser tests: {_why}", pytrace=False)
    pytest.skip(_why, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait as _Wait  # noqa: E402

THINK = "Thinking it over.\n</think>\n\n"
INJECTION = "Look: <img src=x onerror=\"document.title='pwned'\"> and <script>document.title='pwned2'</script> end."
SCRIPT = {
    "replies": [
        {"when": "riddle", "text": "Let me think step by step.\n</think>\n\nThe answer is **42**."},
        {"when": "code please", "text": THINK + "Here it is:\n\n```python\nprint(\"hi\")\n```\n\n- one\n- *two*"},
        {"when": "inject", "text": THINK + INJECTION},
        {"when": "count", "text": THINK + " ".join(f"n{i}" for i in range(60))},
        {"when": "story", "text": THINK + " ".join(f"word{i}" for i in range(1500))},
    ],
    "default": THINK + "Hello! How can I help?",
}
SCREENSHOT = target_dir() / "webui-screenshot.png"


def scripted(tmp_path_factory, small_model, **extra) -> str:
    path = tmp_path_factory.mktemp("webui") / "script.json"
    path.write_text(json.dumps({"tokenizer": str(small_model), **SCRIPT, **extra}))
    return f"scripted:{path}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model):
    # 20 ms a token: an answer streams visibly, and the long one runs long enough to be stopped.
    s = Server(scripted(tmp_path_factory, small_model, delay_ms=20), "--ctx-size", "4096").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,850", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def WebDriverWait(browser, timeout):  # noqa: N802
    """Selenium's wait, also through a streaming answer's redraws (which replace its elements)."""
    return _Wait(browser, timeout, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException])


def open_page(browser, server) -> None:
    """The page, fresh: no conversation or key left by an earlier test."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "input").is_enabled())


def console_errors(browser, allow=()) -> list[str]:
    """The browser's SEVERE console entries since the last call, less those matching `allow`."""
    return [e["message"] for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def ask(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text + Keys.ENTER)


def answers(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def wait_answered(browser, count: int, timeout: float = 20):
    """The `count`-th answer once it has finished (its stats line is there); returns its element."""
    WebDriverWait(browser, timeout).until(
        lambda b: len(answers(b)) >= count and not answers(b)[count - 1].get_attribute("class").endswith("pending")
        and b.find_element(By.ID, "stop").get_attribute("hidden") is not None)
    return answers(browser)[count - 1]


def metric(server, name: str) -> float:
    return server.metrics()[name]


def test_the_page_loads_clean_and_an_answer_streams_in_with_its_numbers(browser, server):
    open_page(browser, server)
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "model-name").text)
    assert browser.title == "Lily"
    # Shift+Enter breaks the line and sends nothing; Enter sends.
    box = browser.find_element(By.ID, "input")
    box.send_keys("please")
    ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    box.send_keys("count")
    assert box.get_attribute("value") == "please\ncount"
    assert not answers(browser)
    box.send_keys(Keys.ENTER)
    # Watch the answer grow: several different partial texts before the end.
    seen, deadline = set(), time.time() + 20
    while time.time() < deadline:
        shown = browser.execute_script(
            "const a = document.querySelector('#messages .msg.assistant .text'); return a ? a.textContent : null")
        if shown:
            seen.add(shown)
        if shown and shown.endswith("n59"):
            break
        time.sleep(0.02)
    assert len(seen) >= 3, f"the answer did not stream in: {len(seen)} different texts seen"
    answer = wait_answered(browser, 1)
    assert answer.find_element(By.CSS_SELECTOR, ".text").text == " ".join(f"n{i}" for i in range(60))
    user = browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .text")
    assert user.text == "please\ncount"
    # Thinking: folded once the answer started, dimmed, and opens on a click.
    thinking = answer.find_element(By.CSS_SELECTOR, "details.thinking")
    assert thinking.get_attribute("open") is None
    thinking.find_element(By.TAG_NAME, "summary").click()
    assert answer.find_element(By.CSS_SELECTOR, ".reasoning").text == "Thinking it over."
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.fullmatch(r"\d+ tokens · TTFT \d+\.\d\d s · \d+\.\d tok/s · prompt \d+.*", stats), stats
    usage_tokens = int(stats.split()[0])
    assert usage_tokens > 60  # every word is a token at least, plus the thinking and the end
    assert console_errors(browser) == []


def test_markdown_renders_and_html_in_an_answer_is_only_text(browser, server):
    open_page(browser, server)
    ask(browser, "Some code please")
    answer = wait_answered(browser, 1)
    code = answer.find_element(By.CSS_SELECTOR, ".codeblock pre code")
    assert code.text == 'print("hi")'
    assert answer.find_element(By.CSS_SELECTOR, ".codeblock .code-head").text.startswith("python")
    assert answer.find_element(By.CSS_SELECTOR, ".codeblock button.copy").text == "Copy"
    items = answer.find_elements(By.CSS_SELECTOR, "ul li")
    assert [li.text for li in items] == ["one", "two"]
    assert answer.find_element(By.CSS_SELECTOR, "ul li em").text == "two"
    ask(browser, "A riddle?")
    answer = wait_answered(browser, 2)
    assert answer.find_element(By.CSS_SELECTOR, ".text strong").text == "42"
    answer.find_element(By.CSS_SELECTOR, "details.thinking summary").click()  # for the picture
    time.sleep(0.2)
    browser.execute_script("const m = document.getElementById('messages'); m.scrollTop = m.scrollHeight")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))

    ask(browser, "inject something")
    answer = wait_answered(browser, 3)
    assert answer.find_element(By.CSS_SELECTOR, ".text").text == INJECTION
    assert browser.find_elements(By.CSS_SELECTOR, "#messages img, #messages script") == []
    assert browser.title == "Lily"
    # A user's message is text too.
    ask(browser, "<img src=x onerror=\"document.title='mine'\"> inject")
    wait_answered(browser, 4)
    assert browser.find_elements(By.CSS_SELECTOR, "#messages img") == []
    assert browser.title == "Lily"
    assert console_errors(browser) == []


# Markdown and the HTML CommonMark / GFM make of it (written out by hand from their specs), except
# where the page is stricter on purpose: only http(s) links become links, and links open elsewhere.
LINK = ' target="_blank" rel="noopener noreferrer"'
MARKDOWN = [
    ("# Title\n\nSome *em* and **strong** and `code <b>`",
     "<h1>Title</h1><p>Some <em>em</em> and <strong>strong</strong> and <code>code &lt;b&gt;</code></p>"),
    ("<script>alert(1)</script> & <img src=x onerror=alert(1)>",
     "<p>&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;img src=x onerror=alert(1)&gt;</p>"),
    ("[x](javascript:alert(1)) [site](https://example.com/a?b=1) https://example.org/x.",
     f'<p>[x](javascript:alert(1)) <a href="https://example.com/a?b=1"{LINK}>site</a> '
     f'<a href="https://example.org/x"{LINK}>https://example.org/x</a>.</p>'),
    ("| a | b |\n|---|---|\n| 1 | **2** |",
     "<table><thead><tr><th>a</th><th>b</th></tr></thead>"
     "<tbody><tr><td>1</td><td><strong>2</strong></td></tr></tbody></table>"),
    ("- a\n  - b\n- c\n\n3. three\n4. four",
     '<ul><li>a<ul><li>b</li></ul></li><li>c</li></ul><ol start="3"><li>three</li><li>four</li></ol>'),
    ("> quote\n> more\n\npara\nline two", "<blockquote><p>quote\nmore</p></blockquote><p>para\nline two</p>"),
    ("snake_case_name _it_ __b__ ~~s~~ a * b * c",
     "<p>snake_case_name <em>it</em> <strong>b</strong> <del>s</del> a * b * c</p>"),
    ("---\n## H2 ##\ntext", "<hr><h2>H2</h2><p>text</p>"),
]


def test_the_markdown_renderer_builds_elements_and_never_markup(browser, server):
    open_page(browser, server)
    render = "const box = document.createElement('div'); box.appendChild(LilyMarkdown.render(arguments[0]));" \
             " return box.innerHTML"
    for markdown, html in MARKDOWN:
        assert browser.execute_script(render, markdown) == html, markdown
    # A code block keeps its text exactly, even one still open (an answer streaming); a copy button.
    code = browser.execute_script(
        "const f = LilyMarkdown.render(arguments[0]);"
        " return Array.from(f.querySelectorAll('.codeblock')).map(b => ["
        "b.querySelector('.code-head span').textContent, b.querySelector('pre code').textContent,"
        " b.querySelectorAll('button.copy').length])",
        "```js\nlet a = '<b>';\n\n```\ntext\n~~~\nunclosed <i>")
    assert code == [["js", "let a = '<b>';\n", 1], ["code", "unclosed <i>", 1]]


def test_stop_ends_the_answer_within_a_second_and_the_engine_frees_it(browser, server):
    open_page(browser, server)
    ask(browser, "a long story")
    WebDriverWait(browser, 10).until(lambda b: any("word3" in a.text for a in answers(b)))
    assert metric(server, "lily_requests_running") == 1
    stopped = time.monotonic()
    browser.find_element(By.ID, "stop").click()
    answer = wait_answered(browser, 1, timeout=1)
    assert answer.find_element(By.CSS_SELECTOR, ".note").text == "Stopped."
    partial = answer.find_element(By.CSS_SELECTOR, ".text").text
    assert partial.startswith("word0 word1") and "word1499" not in partial
    while metric(server, "lily_requests_running") != 0:
        assert time.monotonic() - stopped < 1.0, "the engine still runs the stopped request"
        time.sleep(0.02)
    assert metric(server, "lily_queue_depth") == 0
    # The page is ready for the next message (the newest trigger word picks the scripted reply).
    ask(browser, "now count")
    assert wait_answered(browser, 2).find_element(By.CSS_SELECTOR, ".text").text.endswith("n58 n59")
    assert console_errors(browser) == []


def test_a_reload_keeps_the_conversation_and_the_settings(browser, server):
    open_page(browser, server)
    browser.find_element(By.ID, "settings-toggle").click()
    browser.find_element(By.ID, "system-prompt").send_keys("Be brief.")
    browser.find_element(By.ID, "temperature").send_keys("0.5")
    ask(browser, "hello there")
    first = wait_answered(browser, 1).text
    browser.refresh()
    WebDriverWait(browser, 10).until(lambda b: len(answers(b)) == 1)
    assert answers(browser)[0].text == first
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.user").text.endswith("hello there")
    assert browser.find_element(By.ID, "system-prompt").get_attribute("value") == "Be brief."
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.5"
    # New conversation empties it, for good.
    browser.find_element(By.ID, "new-chat").click()
    assert answers(browser) == []
    browser.refresh()
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "input"))
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
    assert console_errors(browser) == []


def test_with_an_api_key_the_page_asks_for_it_and_shows_a_wrong_one_refused(
        browser, tmp_path_factory, small_model):
    server = Server(scripted(tmp_path_factory, small_model), api_key="sekrit").wait_ready()
    try:
        browser.get(server.url + "/")  # the page itself needs no key
        dialog = browser.find_element(By.ID, "key-dialog")
        WebDriverWait(browser, 10).until(lambda b: dialog.is_displayed())
        key = browser.find_element(By.ID, "key-input")
        key.send_keys("wrong" + Keys.ENTER)
        error = browser.find_element(By.ID, "key-error")
        WebDriverWait(browser, 10).until(lambda b: "401" in error.text)
        assert "incorrect API key" in error.text
        assert dialog.is_displayed()
        key.send_keys("sekrit" + Keys.ENTER)
        WebDriverWait(browser, 10).until(lambda b: not dialog.is_displayed())
        ask(browser, "hello")
        assert "How can I help?" in wait_answered(browser, 1).text
        # The key travels in a header, never in a URL; it stays for the next visit.
        browser.refresh()
        WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "model-name").text)
        assert not browser.find_element(By.ID, "key-dialog").is_displayed()
        assert console_errors(browser, allow=["status of 401"]) == []
    finally:
        server.stop()


def fill_the_queue(server) -> list:
    """Long streams opened until the server refuses one with 429; the open ones, to close later."""
    client = httpx.Client(base_url=server.url, timeout=30)
    held = []
    for _ in range(20):
        body = {"messages": [{"role": "user", "content": "story"}], "stream": True}
        r = client.send(client.build_request("POST", "/v1/chat/completions", json=body), stream=True)
        if r.status_code == 429:
            r.close()
            return held
        assert r.status_code == 200, r.status_code
        held.append(r)
    raise AssertionError("20 streams and no 429")


def test_busy_and_context_full_get_clear_messages(browser, tmp_path_factory, small_model):
    # Loading for a few seconds: the API answers 503 meanwhile; then a full queue (429); then a
    # context too small for the message. 200 ms a token keeps the queue's streams going meanwhile.
    server = Server(scripted(tmp_path_factory, small_model, load_delay_ms=4000, delay_ms=200),
                    "--ctx-size", "48", "--max-queue", "1")
    try:
        deadline = time.time() + 10
        while True:
            try:
                httpx.get(server.url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.time() < deadline, "the server did not start listening"
                time.sleep(0.05)
        browser.get(server.url + "/")
        ask(browser, "hello")
        note = wait_answered(browser, 1).find_element(By.CSS_SELECTOR, ".note")
        assert note.text.startswith("The server is busy or not ready (503: the model is still loading"), note.text
        server.wait_ready()
        held = fill_the_queue(server)
        try:
            ask(browser, "hello")
            note = wait_answered(browser, 2).find_element(By.CSS_SELECTOR, ".note")
            assert note.text.startswith("The server is busy: too many requests are waiting (429"), note.text
        finally:
            for r in held:
                r.close()
        ask(browser, "word " * 100)
        note = wait_answered(browser, 3).find_element(By.CSS_SELECTOR, ".note")
        assert note.text.startswith("The conversation no longer fits the model's context"), note.text
        assert console_errors(browser, allow=["status of 503", "status of 429", "status of 400"]) == []
    finally:
        server.stop()


def test_the_real_cpu_model_answers_with_the_panel_settings(browser, cpu_server):
    open_page(browser, cpu_server)
    browser.find_element(By.ID, "settings-toggle").click()
    browser.find_element(By.ID, "thinking").click()
    browser.find_element(By.ID, "max-tokens").send_keys("4")
    ask(browser, "Hi")
    answer = wait_answered(browser, 1, timeout=60)
    assert answer.find_element(By.CSS_SELECTOR, ".stats").text.startswith("4 tokens")
    assert answer.find_element(By.CSS_SELECTOR, ".note").text == "Cut at Max tokens (4)."
    assert console_errors(browser) == []


def test_no_webui_serves_only_the_api(small_model, tmp_path_factory):
    server = Server(scripted(tmp_path_factory, small_model), "--no-webui").wait_ready()
    try:
        r = httpx.get(server.url + "/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.get(server.url + "/v1/models").status_code == 200
    finally:
        server.stop()


def test_the_page_is_served_with_a_restrictive_policy(server):
    for path in ["/", "/app.js", "/markdown.js", "/style.css", "/favicon.svg"]:
        r = httpx.get(server.url + path)
        assert r.status_code == 200, path
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        for directive in ["default-src 'self'", "script-src 'self'", "connect-src 'self'"]:
            assert directive in csp, (path, csp)
        assert "unsafe" not in csp
