//! Leases bound to real processes: taken over as soon as the owner is
//! provably dead, never while it lives.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use tokio::process::Command;

use crate::stores::stores;
use crate::support::{Proc, Server};

stores!(dead_owner_is_reclaimed_at_once_well_before_its_ttl);
async fn dead_owner_is_reclaimed_at_once_well_before_its_ttl() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let mut owner = Proc::sleep();
    let r = s.acquire(json!({"resource": "ws", "holder": "a", "ttl_ms": 3_600_000, "owner": {"pid": owner.pid()}})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let old = r.body;
    assert_eq!(old["owner_status"], "live");
    assert_eq!(old["owner"]["pid"], owner.pid());
    assert!(old["owner"]["start_time"].is_string());

    let held = s
        .acquire(json!({"resource": "ws", "holder": "b", "ttl_ms": 5000}))
        .await;
    assert_eq!(held.code(), "lease_held");

    owner.kill_and_reap().await;
    let got = s.lease(old["id"].as_str().expect("id")).await;
    assert_eq!(got["owner_status"], "dead");
    assert_eq!(got["owner_status_reason"], "pid_absent");

    let r = s
        .acquire(json!({"resource": "ws", "holder": "b", "ttl_ms": 5000}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["token"], 2);
    assert_eq!(
        r.body["reclaimed"],
        json!({"id": old["id"], "token": 1, "reason": "owner_dead:pid_absent"})
    );
    let ended = s.lease(old["id"].as_str().expect("id")).await;
    assert_eq!(ended["state"], "reclaimed");
    assert_eq!(ended["end_reason"], "owner_dead:pid_absent");

    let kinds: Vec<_> = s
        .all_events()
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        kinds,
        ["lease.acquired", "lease.reclaimed", "lease.acquired"],
        "the end comes before the takeover"
    );
}

