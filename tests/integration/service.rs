//! Health, readiness, metrics and the OpenAPI document.

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Server, fails_to_start};

stores!(health_and_readiness);
async fn health_and_readiness() {
    let s = Server::start().await;
    let h = s.get("/healthz").await;
    assert_eq!(
        (h.status, h.body.clone()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    let r = s.get("/readyz").await;
    assert_eq!(r.status, StatusCode::OK);
    let store = match crate::stores::current() {
        crate::stores::Store::Sqlite => "sqlite",
        crate::stores::Store::Postgres => "postgres",
    };
    assert_eq!(r.body, json!({"status": "ok", "store": store}));
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["healthcheck", "--url", &s.base])
        .output()
        .await
        .expect("healthcheck");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

stores!(healthcheck_fails_when_nothing_listens);
async fn healthcheck_fails_when_nothing_listens() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["healthcheck", "--url", &format!("http://127.0.0.1:{port}")])
        .output()
        .await
        .expect("healthcheck");
    assert!(!out.status.success());
}

stores!(metrics_count_acquisitions_conflicts_and_requests);
async fn metrics_count_acquisitions_conflicts_and_requests() {
    let s = Server::start().await;
    s.acquire_ok("m", "a").await;
    let _ = s
        .acquire(json!({"resource": "m", "holder": "b", "ttl_ms": 5000}))
        .await;
    let res = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .expect("metrics");
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers()["content-type"]
            .to_str()
            .expect("ct")
            .starts_with("text/plain")
    );
    let text = res.text().await.expect("text");
    for needle in [
        "holdfast_leases_current 1",
        "holdfast_lease_acquisitions_total 1",
        "holdfast_lease_conflicts_total{code=\"lease_held\"} 1",
        "holdfast_http_requests_total{method=\"POST\",route=\"/v1/leases\",status=\"201\"} 1",
        "holdfast_http_request_duration_seconds_bucket",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

/// Prometheus's own `Accept` at a scrape.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

#[tokio::test]
async fn metrics_are_classic_text_unless_openmetrics_is_asked_for() {
    let s = Server::start().await;
    s.acquire_ok("m", "a").await;
    let scrape = |accept: Option<&'static str>| {
        let mut req = s.client.get(s.url("/metrics"));
        if let Some(accept) = accept {
            req = req.header("accept", accept);
        }
        async move {
            let res = req.send().await.expect("metrics");
            assert_eq!(res.status(), StatusCode::OK);
            let header = |name| {
                res.headers()
                    .get(name)
                    .map(|v| v.to_str().expect("ascii").to_owned())
            };
            let (ct, vary) = (
                header("content-type").expect("content-type"),
                header("vary"),
            );
            (ct, vary, res.text().await.expect("text"))
        }
    };
    // Prometheus text 0.0.4: every sample is of a family its `# TYPE`
    // names exactly (a counter's family is `x_total`), nothing after it.
    for accept in [None, Some("text/plain"), Some("*/*")] {
        let (ct, vary, text) = scrape(accept).await;
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "{accept:?}");
        assert_eq!(vary.as_deref(), Some("accept"), "{accept:?}");
        let typed: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
            .collect();
        assert!(
            typed.contains(&("holdfast_lease_acquisitions_total", "counter")),
            "{text}"
        );
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            let name = sample.split(['{', ' ']).next().unwrap_or_default();
            let family = typed.iter().find(|(family, kind)| {
                *family == name
                    || (*kind == "histogram"
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|suffix| name.strip_suffix(suffix) == Some(*family)))
            });
            assert!(
                family.is_some(),
                "{name} has no # TYPE of its name in\n{text}"
            );
        }
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(
            text.contains("holdfast_lease_acquisitions_total 1"),
            "{text}"
        );
    }
    // OpenMetrics, as Prometheus asks for it: counters are typed by their
    // family, and the exposition ends with `# EOF`.
    let (ct, _, text) = scrape(Some(PROMETHEUS_ACCEPT)).await;
    assert_eq!(
        ct,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains("# TYPE holdfast_lease_acquisitions counter\n"),
        "{text}"
    );
    assert!(
        text.contains("holdfast_lease_acquisitions_total 1"),
        "{text}"
    );
}

