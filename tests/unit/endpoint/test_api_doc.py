"""docs/endpoint-api.md lists exactly the routes the endpoint app serves, so the page cannot drift."""

from __future__ import annotations

import re

from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.conftest import REPO_ROOT

ROW = re.compile(r"^\| `([A-Z]+)` \| `(/[^`]*)` \|", re.MULTILINE)


def test_the_api_page_lists_every_route_of_the_app_and_no_other() -> None:
    app = create_app(EndpointSettings(), token="t")
    served = {(method, route.path) for route in app.routes for method in route.methods if method != "HEAD"}
    documented = ROW.findall((REPO_ROOT / "docs" / "endpoint-api.md").read_text(encoding="utf-8"))
    assert len(documented) == len(set(documented)), "a route is listed twice"
    assert set(documented) == served
