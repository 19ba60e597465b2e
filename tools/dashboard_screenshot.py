"""Take docs/img/dashboard.png: the live dashboard while `bench/agent_loop.py` runs against a real server.

    .venv/bin/python -m tools.dashboard_screenshot [--out docs/img/dashboard.png] [--num-agents 6 --steps 4]

Starts a server (the default model, float32, no keys: the admin's view), runs the agent loop's `radixlm` side
against it with `--url`, opens /dashboard in Debian's headless Chromium (selenium + chromedriver, as
tests/e2e/test_dashboard_browser.py) and saves the page once requests are running and the usage chart has
`--min-points` points. Everything it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.server_utils import ROOT, ServerProcess
from tests.e2e.test_dashboard_browser import CHROME_FLAGS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--num-agents", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--min-points", type=int, default=30, help="usage chart points before the screenshot")
    ap.add_argument("--timeout-s", type=float, default=900)
    args = ap.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with (
        ServerProcess(extra_args=["--max-total-tokens", "30000"]) as srv,
        tempfile.TemporaryDirectory() as tmp,
    ):
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        options.add_argument("--window-size=1500,1400")  # the whole page (the last flag wins)
        options.add_argument(f"--user-data-dir={tmp}")
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        bench = None
        try:
            driver.get(srv.url + "/dashboard")
            driver.find_element("id", "connect").click()
            bench = subprocess.Popen(
                [sys.executable, "-m", "bench.agent_loop", "--url", srv.url, "--sides", "radixlm"]
                + ["--num-agents", str(args.num_agents), "--steps", str(args.steps)]
                + ["--results-dir", tmp],
                cwd=ROOT,
            )
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline and bench.poll() is None:
                points = int(driver.find_element("id", "usage-chart").get_attribute("data-points") or 0)
                running = driver.find_elements("css selector", "#requests tbody tr[data-state=running]")
                if points >= args.min_points and len(running) >= 2:
                    break
                time.sleep(1)
            else:
                print(
                    "the agent loop ended (or timed out) before the page showed running requests",
                    file=sys.stderr,
                )
                return 1
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            time.sleep(1.5)  # one more state
            driver.save_screenshot(args.out)
            print(f"saved {args.out}")
            return 0
        finally:
            if bench is not None and bench.poll() is None:
                bench.terminate()
                bench.wait(30)
            driver.quit()


if __name__ == "__main__":
    sys.exit(main())
