"""The web page at ``/``: served from the package (nothing from elsewhere), turned off by --no-ui, and used in a
real browser (headless Chromium through selenium) against `layerstream serve tiny-wan --api-key KEY`: give the
key once, type a prompt, press Generate, watch the progress bar, find the result in the history, again after a
reload and after a restart of the server on the same data folder, then use its settings and delete it."""

from __future__ import annotations

import os
import re
import shutil
from importlib.resources import files
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from layerstream.cli.main import build_parser
from layerstream.server.app import create_app
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings
from test_service import StandInOmni

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOT_COPY_ENV = "LAYERSTREAM_PAGE_SCREENSHOT"
"""If set, a path where the browser test also leaves its screenshot (to look at it)."""
LARGEST_SEED = 2**53 - 1  # the largest seed every edge takes: the page must give it back as it came
PROMPT = "a red fox running through fresh snow"
API_KEY = "sk-page-test-4f1c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STATIC = files("layerstream.server.ui") / "static"


# --- served by the app, without a browser ----------------------------------------------------------------------


def _app(**kwargs) -> TestClient:
    service = GenerationService(StandInOmni(), ServeSettings(port=0, shutdown_timeout=0))
    return TestClient(create_app(service, **kwargs), base_url="http://127.0.0.1")


def test_the_page_and_its_files_are_served_from_the_package():
    with _app() as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert re.search(r'<label for="prompt">Prompt</label>', page.text) and ">Generate</button>" in page.text
        for name, media_type in (("app.js", "javascript"), ("style.css", "text/css")):
            served = client.get(f"/ui/{name}")
            assert served.status_code == 200 and media_type in served.headers["content-type"]
            assert served.text == (STATIC / name).read_text(encoding="utf-8")
    for name in ("index.html", "app.js", "style.css"):  # no asset from the internet, no build step
        text = (STATIC / name).read_text(encoding="utf-8")
        assert not re.search(r"https?://|//cdn|@import|\bimport\s", text), name


def test_no_ui_serves_no_page():
    with _app(ui=False) as client:
        assert client.get("/").status_code == 404 and client.get("/ui/app.js").status_code == 404
        assert client.get("/metrics").status_code == 200  # the API is served as ever
    assert build_parser().parse_args(["serve", "tiny-wan", "--no-ui"]).ui is False
    assert build_parser().parse_args(["serve", "tiny-wan"]).ui is True


# --- in a real browser ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; make test does, as root)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _find(driver, css: str):
    return driver.find_element("css selector", css)


def _field(driver, label: str):
    """The form control labelled `label`, as a person finds it."""
    target = driver.find_element("xpath", f"//label[normalize-space()={label!r}]").get_attribute("for")
    return driver.find_element("id", target)


def _fill(driver, label: str, text: str) -> None:
    control = _field(driver, label)
    control.clear()
    control.send_keys(text)


def _history_card(driver, job_id: str):
    cards = driver.find_elements("css selector", f'#history li[data-job="{job_id}"]')
    return cards[0] if cards else None


RECORD_PROGRESS = """
window.progressSeen = [];
window.previewsSeen = 0;
new MutationObserver((changes) => {
  for (const bar of document.querySelectorAll('[role=progressbar]')) {
    const value = Number(bar.getAttribute('aria-valuenow'));
    if (window.progressSeen.at(-1) !== value) window.progressSeen.push(value);
  }
  for (const change of changes) {
    if (change.attributeName === 'src' && change.target.matches('img.preview')
        && change.target.src.startsWith('data:image/png;base64,')) window.previewsSeen += 1;
  }
}).observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['aria-valuenow', 'src']});
"""


