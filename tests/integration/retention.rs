//! `--record-retention`: ended leases and processes are deleted once they
//! have been ended that long, with the processes' log files; current ones
//! and token counters stay.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::Server;

stores!(ended_records_past_their_retention_are_deleted_with_their_logs);
async fn ended_records_past_their_retention_are_deleted_with_their_logs() {
    let s =
        Server::start_with(&["--record-retention", "1s", "--reconcile-interval-ms", "100"]).await;
    let ended = s.acquire_ok("ret/ended", "a").await;
    let ended_id = ended["id"].as_str().expect("id").to_owned();
    let released = s.lease_op(&ended_id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK);
    let held = s.acquire_ok("ret/held", "a").await;
    let p = s
        .spawn(json!({"kind": "t", "command": {"argv": ["/bin/echo", "bye"]}}))
        .await;
    let pid = p["id"].as_str().expect("id").to_owned();
    let out = p["logs"]["stdout"].as_str().expect("log path").to_owned();
    s.eventually(
        &format!("/v1/processes/{pid}"),
        Duration::from_secs(10),
        |v| v["state"] == "exited",
    )
    .await;
    assert!(Path::new(&out).exists());

    // Once ended for a second, both go at the next pass of the reconciler.
    s.eventually(
        &format!("/v1/leases/{ended_id}"),
        Duration::from_secs(20),
        |v| v["code"] == "not_found",
    )
    .await;
    s.eventually(
        &format!("/v1/processes/{pid}"),
        Duration::from_secs(20),
        |v| v["code"] == "not_found",
    )
    .await;
    // Removed just after the deletion commits (never before: a deletion
    // that fails must not cost a kept record its logs).
    assert!(
        crate::support::until(Duration::from_secs(10), || !Path::new(&out).exists()).await,
        "its log file went with it"
    );
    assert_eq!(
        s.lease(held["id"].as_str().expect("id")).await["state"],
        "active"
    );
    let again = s.acquire_ok("ret/ended", "b").await;
    assert_eq!(again["token"], 2, "tokens go on past a deleted lease");
}

stores!(with_retention_off_ended_records_stay);
async fn with_retention_off_ended_records_stay() {
    let s =
        Server::start_with(&["--record-retention", "off", "--reconcile-interval-ms", "50"]).await;
    let l = s.acquire_ok("ret/off", "a").await;
    let id = l["id"].as_str().expect("id");
    assert_eq!(
        s.lease_op(id, "release", json!({"token": 1})).await.status,
        StatusCode::OK
    );
    // Well past what a 1 s retention would keep, several passes later.
    s.reconciler_passes(30).await;
    let got = s.get(&format!("/v1/leases/{id}")).await;
    assert_eq!(got.status, StatusCode::OK, "{}", got.body);
}
