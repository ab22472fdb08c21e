//! `wait_ms`: a held lease is waited for, woken by its end, not by polling.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::Server;

stores!(a_waiter_gets_the_lease_as_soon_as_it_is_released);
async fn a_waiter_gets_the_lease_as_soon_as_it_is_released() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("w", "first").await;
    let waiter = {
        let client = s.client.clone();
        let url = s.url("/v1/leases");
        tokio::spawn(async move {
            let started = Instant::now();
            let r = client
                .post(url)
                .json(&json!({"resource": "w", "holder": "second", "ttl_ms": 5000, "wait_ms": 30_000}))
                .send()
                .await
                .expect("send");
            (
                r.status(),
                r.json::<serde_json::Value>().await.expect("json"),
                started.elapsed(),
            )
        })
    };
    // Let the waiter queue up: its request is in flight once the server counts it.
    s.eventually("/metrics", Duration::from_secs(5), |m| {
        m.as_str()
            .is_some_and(|t| t.contains("code=\"lease_held\""))
    })
    .await;
    let id = held["id"].as_str().expect("id");
    assert_eq!(
        s.lease_op(id, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    let (status, body, elapsed) = waiter.await.expect("waiter");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["token"], 2);
    assert!(
        elapsed < Duration::from_secs(10),
        "woken by the release, not the wait's end: {elapsed:?}"
    );
}

stores!(a_waiter_takes_over_an_ownerless_lease_at_its_expiry_without_the_reconciler);
async fn a_waiter_takes_over_an_ownerless_lease_at_its_expiry_without_the_reconciler() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s
        .acquire(json!({"resource": "x", "holder": "first", "ttl_ms": 1000}))
        .await
        .body;
    let r = s
        .acquire(json!({"resource": "x", "holder": "second", "ttl_ms": 5000, "wait_ms": 20_000}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["reclaimed"]["id"], held["id"]);
    assert_eq!(r.body["reclaimed"]["reason"], "ttl_expired");
}

stores!(a_wait_that_runs_out_answers_lease_held);
async fn a_wait_that_runs_out_answers_lease_held() {
    let s = Server::start().await;
    s.acquire_ok("y", "first").await;
    let started = Instant::now();
    let r = s
        .acquire(json!({"resource": "y", "holder": "second", "ttl_ms": 5000, "wait_ms": 300}))
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "lease_held");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
}

stores!(many_waiters_each_get_the_lease_once_in_turn);
async fn many_waiters_each_get_the_lease_once_in_turn() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let n = 16;
    let mut tasks = Vec::new();
    for i in 0..n {
        let client = s.client.clone();
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            let r = client
                .post(format!("{base}/v1/leases"))
                .json(&json!({"resource": "q", "holder": format!("w{i}"), "ttl_ms": 30_000, "wait_ms": 30_000}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), StatusCode::CREATED);
            let lease: serde_json::Value = r.json().await.expect("json");
            let id = lease["id"].as_str().expect("id").to_owned();
            let token = lease["token"].as_i64().expect("token");
            let rel = client
                .post(format!("{base}/v1/leases/{id}/release"))
                .json(&json!({"token": token}))
                .send()
                .await
                .expect("send");
            assert_eq!(rel.status(), StatusCode::OK);
            token
        }));
    }
    let mut tokens = Vec::new();
    for t in tasks {
        tokens.push(t.await.expect("waiter"));
    }
    tokens.sort_unstable();
    assert_eq!(
        tokens,
        (1..=n).collect::<Vec<i64>>(),
        "every waiter got exactly one lease, no attempt lost"
    );
}