def test_generate_watch_and_find_the_result_again(browser, server_factory, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    data_dir = tmp_path / "data"
    server = server_factory("tiny-wan", "--data-dir", str(data_dir), "--api-key", API_KEY)
    wait = WebDriverWait(browser, 120, poll_frequency=0.05)
    browser.get(server.url + "/")
    wait.until(lambda d: _find(d, "#model").text.startswith("tiny-wan"))
    _give_key(browser, wait, tmp_path / "page-key.png")
    assert _field(browser, "Size").get_attribute("value") == "64x64"  # the model's defaults, from /health
    assert _field(browser, "Length").get_attribute("value") == "9"
    _fill(browser, "Prompt", PROMPT)
    _fill(browser, "Negative prompt", "blurry")
    _fill(browser, "Size", "32x32")
    _fill(browser, "Length", "5")
    _fill(browser, "Steps", "8")
    _fill(browser, "Seed", str(LARGEST_SEED))
    browser.execute_script(RECORD_PROGRESS)
    browser.find_element("xpath", "//button[normalize-space()='Generate']").click()

    bar = wait.until(lambda d: d.find_elements("css selector", "#running [role=progressbar]"))[0]
    job_id = bar.find_element("xpath", "ancestor::article").get_attribute("data-job")
    assert job_id.startswith("video_")
    wait.until(lambda d: d.execute_script("return window.progressSeen.some(v => v > 0)"))
    browser.save_screenshot(str(tmp_path / "page-running.png"))
    card = wait.until(lambda d: _history_card(d, job_id))
    seen = browser.execute_script("return window.progressSeen")
    assert seen == sorted(seen) and 0 < max(seen) <= 100, seen  # it moved forward, within bounds
    assert browser.execute_script("return window.previewsSeen") >= 1  # live previews from the event stream
    _check_history_card(card, server.url, job_id)
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert logs == [], logs

    browser.refresh()  # the key is asked once: a reload keeps it
    card = wait.until(lambda d: _history_card(d, job_id))
    assert not _find(browser, "#key-form").is_displayed()
    _check_history_card(card, server.url, job_id)

    assert server.terminate() == 0, server.log()
    restarted = server_factory("tiny-wan", "--data-dir", str(data_dir), "--api-key", API_KEY)
    browser.get(restarted.url + "/")  # the same key on the same host: not asked again
    card = wait.until(lambda d: _history_card(d, job_id))
    assert not _find(browser, "#key-form").is_displayed()
    _check_history_card(card, restarted.url, job_id)
    wait.until(lambda d: d.execute_script(
        f'return document.querySelector(\'#history li[data-job="{job_id}"] video\').readyState >= 1'
    ))  # fmt: skip
    _save_screenshot(browser, tmp_path / "page-history.png")

    _fill(browser, "Prompt", "something else")
    card.find_element("xpath", ".//button[normalize-space()='Use these settings']").click()
    assert _field(browser, "Prompt").get_attribute("value") == PROMPT
    assert _field(browser, "Negative prompt").get_attribute("value") == "blurry"
    assert _field(browser, "Seed").get_attribute("value") == str(LARGEST_SEED)  # exact through JavaScript's numbers
    assert _field(browser, "Steps").get_attribute("value") == "8"
    card.find_element("xpath", ".//button[normalize-space()='Delete']").click()
    wait.until(lambda d: _history_card(d, job_id) is None)
    assert httpx.get(f"{restarted.url}/v1/videos/{job_id}", headers=AUTH).status_code == 404
    assert httpx.get(f"{restarted.url}/v1/videos/{job_id}").status_code == 401


def _give_key(browser, wait, screenshot: Path | None = None) -> None:
    """The page asks for the server's key (its job list answered 401); give it, as a person does."""
    form = wait.until(lambda d: _find(d, "#key-form") if _find(d, "#key-form").is_displayed() else None)
    assert not _find(browser, ".layout").is_displayed()
    if screenshot is not None:
        _save_screenshot(browser, screenshot)
    _fill(browser, "API key", "wrong-key")
    form.find_element("xpath", ".//button[normalize-space()='Use key']").click()
    wait.until(lambda d: "refused" in _find(d, "#key-error").text)
    _fill(browser, "API key", API_KEY)
    form.find_element("xpath", ".//button[normalize-space()='Use key']").click()
    wait.until(lambda d: _find(d, ".layout").is_displayed() and not _find(d, "#key-form").is_displayed())
    browser.get_log("browser")  # the 401s that asked for the key are logged as failed loads: expected


def _check_history_card(card, url: str, job_id: str) -> None:
    """The card shows the prompt and the settings, the video, and a download of the job's own file."""
    text = card.text
    assert PROMPT in text and "32x32" in text and "5 frames" in text and "8 steps" in text and f"seed {LARGEST_SEED}" in text
    took = re.search(r"took ([\d.]+) (ms|s)\b", text)  # the generation's own time, not whole-second stamps
    assert took and float(took.group(1)) > 0, text
    video = card.find_element("tag name", "video")
    assert video.get_attribute("src") == f"{url}/v1/videos/{job_id}/content"
    download = card.find_element("link text", "Download")
    assert download.get_attribute("href") == video.get_attribute("src")
    assert httpx.get(download.get_attribute("href")).status_code == 401  # the browser's cookie opened it, not the link
    content = httpx.get(download.get_attribute("href"), headers=AUTH)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4" and content.content[4:8] == b"ftyp"


def _save_screenshot(browser, path: Path) -> None:
    browser.save_screenshot(str(path))
    copy = os.environ.get(SCREENSHOT_COPY_ENV)
    if copy:
        shutil.copyfile(path, copy)


def test_the_page_stays_usable_with_many_jobs_waiting(browser, server_factory):
    """A browser opens at most six connections to one HTTP/1.1 server, and an event stream holds one as long as
    its job is unfinished: the page must not follow so many that its own requests (the list, Generate) wait."""
    from selenium.webdriver.support.ui import WebDriverWait

    server = server_factory("tiny-flux", "--link-gbps", "0.001")
    with server.client() as http:
        waiting = [
            http.post("/v1/images/jobs", json={"prompt": f"slow {i}", "size": "32x32", "num_inference_steps": 200}).json()["id"]
            for i in range(7)
        ]
    wait = WebDriverWait(browser, 60, poll_frequency=0.05)
    browser.get(server.url + "/")
    wait.until(lambda d: len(d.find_elements("css selector", "#queue li")) == 6)  # one runs, six wait
    assert browser.find_elements("css selector", f'#running [data-job="{waiting[0]}"]')
    _fill(browser, "Prompt", "one more")
    _fill(browser, "Size", "32x32")
    browser.find_element("xpath", "//button[normalize-space()='Generate']").click()
    # the new job is answered and listed while the seven are still unfinished
    wait.until(lambda d: "one more" in d.execute_script("return document.querySelector('#queue').textContent"))
    assert browser.find_element("id", "form-error").get_attribute("hidden")
    with server.client() as http:
        assert http.get(f"/v1/images/jobs/{waiting[-1]}").json()["status"] == "queued"
