//! A server killed with SIGKILL loses nothing it answered.

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Proc, Server};

stores!(leases_and_tokens_survive_sigkill);
async fn leases_and_tokens_survive_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let owner = Proc::sleep();
    let s = Server::start_in(dir.path(), &[]).await;
    let a = s.acquire_ok("keep/a", "h").await;
    let b = s
        .acquire(json!({"resource": "keep/b", "holder": "h", "owner": {"pid": owner.pid()}}))
        .await
        .body;
    let c = s.acquire_ok("keep/c", "h").await;
    let cid = c["id"].as_str().expect("id");
    assert_eq!(
        s.lease_op(cid, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    let renewed = s
        .lease_op(
            a["id"].as_str().expect("id"),
            "renew",
            json!({"token": 1, "ttl_ms": 120_000}),
        )
        .await
        .body;
    let events_before = s.all_events().await.len();
    s.kill9().await;

    let s = Server::start_in(dir.path(), &[]).await;
    let a2 = s.lease(a["id"].as_str().expect("id")).await;
    assert_eq!(a2["state"], "active");
    assert_eq!(a2["token"], 1);
    assert_eq!(a2["ttl_ms"], 120_000);
    assert_eq!(
        a2["expires_at"], renewed["expires_at"],
        "the answered renewal survived a process crash"
    );
    let b2 = s.lease(b["id"].as_str().expect("id")).await;
    assert_eq!(b2["state"], "active");
    assert_eq!(b2["owner_status"], "live");
    assert_eq!(s.lease(cid).await["state"], "released");
    assert_eq!(s.all_events().await.len(), events_before);

    let next = s.acquire_ok("keep/c", "h2").await;
    assert_eq!(next["token"], 2, "tokens never go back after a restart");
    let held = s
        .acquire(json!({"resource": "keep/a", "holder": "h2", "ttl_ms": 5000}))
        .await;
    assert_eq!(held.code(), "lease_held");
}
