//! Processes whose owner went away are claimed and stopped; after a
//! restart, running processes are found again and watched.

use std::os::unix::process::CommandExt;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Proc, Seen, Server, alive};

fn id(v: &serde_json::Value) -> String {
    v["id"].as_str().expect("id").to_owned()
}

stores!(a_process_is_stopped_when_its_lease_holder_dies);
async fn a_process_is_stopped_when_its_lease_holder_dies() {
    let s = Server::start_with(&["--reconcile-interval-ms", "100"]).await;
    let mut holder = Proc::sleep();
    let lease = s
        .acquire(
            json!({"resource": "ws/orphan", "holder": "runner", "owner": {"pid": holder.pid()}}),
        )
        .await
        .body;
    let lease_ref = json!({"id": lease["id"], "token": lease["token"]});
    let p = s.spawn(json!({"kind": "dev", "lease": lease_ref, "command": {"argv": ["sleep", "600"]}, "ports": ["http"]})).await;
    assert_eq!(p["lease"], lease_ref);

    holder.kill_and_reap().await;
    let path = format!("/v1/processes/{}", id(&p));
    let done = s
        .eventually(&path, Duration::from_secs(10), |v| v["state"] == "stopped")
        .await;
    assert_eq!(done["end_reason"], "orphan_reconciled");
    assert_eq!(done["token"], 2, "claiming fenced the old token");
    assert_eq!(done["ports"], json!({}));
    assert!(!Seen::recorded(&p).runs());
    let stale = s
        .process_op(&id(&p), "heartbeat", json!({"token": 1}))
        .await;
    assert_eq!(stale.code(), "fenced");

    let kinds: Vec<String> = s
        .all_events()
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect();
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "lease.reclaimed")
        .collect();
    assert_eq!(
        tail,
        [
            "lease.reclaimed",
            "process.orphaned",
            "port.released",
            "process.stopped"
        ]
    );
}

stores!(a_process_with_a_live_owner_is_never_claimed);
async fn a_process_with_a_live_owner_is_never_claimed() {
    let s = Server::start_with(&["--reconcile-interval-ms", "50"]).await;
    let owner = Proc::sleep();
    let p = s.spawn(json!({"kind": "dev", "ttl_ms": 1000, "owner": {"pid": owner.pid()}, "command": {"argv": ["sleep", "600"]}})).await;
    let path = format!("/v1/processes/{}", id(&p));
    // Well past the TTL, many passes later.
    let expired = s
        .eventually(&path, Duration::from_secs(5), |v| {
            v["expires_at"].as_str() < Some(crate::leases::now_text().as_str())
        })
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = s.process(&id(&p)).await;
    assert_eq!(now["state"], "running", "{now}");
    assert_eq!(now["token"], expired["token"]);
}

stores!(a_process_whose_heartbeats_stop_is_claimed);
async fn a_process_whose_heartbeats_stop_is_claimed() {
    let s = Server::start_with(&["--reconcile-interval-ms", "50"]).await;
    let p = s
        .spawn(json!({"kind": "dev", "ttl_ms": 1000, "command": {"argv": ["sleep", "600"]}}))
        .await;
    let path = format!("/v1/processes/{}", id(&p));
    let done = s
        .eventually(&path, Duration::from_secs(10), |v| v["state"] == "stopped")
        .await;
    assert_eq!(done["end_reason"], "orphan_reconciled");
    assert!(!Seen::recorded(&p).runs());
}

