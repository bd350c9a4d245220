"""The page's files and the offline docs, in-process on the fake engine: everything a browser loads
comes from this server, and the page stays open with --api-key while the API does not."""
import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from pdserve.server.app import build_app
from pdserve.server.config import ServerConfig
from pdserve.server.web import STATIC
from tests.server.fake_engine import FakeEngine


def client(**config) -> TestClient:
    return TestClient(build_app(FakeEngine(), ServerConfig(served_model_name="fake-model", **config)))


class Assets(HTMLParser):
    """Every URL a page loads by itself: scripts, stylesheets, icons, images."""
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.urls.append(a["src"])
        elif tag == "link" and a.get("href"):
            self.urls.append(a["href"])
        elif tag == "img" and a.get("src"):
            self.urls.append(a["src"])


def loaded_urls(html: str) -> list[str]:
    p = Assets()
    p.feed(html)
    return p.urls


def local(url: str) -> bool:
    return url.startswith("data:") or (url.startswith("/") and not url.startswith("//"))


@pytest.mark.parametrize("path", ["/", "/docs", "/redoc"])
def test_pages_load_only_assets_this_server_serves(path):
    with client() as c:
        page = c.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        urls = loaded_urls(page.text)
        assert urls and all(local(u) for u in urls), urls
        if path == "/redoc":   # get_redoc_html(with_google_fonts=False): no font CSS from Google
            assert "fonts.googleapis" not in page.text
        for url in urls:
            if not url.startswith("data:"):
                assert c.get(url).status_code == 200, url


def test_the_redoc_bundle_names_no_image_on_another_host():
    # ReDoc's bundle shows a logo from a CDN; the one /redoc loads must not ask for it
    with client() as c:
        (bundle,) = [u for u in loaded_urls(c.get("/redoc").text) if u.endswith(".js")]
        js = c.get(bundle)
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert len(js.content) > 100_000 and not re.search(rb'src:\s*"https?://', js.content)


def test_every_module_the_page_imports_is_served():
    with client() as c:
        for js in STATIC.glob("*.js"):
            for name in re.findall(r'from "\./([\w.]+)"', js.read_text()):
                assert c.get(f"/static/{name}").status_code == 200, (js.name, name)
        assert c.get("/static/main.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/static/nope.js").status_code == 404


def test_the_page_and_docs_are_open_with_an_api_key_and_the_step_stream_is_not():
    with client(api_key="k") as c:
        for path in ("/", "/static/style.css", "/docs", "/redoc", "/openapi.json", "/static/docs/redoc.standalone.js"):
            assert c.get(path).status_code == 200, path
        r = c.get("/v1/engine/steps")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_history_is_checked():
    with client() as c:
        r = c.get("/v1/engine/steps", params={"history": 100000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "history"
