"""The report as a person sees it: index.html rendered by a headless Chromium (Debian's), every image
loaded and the summary table on the first screen. Skipped, with the reason, where no Chromium starts."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from harness.report.assemble import build_report
from tests.report_fixtures import write_results

pytestmark = pytest.mark.slow  # a headless Chromium: the slow tier (pytest -m slow)

PROBE = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const heading = [...document.querySelectorAll("h2")].find(h => h.textContent.startsWith("This machine"));
  const table = heading ? heading.parentElement.querySelector("h2 ~ table") : null;
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({images: images.length,
    loaded: images.filter(i => i.complete && i.naturalWidth > 0).length,
    summary_bottom: table ? table.getBoundingClientRect().bottom : null, viewport: window.innerHeight});
  document.body.appendChild(probe);
});
</script></body>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium on PATH (Debian: apt-get install chromium)")


def render(browser: str, page, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900", *flags,
                           page.as_uri()], capture_output=True, text=True, timeout=120)


def test_the_report_renders_with_every_image_and_the_summary_on_the_first_screen(tmp_path):
    browser = chromium()
    files = build_report(write_results(tmp_path / "results"), out_dir=tmp_path / "report")
    probed = tmp_path / "probed.html"
    probed.write_text(files.html.read_text().replace("</body>", PROBE))
    done = render(browser, probed, "--virtual-time-budget=10000", "--dump-dom")
    found = re.search(r'<pre id="probe">([^<]*)</pre>', done.stdout)
    if done.returncode != 0 or found is None:
        pytest.skip(f"Chromium did not render the page here (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    probe = json.loads(found.group(1).replace("&quot;", '"'))
    assert probe["images"] >= 5 and probe["loaded"] == probe["images"], probe
    assert probe["summary_bottom"] is not None and probe["summary_bottom"] <= probe["viewport"], probe
    shot = tmp_path / "first_screen.png"
    render(browser, files.html, f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000  # a page was drawn, not a blank frame
