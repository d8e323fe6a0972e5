"""resume-check --report: an HTML page with PNG figures, linked from the text output."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from click.testing import CliRunner

from ckptverify.cli import main

pytest.importorskip("matplotlib")  # the `report` extra (in the `test` extra too)


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])


def test_report_page_has_valid_figures_and_marks_the_origin(tmp_path):
    import matplotlib.image

    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["resume-check", "--no-locate", "ckptverify.examples.planted:parent_forward",
                                       "--steps", "4",
                                       "--resume-at", "2", "--runs", "A,B", "--level", "module",
                                       "--report", str(out)])
    assert result.exit_code == 1, result.output
    assert f"report: {out / 'index.html'}" in result.output.replace("\n", "")
    page = (out / "index.html").read_text()
    parser = _Images()
    parser.feed(page)
    assert parser.images == ["metrics.png", "categories.png", "modules.png"]
    for name in parser.images:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.01  # not a blank canvas
    assert "verdict: hidden-state" in page and "blocks.0" in page
