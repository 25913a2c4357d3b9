"""A small reader for report.html (stdlib html.parser): sections in order, their text, figures
and images; and what the report fixtures plant."""

from dataclasses import dataclass, field
from html.parser import HTMLParser

# What the session fixtures (conftest.py) plant.
PLANTED_MODULE = "up_blocks.1.resnets.0.conv2"
PLANTED_STEP = 2
NAN_GRAD_STEP = 8
LR_SPIKE_STEP = 5


@dataclass
class Image:
    src: str
    alt: str
    figure: str | None
    section: str | None


@dataclass
class Page:
    section_order: list[str] = field(default_factory=list)
    section_text: dict[str, str] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)
    resource_urls: list[str] = field(default_factory=list)

    def figure_ids(self) -> list[str]:
        return [i.figure for i in self.images if i.figure]


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._sections: list[str | None] = []
        self._figure: str | None = None
        self._chunks: dict[str, list[str]] = {}

    def _top(self) -> str | None:
        return next((s for s in self._sections if s), None)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.page.tags.add(tag)
        if attrs.get("id"):
            self.page.ids.append(attrs["id"])
        for name in ("src", "href", "action", "poster", "data"):
            if attrs.get(name):
                self.page.resource_urls.append(attrs[name])
        if tag == "section":
            self._sections.append(attrs.get("id"))
            if len([s for s in self._sections if s]) == 1 and attrs.get("id"):
                self.page.section_order.append(attrs["id"])
        elif tag == "figure":
            self._figure = attrs.get("id")
        elif tag == "img":
            self.page.images.append(Image(attrs.get("src", ""), attrs.get("alt", ""), self._figure, self._top()))

    def handle_endtag(self, tag):
        if tag == "section" and self._sections:
            self._sections.pop()
        elif tag == "figure":
            self._figure = None

    def handle_data(self, data):
        top = self._top()
        if top:
            self._chunks.setdefault(top, []).append(data)

    def close(self):
        super().close()
        self.page.section_text = {k: " ".join(" ".join(v).split()) for k, v in self._chunks.items()}


def read_page(text: str) -> Page:
    reader = _Reader()
    reader.feed(text)
    reader.close()
    return reader.page
