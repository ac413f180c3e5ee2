"""What a browser sees of a report: well-formed HTML (check_html, every tag closed in order) and
a page rendered by headless Chromium (chromium_screenshot; chromium_dom for what a script measured
in the laid-out page; tests needing it are marked needs_chromium and skip, saying what to
install, where it is absent)."""

from __future__ import annotations

import html.parser
import os
import subprocess

import pytest

CHROMIUM = "/usr/bin/chromium"  # the Debian package `make setup-browser` installs
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} absent: install it with `make setup-browser`"
)


def _chromium(profile_dir, width: int, height: int, *args: str) -> list[str]:
    """The headless command line this machine needs: no sandbox, no GPU, no network, a fresh profile."""
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        *args,
    ]


def chromium_screenshot(page, shot, profile_dir, width: int, height: int) -> None:
    """Render a local HTML file in headless Chromium into the PNG `shot` (no network, a fresh profile)."""
    command = _chromium(profile_dir, width, height, f"--screenshot={shot}", f"file://{page}")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert os.path.exists(shot), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"


def chromium_dom(page, profile_dir, width: int, height: int) -> str:
    """The DOM of a local HTML file after headless Chromium laid it out at width x height and ran
    its scripts: how a test reads what a script measured in the page (written into an attribute)."""
    command = _chromium(profile_dir, width, height, "--virtual-time-budget=5000", "--dump-dom", f"file://{page}")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and "</html>" in proc.stdout, f"no DOM (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class StrictChecker(html.parser.HTMLParser):
    """Every non-void tag closed in order; collects img srcs and every src/href."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.images: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src") or "")
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> at {self.getpos()} closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_html(text: str) -> StrictChecker:
    """The page parsed (its images, links and text); fails unless every tag is closed in order."""
    checker = StrictChecker()
    checker.feed(text)
    checker.close()
    assert not checker.errors, checker.errors[:5]
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    return checker