stores!(an_unreaped_zombie_owner_counts_as_dead);
async fn an_unreaped_zombie_owner_counts_as_dead() {
    let s = Server::start().await;
    let mut owner = Proc::sleep();
    let r = s
        .acquire(json!({"resource": "z", "holder": "a", "owner": {"pid": owner.pid()}}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    owner.child.start_kill().expect("kill");
    // Not reaped: /proc still lists it, as a zombie.
    let path = format!("/v1/leases/{}", r.body["id"].as_str().expect("id"));
    let seen = s
        .eventually(&path, Duration::from_secs(5), |l| {
            l["owner_status"] == "dead" || l["state"] == "reclaimed"
        })
        .await;
    assert!(
        seen["owner_status_reason"] == "pid_absent"
            || seen["end_reason"] == "owner_dead:pid_absent",
        "{seen}"
    );
    owner.child.wait().await.expect("reap");
}

stores!(reconciler_reclaims_a_dead_owners_lease_on_its_own);
async fn reconciler_reclaims_a_dead_owners_lease_on_its_own() {
    let s = Server::start_with(&["--reconcile-interval-ms", "50"]).await;
    let mut owner = Proc::sleep();
    let r = s
        .acquire(json!({"resource": "rc", "holder": "a", "owner": {"pid": owner.pid()}}))
        .await;
    owner.kill_and_reap().await;
    let path = format!("/v1/leases/{}", r.body["id"].as_str().expect("id"));
    let ended = s
        .eventually(&path, Duration::from_secs(5), |l| l["state"] == "reclaimed")
        .await;
    assert_eq!(ended["end_reason"], "owner_dead:pid_absent");
}

stores!(live_owner_past_its_ttl_is_stale_and_never_taken_over);
async fn live_owner_past_its_ttl_is_stale_and_never_taken_over() {
    let s = Server::start_with(&["--reconcile-interval-ms", "50"]).await;
    let owner = Proc::sleep();
    let r = s
        .acquire(
            json!({"resource": "st", "holder": "a", "ttl_ms": 1000, "owner": {"pid": owner.pid()}}),
        )
        .await;
    let id = r.body["id"].as_str().expect("id");
    let path = format!("/v1/leases/{id}");
    let stale = s
        .eventually(&path, Duration::from_secs(5), |l| l["stale"] == true)
        .await;
    assert_eq!(stale["state"], "active");
    assert_eq!(stale["owner_status"], "live");

    let held = s
        .acquire(json!({"resource": "st", "holder": "b", "ttl_ms": 5000, "wait_ms": 300}))
        .await;
    assert_eq!(held.status, StatusCode::CONFLICT);
    assert_eq!(held.code(), "lease_held");
    assert_eq!(held.body["holder"]["stale"], true);
    // Many reconciler passes later it is still the owner's.
    assert_eq!(s.lease(id).await["state"], "active");

    let renew = s.lease_op(id, "renew", json!({"token": 1})).await;
    assert_eq!(
        renew.status,
        StatusCode::OK,
        "a stale lease with a live owner may renew"
    );
    assert_eq!(renew.body["stale"], false);
}

stores!(owner_must_exist_and_match_the_start_time_the_client_saw);
async fn owner_must_exist_and_match_the_start_time_the_client_saw() {
    let s = Server::start().await;
    let owner = Proc::sleep();
    let missing = s
        .acquire(json!({"resource": "o", "holder": "a", "owner": {"pid": 2_147_483_000}}))
        .await;
    assert_eq!(missing.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(missing.code(), "process_not_found");

    let start = crate::support::start_time(owner.pid());
    let ok = s.acquire(json!({"resource": "o", "holder": "a", "owner": {"pid": owner.pid(), "start_time": start}})).await;
    assert_eq!(ok.status, StatusCode::CREATED, "{}", ok.body);
    assert_eq!(ok.body["owner"]["start_time"], start);

    let wrong = s.acquire(json!({"resource": "o2", "holder": "a", "owner": {"pid": owner.pid(), "start_time": "1"}})).await;
    assert_eq!(wrong.status, StatusCode::CONFLICT);
    assert_eq!(wrong.code(), "identity_mismatch");

    let caller = s
        .acquire(json!({"resource": "o3", "holder": "a", "owner": "caller"}))
        .await;
    assert_eq!(
        caller.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "\"caller\" needs the Unix socket"
    );
    assert_eq!(caller.body["field"], "owner");
}

/// Spawn `sleep` until the kernel hands it `pid`, steering it with
/// /proc/sys/kernel/ns_last_pid. None when that is not possible here.
pub async fn spawn_with_pid(pid: i64) -> Option<tokio::process::Child> {
    for _ in 0..50 {
        if std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_err() {
            return None;
        }
        let mut child = Command::new("sleep")
            .arg("600")
            .kill_on_drop(true)
            .spawn()
            .ok()?;
        if child.id().map(i64::from) == Some(pid) {
            return Some(child);
        }
        // Another fork took the pid first; try again.
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    None
}

stores!(reused_owner_pid_is_dead_pid_reused_and_taken_over);
async fn reused_owner_pid_is_dead_pid_reused_and_taken_over() {
    // No reconciler pass between the kill and the reuse, which would see pid_absent.
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let mut owner = Proc::sleep();
    let pid = owner.pid();
    let r = s
        .acquire(json!({"resource": "reuse", "holder": "a", "owner": {"pid": pid}}))
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    owner.kill_and_reap().await;
    let Some(mut impostor) = spawn_with_pid(pid).await else {
        eprintln!(
            "SKIPPED reused_owner_pid: cannot steer pids (needs root and a writable /proc/sys/kernel/ns_last_pid)"
        );
        return;
    };
    let id = r.body["id"].as_str().expect("id");
    let got = s.get(&format!("/v1/leases/{id}")).await.body;
    // The reconciler may already have ended it; either way the reason is the reuse.
    if got["state"] == "active" {
        assert_eq!(got["owner_status"], "dead", "{got}");
        assert_eq!(got["owner_status_reason"], "pid_reused");
        let next = s
            .acquire(json!({"resource": "reuse", "holder": "b", "ttl_ms": 5000}))
            .await;
        assert_eq!(next.status, StatusCode::CREATED, "{}", next.body);
        assert_eq!(next.body["reclaimed"]["reason"], "owner_dead:pid_reused");
    } else {
        assert_eq!(got["end_reason"], "owner_dead:pid_reused", "{got}");
    }
    let _ = impostor.start_kill();
    let _ = impostor.wait().await;
}

stores!(an_owner_on_another_host_falls_back_to_the_ttl);
async fn an_owner_on_another_host_falls_back_to_the_ttl() {
    let dir = tempfile::tempdir().expect("tempdir");
    let owner = Proc::sleep();
    let a = Server::start_in(
        dir.path(),
        &["--host-id", "host-a", "--reconcile-interval-ms", "3600000"],
    )
    .await;
    let pid = owner.pid();
    let no_ttl = a
        .acquire(json!({"resource": "remote/none", "holder": "a", "owner": {"pid": pid}}))
        .await
        .body;
    let ttl = a
        .acquire(
            json!({"resource": "remote/ttl", "holder": "a", "owner": {"pid": pid}, "ttl_ms": 1000}),
        )
        .await
        .body;
    a.kill9().await;

    // The same store seen from "host-b": those owners are remote now.
    let b = Server::start_in(
        dir.path(),
        &["--host-id", "host-b", "--reconcile-interval-ms", "3600000"],
    )
    .await;
    let seen = b.lease(no_ttl["id"].as_str().expect("id")).await;
    assert_eq!(seen["owner_status"], "remote");
    let r = b
        .acquire(json!({"resource": "remote/none", "holder": "b", "ttl_ms": 5000}))
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "owner_remote"),
        "no TTL that could expire"
    );
    // Within its TTL the remote lease is held; past it, it is taken over as expired.
    let r = b
        .acquire(
            json!({"resource": "remote/ttl", "holder": "b", "ttl_ms": 5000, "wait_ms": 10_000}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["reclaimed"]["id"], ttl["id"]);
    assert_eq!(r.body["reclaimed"]["reason"], "ttl_expired");
}
