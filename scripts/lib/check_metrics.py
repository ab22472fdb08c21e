"""GET /metrics as Prometheus's own parsers read it (prometheus_client's):
OpenMetrics when asked for it, as a Prometheus scrape does, and the classic
text format otherwise. Usage: check_metrics.py URL TOKEN"""

import sys
import urllib.request

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as classic

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,"
    "application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(url, token, accept):
    headers = {"Authorization": f"Bearer {token}"}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(f"{url}/metrics", headers=headers)
    with urllib.request.urlopen(req) as res:
        return res.headers["Content-Type"], res.read().decode()


def check(parse, text, kind):
    families = list(parse(text))
    # A sample of no family the exposition typed is read as `unknown`; a
    # family whose samples are named otherwise is left with none.
    bad = [f.name for f in families if f.type == "unknown" or not f.samples]
    if bad:
        sys.exit(f"{kind}: families untyped or without samples: {bad}\n{text}")
    types = {f.name: f.type for f in families}
    if types.get("holdfast_lease_acquisitions") != "counter":
        sys.exit(f"{kind}: holdfast_lease_acquisitions is not a counter: {types}")
    return len(families)


def main():
    url, token = sys.argv[1], sys.argv[2]
    ct, text = scrape(url, token, PROMETHEUS_ACCEPT)
    if not ct.startswith("application/openmetrics-text"):
        sys.exit(f"a Prometheus scrape got {ct}")
    n = check(openmetrics, text, "OpenMetrics")
    ct, text = scrape(url, token, None)
    if not ct.startswith("text/plain; version=0.0.4"):
        sys.exit(f"a plain scrape got {ct}")
    m = check(classic, text, "text 0.0.4")
    print(f"metrics: {n} OpenMetrics families, {m} text 0.0.4 families, all typed")


main()
