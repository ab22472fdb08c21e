//! Server-Sent Events: every event exactly once, in order, across
//! reconnections and a server restart; retention answers 410.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::stores::stores;
use crate::support::Server;

/// An open event stream and what has been read of it.
struct Stream {
    res: reqwest::Response,
    buf: String,
}

#[derive(Debug)]
struct Message {
    id: i64,
    event: String,
    data: Value,
}

impl Stream {
    async fn open(s: &Server, last_event_id: Option<i64>) -> Self {
        let req = s
            .client
            .get(s.url("/v1/events"))
            .header("accept", "text/event-stream");
        Self::send(req, last_event_id).await
    }

    /// The stream's own operation: no `Accept` header needed.
    async fn open_stream_path(s: &Server, query: &str, last_event_id: Option<i64>) -> Self {
        let req = s.client.get(s.url(&format!("/v1/events/stream{query}")));
        Self::send(req, last_event_id).await
    }

    async fn send(mut req: reqwest::RequestBuilder, last_event_id: Option<i64>) -> Self {
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id.to_string());
        }
        let res = req.send().await.expect("open stream");
        assert_eq!(res.status(), StatusCode::OK);
        assert!(
            res.headers()["content-type"]
                .to_str()
                .expect("ct")
                .starts_with("text/event-stream")
        );
        Self {
            res,
            buf: String::new(),
        }
    }

    /// The next message (comments such as keep-alives are skipped).
    async fn next(&mut self) -> Message {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let field = |name: &str| {
                    block
                        .lines()
                        .find_map(|l| l.strip_prefix(name).map(|v| v.trim_start().to_owned()))
                };
                let Some(data) = field("data:") else { continue };
                return Message {
                    id: field("id:").and_then(|v| v.parse().ok()).unwrap_or(-1),
                    event: field("event:").unwrap_or_default(),
                    data: serde_json::from_str(&data).expect("data is JSON"),
                };
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.res.chunk())
                .await
                .expect("an event within 10 s")
                .expect("read")
                .expect("stream open");
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

stores!(the_stream_operation_streams_from_after_or_last_event_id);
async fn the_stream_operation_streams_from_after_or_last_event_id() {
    let s = Server::start().await;
    for r in ["sse/x", "sse/y", "sse/z"] {
        s.acquire_ok(r, "h").await;
    }
    let mut from_after = Stream::open_stream_path(&s, "?after=1", None).await;
    let m = from_after.next().await;
    assert_eq!((m.id, m.event.as_str()), (2, "lease.acquired"));
    assert_eq!(m.data["lease"]["resource"], "sse/y");
    let mut resumed = Stream::open_stream_path(&s, "?after=0", Some(2)).await;
    let m = resumed.next().await;
    assert_eq!(m.id, 3, "Last-Event-ID overrides after");
    assert_eq!(m.data["lease"]["resource"], "sse/z");

    let bad = s
        .client
        .get(s.url("/v1/events/stream"))
        .header("last-event-id", "three")
        .send()
        .await
        .expect("GET");
    assert_eq!(bad.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: Value = bad.json().await.expect("problem");
    assert_eq!(body["field"], "Last-Event-ID");
    // JSON callers of /v1/events get JSON whatever Last-Event-ID says.
    let json = s.get("/v1/events?after=2").await;
    assert_eq!(json.status, StatusCode::OK);
    assert_eq!(json.body["items"].as_array().expect("items").len(), 1);
}

stores!(a_resumed_stream_sees_every_event_once_in_order_across_a_restart);
async fn a_resumed_stream_sees_every_event_once_in_order_across_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let mut stream = Stream::open(&s, None).await;
    let a = s.acquire_ok("sse/a", "h").await;
    s.lease_op(
        a["id"].as_str().expect("id"),
        "release",
        json!({"token": 1}),
    )
    .await;
    let mut seen = Vec::new();
    for _ in 0..2 {
        let m = stream.next().await;
        assert_eq!(m.data["seq"], m.id, "id is the seq");
        assert_eq!(m.data["type"], m.event.as_str());
        seen.push((m.id, m.event));
    }
    assert_eq!(
        seen.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>(),
        ["lease.acquired", "lease.released"]
    );
    let last = seen.last().expect("seen").0;
    drop(stream);
    // Events committed while nobody listens, then a crash.
    s.acquire_ok("sse/b", "h").await;
    s.kill9().await;

    let s = Server::start_in(dir.path(), &[]).await;
    let mut stream = Stream::open(&s, Some(last)).await;
    s.acquire_ok("sse/c", "h").await;
    for resource in ["sse/b", "sse/c"] {
        let m = stream.next().await;
        assert_eq!(m.id, seen.last().expect("seen").0 + 1, "no gap, no repeat");
        assert_eq!(m.data["lease"]["resource"], resource);
        seen.push((m.id, m.event));
    }
}

stores!(retention_prunes_and_old_cursors_get_410);
async fn retention_prunes_and_old_cursors_get_410() {
    let s = Server::start_with(&["--event-retention", "3", "--reconcile-interval-ms", "50"]).await;
    for i in 0..4 {
        let l = s.acquire_ok(&format!("ret/{i}"), "h").await;
        s.lease_op(
            l["id"].as_str().expect("id"),
            "release",
            json!({"token": 1}),
        )
        .await;
    }
    // Pruning runs beside the writes: wait until it has caught up with all 8.
    let gone = s
        .eventually("/v1/events?after=0", Duration::from_secs(5), |b| {
            b["code"] == "events_pruned" && b["oldest_seq"] == 6
        })
        .await;
    let oldest = gone["oldest_seq"].as_i64().expect("oldest_seq");
    let kept = s.get(&format!("/v1/events?after={}", oldest - 1)).await;
    assert_eq!(kept.status, StatusCode::OK);
    let seqs: Vec<_> = kept.body["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|e| e["seq"].as_i64())
        .collect();
    assert_eq!(seqs, [Some(6), Some(7), Some(8)]);
    let r = s.get("/v1/events?after=1").await;
    assert_eq!((r.status, r.code()), (StatusCode::GONE, "events_pruned"));
}