stores!(waiters_get_the_lease_first_come_first_served);
async fn waiters_get_the_lease_first_come_first_served() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("fcfs", "first").await;
    let mut waiters = Vec::new();
    for i in 1..=4 {
        let (client, url) = (s.client.clone(), s.url("/v1/leases"));
        waiters.push(tokio::spawn(async move {
            let r = client
                .post(url)
                .json(&json!({"resource": "fcfs", "holder": format!("w{i}"), "ttl_ms": 30_000, "wait_ms": 30_000}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), StatusCode::CREATED);
            r.json::<serde_json::Value>().await.expect("json")
        }));
        // The next one arrives only once this one is queued.
        let queued = format!("holdfast_lease_waiters {i}");
        s.eventually("/metrics", Duration::from_secs(10), |m| {
            m.as_str().is_some_and(|t| t.contains(&queued))
        })
        .await;
    }
    let mut release = (held["id"].as_str().expect("id").to_owned(), 1);
    for (i, w) in waiters.into_iter().enumerate() {
        assert_eq!(
            s.lease_op(&release.0, "release", json!({"token": release.1}))
                .await
                .status,
            StatusCode::OK
        );
        let got = w.await.expect("waiter");
        assert_eq!(
            got["holder"],
            format!("w{}", i + 1),
            "served in arrival order"
        );
        release = (
            got["id"].as_str().expect("id").to_owned(),
            got["token"].as_i64().expect("token"),
        );
    }
}

/// POST an acquire of `resource` that waits up to 30 s, with `key` as its
/// Idempotency-Key if given; its status and body.
fn waiter(
    s: &Server,
    resource: &str,
    holder: &str,
    key: Option<&str>,
) -> tokio::task::JoinHandle<(StatusCode, serde_json::Value)> {
    let body = json!({"resource": resource, "holder": holder, "ttl_ms": 30_000, "wait_ms": 30_000});
    s.acquire_in_background(key, &body)
}

stores!(a_release_hands_the_lease_to_the_first_waiter_in_one_commit);
async fn a_release_hands_the_lease_to_the_first_waiter_in_one_commit() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("h", "first").await;
    let second = waiter(&s, "h", "second", None);
    s.queued(1).await;
    let third = waiter(&s, "h", "third", None);
    s.queued(2).await;
    let before = s.durable_transactions().await;
    let id = held["id"].as_str().expect("id");
    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK);
    let (status, got) = second.await.expect("waiter");
    assert_eq!(status, StatusCode::CREATED, "{got}");
    assert_eq!(
        (got["holder"].as_str(), got["token"].as_i64()),
        (Some("second"), Some(2))
    );
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the release and the waiter's acquire are one commit"
    );
    let events = s.all_events().await;
    let last: Vec<_> = events[events.len() - 2..]
        .iter()
        .map(|e| (e["type"].as_str(), e["lease"]["id"].as_str()))
        .collect();
    assert_eq!(
        last,
        [
            (Some("lease.released"), Some(id)),
            (Some("lease.acquired"), got["id"].as_str())
        ]
    );
    s.queued(1).await; // the third still waits, for the second's lease
    assert!(!third.is_finished());
    let rel = s
        .lease_op(
            got["id"].as_str().expect("id"),
            "release",
            json!({"token": 2}),
        )
        .await;
    assert_eq!(rel.status, StatusCode::OK);
    let (status, got) = third.await.expect("waiter");
    assert_eq!(
        (status, got["token"].as_i64()),
        (StatusCode::CREATED, Some(3))
    );
}

stores!(a_waiter_with_an_idempotency_key_takes_the_lease_in_its_own_commit);
async fn a_waiter_with_an_idempotency_key_takes_the_lease_in_its_own_commit() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("k", "first").await;
    let keyed = waiter(&s, "k", "second", Some("handoff-key-1"));
    s.queued(1).await;
    let id = held["id"].as_str().expect("id");
    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK);
    let (status, got) = keyed.await.expect("waiter");
    assert_eq!(
        (status, got["token"].as_i64()),
        (StatusCode::CREATED, Some(2))
    );
    // Its key was recorded with its acquire: a repeat replays the lease.
    let again = s
        .post_keyed(
            "/v1/leases",
            "handoff-key-1",
            json!({"resource": "k", "holder": "second", "ttl_ms": 30_000, "wait_ms": 30_000}),
        )
        .await;
    assert_eq!(
        (again.status, &again.body["id"]),
        (StatusCode::CREATED, &got["id"])
    );
}