stores!(after_a_restart_running_processes_are_watched_again);
async fn after_a_restart_running_processes_are_watched_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let a = s
        .spawn(json!({"kind": "dev", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let b = s
        .spawn(json!({"kind": "dev", "command": {"argv": ["sleep", "600"]}}))
        .await;
    s.kill9().await;

    let s = Server::start_in(dir.path(), &[]).await;
    let a_now = s.process(&id(&a)).await;
    assert_eq!(
        (a_now["state"].as_str(), a_now["status"].as_str()),
        (Some("running"), Some("live"))
    );
    let a_pid = a["pid"].as_i64().expect("pid");
    std::process::Command::new("kill")
        .args(["-9", &a_pid.to_string()])
        .status()
        .expect("kill");
    let path = format!("/v1/processes/{}", id(&a));
    let ended = s
        .eventually(&path, Duration::from_secs(5), |v| v["state"] == "exited")
        .await;
    assert_eq!(
        ended["exit"]["code"],
        json!(null),
        "not our child any more: the code is unknown"
    );

    let stop = s
        .process_op(&id(&b), "stop", json!({"token": 1, "grace_ms": 2000}))
        .await;
    assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
    assert_eq!(stop.body["state"], "stopped");
    assert!(!Seen::recorded(&b).runs());
}

stores!(another_hosts_process_is_never_signalled);
async fn another_hosts_process_is_never_signalled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &["--host-id", "host-a"]).await;
    let p = s
        .spawn(json!({"kind": "dev", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let pid = p["pid"].as_i64().expect("pid");
    s.kill9().await;

    let s = Server::start_in(dir.path(), &["--host-id", "host-b"]).await;
    let seen = s.process(&id(&p)).await;
    assert_eq!(seen["status"], "remote");
    let r = s.process_op(&id(&p), "stop", json!({"token": 1})).await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "remote_process")
    );
    assert!(alive(pid));
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
}

stores!(a_child_spawned_before_a_crash_is_adopted_though_its_pid_was_not_recorded);
async fn a_child_spawned_before_a_crash_is_adopted_though_its_pid_was_not_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let p = s
        .spawn(json!({"kind": "dev", "operation_id": "op-crash", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let pid = p["pid"].as_i64().expect("pid");
    cut_after_the_fork(s, dir.path(), &p).await;

    let s = Server::start_in(dir.path(), &[]).await;
    let now = s.process(&id(&p)).await;
    assert_eq!(
        (
            now["state"].as_str(),
            now["status"].as_str(),
            now["pid"].as_i64()
        ),
        (Some("running"), Some("live"), Some(pid)),
        "{now}"
    );
    let again = s
        .post(
            "/v1/processes",
            json!({"kind": "dev", "operation_id": "op-crash", "command": {"argv": ["sleep", "600"]}}),
        )
        .await;
    assert_eq!(
        again.code(),
        "operation_in_progress",
        "no second copy starts"
    );
    let stop = s
        .process_op(&id(&p), "stop", json!({"token": 1, "grace_ms": 2000}))
        .await;
    assert_eq!(stop.body["state"], "stopped", "{}", stop.body);
    assert!(!Seen::recorded(&p).runs());
}

/// Kill the server as if after the fork of `p`'s spawn, before the second
/// transaction recorded its child.
async fn cut_after_the_fork(s: Server, dir: &std::path::Path, p: &serde_json::Value) {
    s.kill9().await;
    crate::stores::execute_sql(
        dir,
        &format!(
            "UPDATE processes SET state = 'starting', identity = NULL, started_at = NULL \
             WHERE id = '{}'",
            id(p)
        ),
    )
    .await;
}

stores!(a_reader_of_a_cut_spawn_s_log_is_neither_adopted_nor_killed);
async fn a_reader_of_a_cut_spawn_s_log_is_neither_adopted_nor_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let p = s
        .spawn(json!({"kind": "dev", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let child = Seen::recorded(&p);
    cut_after_the_fork(s, dir.path(), &p).await;
    // The child died with the server; a reader of its log (a user's
    // `tail -f`, leading a group of its own, as the child did) is left.
    child.kill();
    let mut reader = std::process::Command::new("tail")
        .args(["-f", p["logs"]["stdout"].as_str().expect("stdout")])
        .process_group(0)
        .spawn()
        .expect("tail");
    let reader_pid = i64::from(reader.id());
    let log = std::fs::canonicalize(p["logs"]["stdout"].as_str().expect("stdout")).expect("log");
    let opened = || {
        std::fs::read_dir(format!("/proc/{reader_pid}/fd")).is_ok_and(|mut fds| {
            fds.any(|fd| fd.is_ok_and(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == log)))
        })
    };
    assert!(crate::support::until(Duration::from_secs(5), opened).await);
    assert!(crate::support::until(Duration::from_secs(5), || !child.runs()).await);

    let s = Server::start_in(dir.path(), &[]).await;
    let now = s.process(&id(&p)).await;
    assert_eq!(
        (now["state"].as_str(), now["end_reason"].as_str()),
        (
            Some("failed"),
            Some("spawn_failed: the server restarted while spawning")
        ),
        "{now}"
    );
    assert!(alive(reader_pid), "the reader was killed");
    reader.kill().expect("kill");
    reader.wait().expect("wait");
}

stores!(an_unconfirmed_registration_ends_with_its_lease);
async fn an_unconfirmed_registration_ends_with_its_lease() {
    let s = Server::start().await;
    let lease = s.acquire_ok("reg/owner", "h").await;
    let lease_id = lease["id"].as_str().expect("id");
    let reg = s
        .spawn(
            json!({"kind": "job", "operation_id": "op-reg", "ports": ["http"],
                      "lease": {"id": lease_id, "token": 1}}),
        )
        .await;
    assert_eq!(reg["state"], "starting");
    let port = reg["ports"]["http"].as_u64().expect("a port");
    s.lease_op(lease_id, "release", json!({"token": 1})).await;
    let path = format!("/v1/processes/{}", id(&reg));
    let ended = s
        .eventually(&path, Duration::from_secs(5), |v| v["state"] == "stopped")
        .await;
    assert_eq!(
        (ended["end_reason"].as_str(), ended["token"].as_i64()),
        (Some("orphan_reconciled"), Some(2)),
        "{ended}"
    );
    let types: Vec<_> = s
        .all_events()
        .await
        .into_iter()
        .filter(|e| e["process"]["id"] == reg["id"] || e["port"]["port"] == port)
        .map(|e| e["type"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        types,
        [
            "process.registered",
            "port.reserved",
            "process.orphaned",
            "port.released",
            "process.stopped"
        ]
    );
    let ports = s.get("/v1/ports").await;
    assert_eq!(ports.body["items"], json!([]), "its port is free");
    let next = s
        .post(
            "/v1/processes",
            json!({"kind": "job", "operation_id": "op-reg"}),
        )
        .await;
    assert_eq!(next.status, StatusCode::CREATED, "{}", next.body);
}

stores!(a_released_lease_takes_its_processes_with_it_between_timed_passes);
async fn a_released_lease_takes_its_processes_with_it_between_timed_passes() {
    // Only the pass at startup is timed within the test: what follows is
    // done by the passes a lease's end starts.
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let first = s.acquire_ok("ws/none", "h").await;
    let r = s
        .lease_op(
            first["id"].as_str().expect("id"),
            "release",
            json!({"token": 1}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let lease = s.acquire_ok("ws/owned", "h").await;
    let lease_ref = json!({"id": lease["id"], "token": lease["token"]});
    let p = s
        .spawn(json!({"kind": "dev", "lease": lease_ref, "command": {"argv": ["sleep", "600"]}}))
        .await;
    let r = s
        .lease_op(
            lease["id"].as_str().expect("id"),
            "release",
            json!({"token": 1}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let path = format!("/v1/processes/{}", id(&p));
    let done = s
        .eventually(&path, Duration::from_secs(10), |v| v["state"] == "stopped")
        .await;
    assert_eq!(done["end_reason"], "orphan_reconciled");
    assert!(!Seen::recorded(&p).runs());
}

stores!(a_stop_cut_by_a_crash_is_finished_after_the_restart_and_ends_stopped);
async fn a_stop_cut_by_a_crash_is_finished_after_the_restart_and_ends_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let argv = json!({"argv": ["sleep", "600"]});
    let signalled = s.spawn(json!({"kind": "dev", "command": argv})).await;
    let unsignalled = s.spawn(json!({"kind": "dev", "command": argv})).await;
    s.kill9().await;
    // As if the server had been killed inside two stops: one after its
    // SIGTERM ended the process, one before it sent anything.
    let pid = |p: &serde_json::Value| p["pid"].as_i64().expect("pid");
    std::process::Command::new("kill")
        .args(["-TERM", &pid(&signalled).to_string()])
        .status()
        .expect("kill");
    assert!(
        crate::support::until(std::time::Duration::from_secs(10), || {
            !Seen::recorded(&signalled).runs()
        })
        .await
    );
    crate::stores::execute_sql(
        dir.path(),
        &format!(
            "UPDATE processes SET state = 'stopping' WHERE id IN ('{}', '{}')",
            id(&signalled),
            id(&unsignalled)
        ),
    )
    .await;

    let s = Server::start_in(dir.path(), &[]).await;
    for p in [&signalled, &unsignalled] {
        let path = format!("/v1/processes/{}", id(p));
        let now = s
            .eventually(&path, std::time::Duration::from_secs(15), |p| {
                p["state"] != "stopping"
            })
            .await;
        assert_eq!(
            now["state"], "stopped",
            "holdfast's own stop, finished: {now}"
        );
        assert!(!Seen::recorded(p).runs());
    }
}
