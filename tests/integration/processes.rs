//! Managed processes over HTTP, with real children and real signals.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::{Proc, Seen, Server, alive, group_members, until};

fn id(v: &serde_json::Value) -> String {
    v["id"].as_str().expect("id").to_owned()
}

stores!(spawn_with_ports_passes_them_and_captures_output);
async fn spawn_with_ports_passes_them_and_captures_output() {
    let s = Server::start().await;
    let p = s
        .spawn(json!({
            "kind": "dev-server",
            "command": {"argv": ["sh", "-c", "echo http=$PORT_HTTP debug=$PORT_DEBUG port=$PORT extra=$EXTRA held=${HOLDFAST_LOG:-none}; echo oops >&2; sleep 600"],
                        "env": {"EXTRA": "x y"}},
            "ports": ["http", "debug"],
            "metadata": {"team": "a"},
        }))
        .await;
    assert_eq!(p["state"], "running");
    assert_eq!(p["spawned"], true);
    assert_eq!(p["token"], 1);
    assert_eq!(p["status"], "live");
    assert_eq!(p["pgid"], p["pid"], "a spawned child leads its own group");
    assert_eq!(p["exit"], json!({"code": null, "signal": null}));
    let (http, debug) = (
        p["ports"]["http"].as_u64().expect("http"),
        p["ports"]["debug"].as_u64().expect("debug"),
    );
    assert_ne!(http, debug);
    assert!((20000..=29999).contains(&http));
    let pid = id(&p);
    let expected = format!("http={http} debug={debug} port={http} extra=x y held=none\n");
    let mut out = String::new();
    until(Duration::from_secs(5), || {
        out = std::fs::read_to_string(p["logs"]["stdout"].as_str().expect("path"))
            .unwrap_or_default();
        !out.is_empty()
    })
    .await;
    assert_eq!(out, expected);
    let (status, body, next) = s.logs(&pid, "stream=stdout").await;
    assert_eq!(
        (status, body.as_str(), next),
        (
            StatusCode::OK,
            expected.as_str(),
            Some(expected.len() as u64)
        )
    );
    let (_, tail, next) = s.logs(&pid, "offset=5&limit=4").await;
    assert_eq!((tail.as_str(), next), (&expected[5..9], Some(9)));
    let (status, empty, _) = s.logs(&pid, "offset=100000").await;
    assert_eq!((status, empty.as_str()), (StatusCode::OK, ""));
    assert_eq!(s.logs(&pid, "stream=stderr").await.1, "oops\n");
    assert_eq!(
        s.logs(&pid, "limit=2000000").await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let ports = s.get("/v1/ports").await.body;
    let held: Vec<_> = ports["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|r| r["port"].as_u64())
        .collect();
    assert!(held.contains(&Some(http)) && held.contains(&Some(debug)));

    let stopped = s.process_op(&pid, "stop", json!({"token": 1})).await;
    assert_eq!(stopped.status, StatusCode::OK, "{}", stopped.body);
    assert_eq!(stopped.body["state"], "stopped");
    assert_eq!(
        stopped.body["ports"],
        json!({}),
        "ports end with their owner"
    );
    assert_eq!(s.get("/v1/ports").await.body["items"], json!([]));
    let kinds: Vec<_> = s
        .all_events()
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        kinds,
        [
            "process.registered",
            "port.reserved",
            "port.reserved",
            "process.running",
            "port.released",
            "port.released",
            "process.stopped"
        ]
    );
}

stores!(exit_code_and_killing_signal_are_recorded);
async fn exit_code_and_killing_signal_are_recorded() {
    let s = Server::start().await;
    let p = s
        .spawn(json!({"kind": "job", "command": {"argv": ["sh", "-c", "exit 3"]}}))
        .await;
    let path = format!("/v1/processes/{}", id(&p));
    let done = s
        .eventually(&path, Duration::from_secs(5), |v| v["state"] == "exited")
        .await;
    assert_eq!(done["exit"], json!({"code": 3, "signal": null}));
    assert_eq!(done["end_reason"], "exited");

    let p = s
        .spawn(json!({"kind": "job", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let pid = p["pid"].as_i64().expect("pid");
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    let path = format!("/v1/processes/{}", id(&p));
    let done = s
        .eventually(&path, Duration::from_secs(5), |v| v["state"] == "exited")
        .await;
    assert_eq!(done["exit"], json!({"code": null, "signal": 9}));
    let stop = s.process_op(&id(&p), "stop", json!({"token": 1})).await;
    assert_eq!(
        stop.status,
        StatusCode::OK,
        "stopping an ended process answers it as it is"
    );
    assert_eq!(stop.body["state"], "exited");
}

stores!(the_stop_answer_and_its_event_say_how_the_process_ended);
async fn the_stop_answer_and_its_event_say_how_the_process_ended() {
    // A reconciler pass every 10 ms races each stop: it may end a record
    // whose process it sees gone before the stop does.
    let s = Server::start_with(&["--reconcile-interval-ms", "10"]).await;
    // The races seen before: the stop saw the child go before the reaper's
    // exit status was recorded, or a reconciler pass ended the record first.
    for round in 0..20 {
        let p = s
            .spawn(
                json!({"kind": "job", "command": {"argv": ["sh", "-c", "echo hi; exec sleep 30"]}}),
            )
            .await;
        let stop = s
            .process_op(&id(&p), "stop", json!({"token": p["token"]}))
            .await;
        assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
        assert_eq!(stop.body["state"], "stopped");
        assert_eq!(
            stop.body["exit"],
            json!({"code": null, "signal": 15}),
            "round {round}: the stop answer says SIGTERM ended it"
        );
        let stopped: Vec<_> = s
            .all_events()
            .await
            .into_iter()
            .filter(|e| e["type"] == "process.stopped" && e["process"]["id"] == p["id"])
            .collect();
        assert_eq!(stopped.len(), 1);
        assert_eq!(
            stopped[0]["process"]["exit"],
            json!({"code": null, "signal": 15})
        );
    }
}

stores!(a_spawn_and_its_stop_take_two_durable_commits_and_a_registration_one);
/// A spawn's record is committed without an fsync before the child starts
/// (docs/durability.md says why that is safe); its answer waits for the
/// durable commit of the started child, as a stop's waits for its end's.
async fn a_spawn_and_its_stop_take_two_durable_commits_and_a_registration_one() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let before = s.durable_transactions().await;
    let p = s
        .spawn(json!({"kind": "job", "command": {"argv": ["sleep", "30"]}}))
        .await;
    assert_eq!(p["state"], "running", "{p}");
    assert_eq!(s.durable_transactions().await - before, 1, "the spawn");
    let before = s.durable_transactions().await;
    let stop = s
        .process_op(&id(&p), "stop", json!({"token": p["token"]}))
        .await;
    assert_eq!(stop.body["state"], "stopped", "{}", stop.body);
    assert_eq!(s.durable_transactions().await - before, 1, "the stop");
    let before = s.durable_transactions().await;
    let r = s.post("/v1/processes", json!({"kind": "worker"})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the registration"
    );
}

stores!(a_program_that_cannot_run_is_422_and_nothing_is_recorded);
async fn a_program_that_cannot_run_is_422_and_nothing_is_recorded() {
    let s = Server::start().await;
    for argv in [
        json!(["/nonexistent/prog"]),
        json!(["no-such-program-anywhere"]),
        json!(["/etc/hostname"]),
    ] {
        let r = s
            .post(
                "/v1/processes",
                json!({"kind": "x", "command": {"argv": argv}}),
            )
            .await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{argv}: {}",
            r.body
        );
        assert_eq!(r.body["field"], "command.argv");
    }
    let r = s
        .post(
            "/v1/processes",
            json!({"kind": "x", "command": {"argv": ["true"], "cwd": "/nonexistent"}}),
        )
        .await;
    assert_eq!(r.body["field"], "command.cwd");
    for (body, field) in [
        (
            json!({"kind": "x", "command": {"argv": []}}),
            "command.argv",
        ),
        (json!({"kind": "", "command": {"argv": ["true"]}}), "kind"),
        (json!({"kind": "x", "ports": ["Bad"]}), "ports.0"),
        (json!({"kind": "x", "ports": ["a", "a"]}), "ports.1"),
        (
            json!({"kind": "x", "command": {"argv": ["true"], "env": {"A=B": "c"}}}),
            "command.env.A=B",
        ),
        (
            json!({"kind": "x", "command": {"argv": ["true"], "shell": true}}),
            "command.shell",
        ),
    ] {
        let r = s.post("/v1/processes", body.clone()).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(r.body["field"], field, "{body}: {}", r.body);
    }
    assert_eq!(
        s.get("/v1/processes?state=all").await.body["items"],
        json!([])
    );
    assert_eq!(s.all_events().await, Vec::<serde_json::Value>::new());
}

stores!(register_confirm_and_stop_a_process_the_client_started);
async fn register_confirm_and_stop_a_process_the_client_started() {
    let s = Server::start().await;
    let mut child = Proc::sleep();
    let r = s
        .post(
            "/v1/processes",
            json!({"kind": "worker", "operation_id": "op-1"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["state"], "starting");
    assert_eq!(r.body["pid"], json!(null));
    let pid_ = id(&r.body);
    assert_eq!(
        s.logs(&pid_, "").await.0,
        StatusCode::NOT_FOUND,
        "no logs for a registered process"
    );

    let wrong = s
        .process_op(&pid_, "confirm", json!({"token": 2, "pid": child.pid()}))
        .await;
    assert_eq!(wrong.code(), "fenced");
    let gone = s
        .process_op(&pid_, "confirm", json!({"token": 1, "pid": 2_147_483_000}))
        .await;
    assert_eq!(
        (gone.status, gone.code()),
        (StatusCode::UNPROCESSABLE_ENTITY, "process_not_found")
    );
    // The start time the client saw tells its child from a process that
    // got the pid after it died.
    let other = s
        .process_op(
            &pid_,
            "confirm",
            json!({"token": 1, "pid": child.pid(), "start_time": "1"}),
        )
        .await;
    assert_eq!(
        (other.status, other.code()),
        (StatusCode::CONFLICT, "identity_mismatch"),
        "{}",
        other.body
    );
    assert_eq!(s.process(&pid_).await["state"], "starting");
    let started = crate::support::start_time(child.pid());
    let ok = s
        .process_op(
            &pid_,
            "confirm",
            json!({"token": 1, "pid": child.pid(), "start_time": started}),
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert_eq!(ok.body["state"], "running");
    assert_eq!(ok.body["identity"]["start_time"], started);
    assert_eq!(ok.body["pid"], child.pid());
    assert_eq!(
        ok.body["pgid"],
        json!(null),
        "not confirmed as a group leader"
    );
    let again = s
        .process_op(&pid_, "confirm", json!({"token": 1, "pid": child.pid()}))
        .await;
    assert_eq!(
        again.status,
        StatusCode::OK,
        "confirming the same pid again is idempotent"
    );

    let busy = s
        .post(
            "/v1/processes",
            json!({"kind": "worker", "operation_id": "op-1"}),
        )
        .await;
    assert_eq!(
        (busy.status, busy.code()),
        (StatusCode::CONFLICT, "operation_in_progress")
    );
    assert_eq!(busy.body["process"]["id"], pid_.as_str());

    let alive_finish = s
        .process_op(&pid_, "finish", json!({"token": 1, "state": "stopped"}))
        .await;
    assert_eq!(
        alive_finish.code(),
        "process_alive",
        "a live process never loses its operation id"
    );

    let hb = s
        .process_op(&pid_, "heartbeat", json!({"token": 1, "ttl_ms": 30000}))
        .await;
    assert_eq!(hb.status, StatusCode::OK);
    assert!(hb.body["expires_at"].is_string());
    assert_eq!(
        s.process_op(&pid_, "heartbeat", json!({"token": 9}))
            .await
            .code(),
        "fenced"
    );

    let stop = s
        .process_op(&pid_, "stop", json!({"token": 1, "grace_ms": 2000}))
        .await;
    assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
    assert_eq!(stop.body["state"], "stopped");
    let status = child.child.wait().await.expect("reap");
    assert!(!status.success(), "our sleep was terminated");

    let next = s
        .post(
            "/v1/processes",
            json!({"kind": "worker", "operation_id": "op-1"}),
        )
        .await;
    assert_eq!(
        next.status,
        StatusCode::CREATED,
        "the operation id is free again"
    );
    let nid = id(&next.body);
    let stop_starting = s.process_op(&nid, "stop", json!({"token": 1})).await;
    assert_eq!(
        stop_starting.body["state"], "stopped",
        "a starting record stops without any signal"
    );
}

stores!(a_leader_confirmed_without_its_group_is_stopped_alone);
async fn a_leader_confirmed_without_its_group_is_stopped_alone() {
    let s = Server::start().await;
    for with_group in [false, true] {
        let (mut leader, pid, member) = crate::support::shell_with_a_member().await;
        let r = s.post("/v1/processes", json!({"kind": "worker"})).await;
        let confirmed = s
            .process_op(
                &id(&r.body),
                "confirm",
                json!({"token": 1, "pid": pid, "process_group": with_group}),
            )
            .await;
        assert_eq!(confirmed.status, StatusCode::OK, "{}", confirmed.body);
        assert_eq!(
            (&confirmed.body["identity"]["pgid"], &confirmed.body["pgid"]),
            (&json!(pid), &json!(with_group.then_some(pid))),
            "the identity says the group it is in; pgid, the group a stop signals"
        );
        let stop = s
            .process_op(&id(&r.body), "stop", json!({"token": 1, "grace_ms": 2000}))
            .await;
        assert_eq!(stop.body["state"], "stopped", "{}", stop.body);
        assert_eq!(member.runs(), !with_group, "process_group: {with_group}");
        member.kill();
        leader.wait().await.expect("reap the shell");
    }
}

stores!(finish_reports_a_client_run_process_and_is_idempotent);
async fn finish_reports_a_client_run_process_and_is_idempotent() {
    let s = Server::start().await;
    let mut child = Proc::sleep();
    let r = s
        .post(
            "/v1/processes",
            json!({"kind": "task", "operation_id": "op-f"}),
        )
        .await;
    let pid_ = id(&r.body);
    s.process_op(&pid_, "confirm", json!({"token": 1, "pid": child.pid()}))
        .await;
    child.kill_and_reap().await;
    // The watcher may already have recorded the exit; finish then answers it as it is.
    let f = s
        .process_op(
            &pid_,
            "finish",
            json!({"token": 1, "state": "failed", "reason": "tests failed", "exit_code": 2}),
        )
        .await;
    assert_eq!(f.status, StatusCode::OK, "{}", f.body);
    assert!(
        f.body["state"] == "failed" || f.body["state"] == "exited",
        "{}",
        f.body
    );
    let again = s
        .process_op(&pid_, "finish", json!({"token": 1, "state": "failed"}))
        .await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["state"], f.body["state"]);

    let r = s
        .post(
            "/v1/processes",
            json!({"kind": "task", "operation_id": "op-f"}),
        )
        .await;
    let pid2 = id(&r.body);
    let f = s
        .process_op(
            &pid2,
            "finish",
            json!({"token": 1, "state": "failed", "reason": "never started", "exit_code": 2}),
        )
        .await;
    assert_eq!(f.body["state"], "failed");
    assert_eq!(f.body["end_reason"], "never started");
    assert_eq!(f.body["exit"]["code"], 2);
}

stores!(stop_kills_a_group_whose_leader_ignores_sigterm_grandchildren_included);
async fn stop_kills_a_group_whose_leader_ignores_sigterm_grandchildren_included() {
    let s = Server::start().await;
    // The ignored TERM is inherited by the children too: only KILL ends them.
    let p = s
        .spawn(json!({"kind": "stubborn", "command": {"argv": ["sh", "-c", "trap '' TERM; sleep 600 & sleep 600 & echo ready; wait; wait"]}}))
        .await;
    let pgid = p["pgid"].as_i64().expect("pgid");
    assert!(
        until(Duration::from_secs(5), || group_members(pgid).len() == 3).await,
        "leader and two children"
    );
    let members: Vec<Seen> = group_members(pgid).into_iter().map(Seen::now).collect();
    let started = std::time::Instant::now();
    let stop = s
        .process_op(
            &id(&p),
            "stop",
            json!({"token": 1, "grace_ms": 300, "reason": "test"}),
        )
        .await;
    assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
    assert_eq!(stop.body["state"], "stopped");
    assert_eq!(stop.body["end_reason"], "test");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "TERM was ignored for the grace period"
    );
    for member in &members {
        assert!(!member.runs(), "{member:?} survived the stop");
    }
    assert!(group_members(pgid).is_empty());
    // The grandchildren were orphaned by the shell and inherited by the
    // server (a child subreaper), which reaps them: no zombie is left.
    let server = crate::support::server_pid(&s);
    let reaped = until(Duration::from_secs(5), || {
        members.iter().all(|member| !member.present())
    })
    .await;
    assert!(reaped, "zombies left under server {server}");
}

stores!(stop_reaches_a_leader_that_left_its_group_and_not_the_group_it_joined);
async fn stop_reaches_a_leader_that_left_its_group_and_not_the_group_it_joined() {
    let s = Server::start().await;
    // The child starts a group of its own (a bystander's, for this test),
    // then moves into it: its recorded group is left empty.
    let script = "$| = 1; my $g = fork() // die; \
        if ($g == 0) { setpgrp(0, 0) or die; sleep 600; exit 0 } \
        select(undef, undef, undef, 0.01) until getpgrp($g) == $g; \
        setpgrp(0, $g) or die \"setpgid: $!\"; sleep 600";
    let p = s
        .spawn(json!({"kind": "leaver", "command": {"argv": ["perl", "-e", script]}}))
        .await;
    let leader = p["pid"].as_i64().expect("pid");
    assert_eq!(p["pgid"].as_i64(), Some(leader), "{p}");
    let joined = || {
        i32::try_from(leader)
            .ok()
            .and_then(crate::kill::stat)
            .map(|st| i64::from(st.pgrp))
            .filter(|&g| g != leader)
    };
    assert!(
        until(Duration::from_secs(10), || joined().is_some()).await,
        "it never moved"
    );
    let bystander = Seen::now(joined().expect("the group it joined"));
    let stop = s
        .process_op(&id(&p), "stop", json!({"token": 1, "grace_ms": 2000}))
        .await;
    assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
    assert_eq!(stop.body["state"], "stopped", "{}", stop.body);
    assert!(
        !Seen::recorded(&p).runs(),
        "the recorded process was not reached"
    );
    assert!(bystander.runs(), "the group it joined was signalled");
    bystander.kill();
}

/// On disk as on the API: the database holds the spawned commands'
/// environments, the logs their output; neither is for other local users.
#[tokio::test]
async fn the_data_dir_its_database_and_logs_are_the_server_s_alone() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("state/holdfast");
    let s = Server::start_in(&data, &[]).await;
    let p = s
        .spawn(
            json!({"kind": "secret", "command": {"argv": ["sh", "-c", "echo $TOKEN"],
                      "env": {"TOKEN": "s3cret"}}}),
        )
        .await;
    let mode = |path: &std::path::Path| {
        std::fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    for dir in [data.clone(), data.join("logs")] {
        assert_eq!(mode(&dir), 0o700, "{}", dir.display());
    }
    for file in ["holdfast.db", "holdfast.db-wal"] {
        assert_eq!(mode(&data.join(file)), 0o600, "{file}");
    }
    for log in ["stdout", "stderr"] {
        let path = p["logs"][log].as_str().expect("log path");
        assert_eq!(mode(std::path::Path::new(path)), 0o600, "{path}");
    }
    assert!(
        !s.logged("other local users may read"),
        "its own dirs are private"
    );
    s.kill9().await;
    // One made open before (an older version's) keeps its mode, and is said.
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let s = Server::start_in(&data, &[]).await;
    assert!(s.logged("other local users may read"), "no warning");
}

stores!(stop_without_force_leaves_a_stubborn_tree_running);
async fn stop_without_force_leaves_a_stubborn_tree_running() {
    let s = Server::start().await;
    let p = s.spawn(json!({"kind": "stubborn", "command": {"argv": ["sh", "-c", "trap '' TERM; sleep 600 & wait"]}})).await;
    let pgid = p["pgid"].as_i64().expect("pgid");
    assert!(until(Duration::from_secs(5), || group_members(pgid).len() == 2).await);
    let r = s
        .process_op(
            &id(&p),
            "stop",
            json!({"token": 1, "grace_ms": 200, "force": false}),
        )
        .await;
    assert_eq!(
        (r.status, r.code()),
        (StatusCode::CONFLICT, "process_tree_not_settled")
    );
    assert_eq!(r.body["current"]["state"], "running");
    assert_eq!(group_members(pgid).len(), 2);
    let r = s
        .process_op(&id(&p), "stop", json!({"token": 1, "grace_ms": 100}))
        .await;
    assert_eq!(r.body["state"], "stopped");
}

stores!(pid_1_kernel_threads_and_the_server_itself_are_never_confirmed);
async fn pid_1_kernel_threads_and_the_server_itself_are_never_confirmed() {
    let s = Server::start().await;
    let me = crate::support::server_pid(&s);
    // pid 2 is kthreadd on a host: kernel threads are never signalled either.
    let kthreadd =
        std::fs::read_to_string("/proc/2/stat").is_ok_and(|st| st.contains("(kthreadd)"));
    let pids: Vec<i64> = if kthreadd {
        vec![1, me, 2]
    } else {
        vec![1, me]
    };
    for pid in pids {
        let r = s.post("/v1/processes", json!({"kind": "x"})).await;
        let c = s
            .process_op(&id(&r.body), "confirm", json!({"token": 1, "pid": pid}))
            .await;
        assert_eq!(
            (c.status, c.code()),
            (StatusCode::FORBIDDEN, "forbidden"),
            "pid {pid}: {}",
            c.body
        );
        assert_eq!(
            s.process(&id(&r.body)).await["state"],
            "starting",
            "nothing changed"
        );
    }
}

stores!(stop_after_pid_reuse_signals_nothing_and_says_identity_mismatch);
async fn stop_after_pid_reuse_signals_nothing_and_says_identity_mismatch() {
    let s = Server::start().await;
    let mut child = Proc::sleep();
    let pid = child.pid();
    let r = s.post("/v1/processes", json!({"kind": "reuse"})).await;
    let pid_ = id(&r.body);
    let c = s
        .process_op(&pid_, "confirm", json!({"token": 1, "pid": pid}))
        .await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.body);
    child.kill_and_reap().await;
    let Some(mut impostor) = crate::owners::spawn_with_pid(pid).await else {
        eprintln!(
            "SKIPPED stop_after_pid_reuse: cannot steer pids (needs root and /proc/sys/kernel/ns_last_pid)"
        );
        return;
    };
    let r = s
        .process_op(&pid_, "stop", json!({"token": 1, "grace_ms": 100}))
        .await;
    // The watcher may have seen the first process exit already: then the
    // record is simply `exited` and there was nothing to stop.
    if r.status == StatusCode::CONFLICT {
        assert_eq!(r.code(), "identity_mismatch", "{}", r.body);
        assert_eq!(r.body["current"]["state"], "exited");
    } else {
        assert_eq!(r.body["state"], "exited", "{}", r.body);
    }
    assert!(
        alive(pid),
        "the process that now has the pid was not signalled"
    );
    assert!(impostor.try_wait().expect("try_wait").is_none());
    let _ = impostor.start_kill();
    let _ = impostor.wait().await;
}

stores!(a_page_of_processes_shows_each_ones_own_ports);
async fn a_page_of_processes_shows_each_ones_own_ports() {
    let s = Server::start().await;
    let a = s
        .spawn(json!({"kind": "job", "ports": ["http", "debug"], "command": {"argv": ["sleep", "30"]}}))
        .await;
    let b = s
        .spawn(json!({"kind": "job", "ports": ["db"], "command": {"argv": ["sleep", "30"]}}))
        .await;
    let c = s
        .spawn(json!({"kind": "job", "command": {"argv": ["sleep", "30"]}}))
        .await;
    let page = s.get("/v1/processes").await;
    assert_eq!(page.status, StatusCode::OK);
    let items = page.body["items"].as_array().expect("items");
    let ports_of = |p: &serde_json::Value| {
        items
            .iter()
            .find(|i| i["id"] == p["id"])
            .map(|i| i["ports"].clone())
            .expect("listed")
    };
    assert_eq!(ports_of(&a), a["ports"]);
    assert_eq!(ports_of(&b), b["ports"]);
    assert_eq!(ports_of(&c), json!({}));
    assert_eq!(a["ports"].as_object().map(|m| m.len()), Some(2));
    for p in [&a, &b, &c] {
        let r = s
            .process_op(&id(p), "stop", json!({"token": p["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);
    }
}

/// As in a container: the server's group and session leaders are outside
/// its PID namespace, so getpgrp(2) and getsid(2) read 0. It must start and
/// manage processes all the same (it panicked at start-up before).
#[tokio::test]
async fn a_server_whose_session_is_outside_its_pid_namespace_works() {
    let probe = tokio::process::Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .output()
        .await;
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: this machine cannot make a PID namespace: {probe:?}");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = Server::start_under(
        // --kill-child: the server goes with the unshare that the test kills.
        &["unshare", "--pid", "--kill-child", "--mount-proc"],
        tmp.path(),
        &["--reconcile-interval-ms", "100"],
    )
    .await;
    let p = s
        .spawn(json!({"kind": "ns", "command": {"argv": ["sleep", "600"]}}))
        .await;
    assert_eq!(p["state"], "running");
    let stop = s
        .process_op(&id(&p), "stop", json!({"token": p["token"]}))
        .await;
    assert_eq!(stop.status, StatusCode::OK, "{:?}", stop.body);
    assert_eq!(stop.body["state"], "stopped");
    assert_eq!(stop.body["exit"]["signal"], 15);
}