stores!(served_openapi_document_is_the_checked_in_one);
async fn served_openapi_document_is_the_checked_in_one() {
    let s = Server::start().await;
    let served = s
        .client
        .get(s.url("/openapi.json"))
        .send()
        .await
        .expect("get")
        .text()
        .await
        .expect("text");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json");
    let checked_in = std::fs::read_to_string(path).expect("openapi/openapi.json");
    assert!(
        served == checked_in,
        "openapi/openapi.json is out of date: run `cargo run -- openapi > openapi/openapi.json`"
    );
    let doc: serde_json::Value = serde_json::from_str(&served).expect("json");
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1"))
    );
    for path in [
        "/v1/leases",
        "/v1/leases/{id}",
        "/v1/leases/{id}/renew",
        "/v1/leases/{id}/activate",
        "/v1/leases/{id}/release",
        "/v1/leases/{id}/break",
        "/v1/events",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} is documented");
    }
}

/// One server per data dir, SQLite file and socket: a second one refuses to
/// start, naming what is in use and by whom, and the first serves on.
#[tokio::test]
async fn a_second_server_on_what_another_uses_refuses_to_start() {
    let sock_dir = tempfile::tempdir().expect("tempdir");
    let sock = sock_dir.path().join("holdfast.sock");
    let sock_arg = sock.display().to_string();
    let s = Server::start_with(&["--unix-socket", &sock_arg]).await;
    let pid = crate::support::server_pid(&s);
    let db = format!("sqlite://{}/holdfast.db", s.dir().display());
    let elsewhere = tempfile::tempdir().expect("tempdir");
    for (dir, args, said) in [
        (s.dir(), &[][..], "the data directory"),
        (
            elsewhere.path(),
            &["--database", db.as_str()][..],
            "the database",
        ),
    ] {
        let err = fails_to_start(dir, args).await;
        assert!(
            err.contains(&format!("{said} "))
                && err.contains(&format!("in use by another holdfast server (pid {pid})")),
            "{err}"
        );
    }
    let other = tempfile::tempdir().expect("tempdir");
    let err = fails_to_start(other.path(), &["--unix-socket", &sock_arg]).await;
    assert!(
        err.contains(&format!(
            "cannot listen on {sock_arg}: a server is listening on it"
        )),
        "{err}"
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&sock).is_ok(),
        "the first server's socket was taken"
    );
    assert_eq!(s.get("/healthz").await.status, StatusCode::OK);
}

stores!(at_shutdown_waiting_requests_are_answered_not_cut);
/// At shutdown whatever waits is answered at once (an acquire `503` to
/// retry, a long poll its empty page, a stream its end), not cut off
/// unanswered when the connections are closed after the drain.
async fn at_shutdown_waiting_requests_are_answered_not_cut() {
    let mut s = Server::start().await;
    let held = s.acquire_ok("shutdown/a", "h").await;
    let after = s.all_events().await.len();
    let waiter = s.acquire_in_background(
        None,
        &json!({"resource": "shutdown/a", "holder": "w", "ttl_ms": 60000, "wait_ms": 60000}),
    );
    let poll = tokio::spawn(
        s.client
            .get(s.url(&format!("/v1/events?after={after}&wait_ms=60000")))
            .send(),
    );
    let stream = s
        .client
        .get(s.url(&format!("/v1/events/stream?after={after}")))
        .send()
        .await
        .expect("stream");
    assert_eq!(stream.status(), StatusCode::OK);
    let stream = tokio::spawn(stream.text());
    // All three wait: the acquire, the long poll, the stream.
    s.metric_reads("holdfast_waiting_requests 3").await;
    let started = std::time::Instant::now();
    let status = s.terminate().await;
    let took = started.elapsed();
    assert!(status.success(), "{status}");
    let (code, body) = waiter.await.expect("join");
    assert_eq!(
        (code, body["code"].as_str(), body["title"].as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some("unavailable"),
            Some("Shutting down")
        ),
        "{body}"
    );
    let poll = poll.await.expect("join").expect("answered");
    assert_eq!(poll.status(), StatusCode::OK);
    assert_eq!(
        poll.json::<serde_json::Value>().await.expect("json"),
        json!({"items": []})
    );
    stream
        .await
        .expect("join")
        .expect("the stream ended, not cut");
    // Not after the 5 s drain that cuts what is still open.
    assert!(took < std::time::Duration::from_secs(4), "{took:?}");
    drop(held);
}
