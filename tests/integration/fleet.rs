//! Two holdfast servers with different host ids on one PostgreSQL: one
//! fleet. These run on PostgreSQL only.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::races::{RESOURCES, check_history, hammer};
use crate::stores::{Store, run, share_database};
use crate::support::{Proc, Seen, Server, alive, metric, token_files};

/// Servers "host-a" and "host-b" on one database, each with its own data
/// directory; `args` go to both.
async fn two_hosts(args: &[&str]) -> (Server, Server, [tempfile::TempDir; 2]) {
    two_hosts_with(args, args).await
}

async fn two_hosts_with(
    a_args: &[&str],
    b_args: &[&str],
) -> (Server, Server, [tempfile::TempDir; 2]) {
    let dirs = [
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    ];
    let a = Server::start_in(dirs[0].path(), &[&["--host-id", "host-a"], a_args].concat()).await;
    share_database(dirs[0].path(), dirs[1].path());
    let b = Server::start_in(dirs[1].path(), &[&["--host-id", "host-b"], b_args].concat()).await;
    (a, b, dirs)
}

fn id(v: &serde_json::Value) -> String {
    v["id"].as_str().expect("id").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_racing_on_two_hosts_keep_one_current_lease_and_increasing_tokens() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "100"]).await;
        let until = Instant::now() + Duration::from_secs(3);
        let tasks: Vec<_> = (0..64)
            .map(|me| {
                let s = if me % 2 == 0 { &a } else { &b };
                tokio::spawn(hammer(s.client.clone(), s.base.clone(), me, until))
            })
            .collect();
        let mut won = 0;
        for t in tasks {
            won += t.await.expect("client").0;
        }
        let events = a.all_events().await;
        let acquired = check_history(&events);
        assert_eq!(
            acquired.values().sum::<usize>(),
            won,
            "every 201 has its event"
        );
        assert_eq!(acquired.len(), RESOURCES);
        assert_eq!(
            b.all_events().await,
            events,
            "one stream, the same on both hosts"
        );
        eprintln!("fleet race: {won} acquisitions by 64 clients on two hosts");
    })
    .await
}

#[tokio::test]
async fn a_lease_owned_on_one_host_is_remote_on_the_other_and_taken_only_after_its_ttl() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "50"]).await;
        let owner = Proc::sleep();
        let held = a
            .acquire(json!({"resource": "fleet/owned", "holder": "a", "owner": {"pid": owner.pid()}, "ttl_ms": 1500}))
            .await;
        assert_eq!(held.status, StatusCode::CREATED, "{}", held.body);
        assert_eq!(a.lease(&id(&held.body)).await["owner_status"], "live");
        assert_eq!(b.lease(&id(&held.body)).await["owner_status"], "remote");

        let r = b
            .acquire(json!({"resource": "fleet/owned", "holder": "b", "ttl_ms": 5000}))
            .await;
        assert_eq!((r.status, r.code()), (StatusCode::CONFLICT, "lease_held"), "{}", r.body);
        let r = b
            .acquire(json!({"resource": "fleet/owned", "holder": "b", "ttl_ms": 5000, "wait_ms": 10_000}))
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        // Either this acquire ended the old lease, or a host's reconciler
        // expired it a moment before the woken waiter tried again.
        if !r.body["reclaimed"].is_null() {
            assert_eq!(r.body["reclaimed"]["id"], held.body["id"]);
            assert_eq!(r.body["reclaimed"]["reason"], "ttl_expired");
        }
        let expired_at = held.body["expires_at"].as_str().expect("expires_at");
        let taken_at = r.body["acquired_at"].as_str().expect("acquired_at");
        assert!(taken_at >= expired_at, "taken at {taken_at}, before the TTL ran out at {expired_at}");
        assert!(r.body["token"].as_i64() > held.body["token"].as_i64());
        let old = a.lease(&id(&held.body)).await;
        assert_eq!((old["state"].as_str(), old["end_reason"].as_str()), (Some("expired"), Some("ttl_expired")));
    })
    .await
}

#[tokio::test]
async fn a_host_never_signals_another_hosts_process_and_claims_only_its_own() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "50"]).await;
        let lease = a.acquire_ok("fleet/proc", "a").await;
        let lease_ref = json!({"id": lease["id"], "token": lease["token"]});
        let p = a
            .spawn(
                json!({"kind": "dev", "lease": lease_ref, "command": {"argv": ["sleep", "600"]}}),
            )
            .await;
        let pid = p["pid"].as_i64().expect("pid");
        assert_eq!(b.process(&id(&p)).await["status"], "remote");
        let r = b.process_op(&id(&p), "stop", json!({"token": 1})).await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::CONFLICT, "remote_process"),
            "{}",
            r.body
        );
        let r = b
            .process_op(&id(&p), "finish", json!({"token": 1, "state": "failed"}))
            .await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::CONFLICT, "remote_process"),
            "B cannot tell that it ended: {}",
            r.body
        );
        assert_eq!(a.process(&id(&p)).await["state"], "running");
        assert!(alive(pid));

        // The lease ends on host B: host A, told through the database,
        // claims and stops its own process; B never touches it.
        let broke = b
            .lease_op(&id(&lease), "break", json!({"reason": "test"}))
            .await;
        assert_eq!(broke.status, StatusCode::OK, "{}", broke.body);
        let path = format!("/v1/processes/{}", id(&p));
        let done = b
            .eventually(&path, Duration::from_secs(10), |v| v["state"] == "stopped")
            .await;
        assert_eq!(done["end_reason"], "orphan_reconciled");
        assert!(!Seen::recorded(&p).runs());
        let stops: Vec<_> = a
            .all_events()
            .await
            .into_iter()
            .filter(|e| e["type"] == "process.stopped")
            .collect();
        assert_eq!(stops.len(), 1, "{stops:?}");
    })
    .await
}

#[tokio::test]
async fn the_admin_ends_the_records_of_a_host_gone_for_good() {
    run(Store::Postgres, async {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (user, admin) = token_files(tmp.path());
        let (user, admin) = (user.display().to_string(), admin.display().to_string());
        let (a, b, _dirs) = two_hosts_with(
            &[],
            &["--auth-token-file", &user, "--admin-token-file", &admin],
        )
        .await;
        let child = Proc::sleep();
        let p = a
            .spawn(json!({"kind": "job", "operation_id": "gone-1"}))
            .await;
        let pid_ = id(&p);
        let confirmed = a
            .process_op(&pid_, "confirm", json!({"token": 1, "pid": child.pid()}))
            .await;
        assert_eq!(confirmed.status, StatusCode::OK, "{}", confirmed.body);
        let port = a
            .post(
                "/v1/ports",
                json!({"names": ["http"], "owner": {"process": {"id": pid_, "token": 1}}}),
            )
            .await;
        assert_eq!(port.status, StatusCode::CREATED, "{}", port.body);
        a.kill9().await;

        // Host B, with tokens.
        let on_b = |path: String, body: Option<serde_json::Value>, token: &'static str| {
            let req = match body {
                Some(body) => b.client.post(b.url(&path)).json(&body),
                None => b.client.get(b.url(&path)),
            };
            async move {
                let res = req.bearer_auth(token).send().await.expect("send");
                let status = res.status();
                let body: serde_json::Value = res.json().await.expect("json");
                (status, body)
            }
        };
        let finish_path = format!("/v1/processes/{pid_}/finish");
        let finish = |host_gone: bool| {
            let mut body =
                json!({"token": 1, "state": "failed", "reason": "host-a decommissioned"});
            if host_gone {
                body["host_gone"] = json!(true);
            }
            Some(body)
        };
        let (status, body) = on_b(finish_path.clone(), finish(false), "admin-secret").await;
        assert_eq!(
            (status, &body["code"]),
            (StatusCode::CONFLICT, &json!("remote_process")),
            "{body}"
        );
        let (status, body) = on_b(finish_path.clone(), finish(true), "user-secret").await;
        assert_eq!(
            (status, &body["code"]),
            (StatusCode::FORBIDDEN, &json!("forbidden")),
            "{body}"
        );
        let (_, now) = on_b(format!("/v1/processes/{pid_}"), None, "user-secret").await;
        assert_eq!(now["state"], "running", "{now}");

        // The admin's word that host-a is gone ends the record, with its
        // operation id and port, and signals nothing.
        let (status, body) = on_b(finish_path, finish(true), "admin-secret").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            (&body["state"], &body["end_reason"]),
            (&json!("failed"), &json!("host-a decommissioned"))
        );
        assert!(alive(child.pid()), "nothing was signalled");
        let create = json!({"kind": "job", "operation_id": "gone-1"});
        let (status, again) = on_b("/v1/processes".into(), Some(create), "user-secret").await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "the operation id is free: {again}"
        );
        let (_, events) = on_b("/v1/events?limit=1000".into(), None, "user-secret").await;
        let released = events["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter(|e| e["type"] == "port.released")
            .count();
        assert_eq!(released, 1, "its port is released: {events}");
    })
    .await
}

#[tokio::test]
async fn when_a_host_dies_the_other_takes_over_its_ttl_leases_after_expiry() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "50"]).await;
        let owner = Proc::sleep();
        let owned = a
            .acquire(json!({"resource": "fleet/dies-owned", "holder": "a", "owner": {"pid": owner.pid()}, "ttl_ms": 1000}))
            .await
            .body;
        let bare = a
            .acquire(json!({"resource": "fleet/dies-bare", "holder": "a", "ttl_ms": 1000}))
            .await
            .body;
        a.kill9().await;

        // B's reconciler expires both, with no acquirer asking.
        for lease in [&owned, &bare] {
            let path = format!("/v1/leases/{}", id(lease));
            let ended = b
                .eventually(&path, Duration::from_secs(10), |v| v["state"] == "expired")
                .await;
            assert!(ended["ended_at"].as_str() >= lease["expires_at"].as_str());
        }
        let next = b.acquire_ok("fleet/dies-owned", "b").await;
        assert!(next["token"].as_i64() > owned["token"].as_i64());
    })
    .await
}

#[tokio::test]
async fn waiters_and_event_readers_on_one_host_wake_for_changes_made_on_the_other() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "3600000"]).await;
        let held = a.acquire_ok("fleet/wake", "a").await;
        let after = b.all_events().await.last().expect("an event")["seq"].clone();

        let waiter = {
            let (client, url) = (b.client.clone(), b.url("/v1/leases"));
            tokio::spawn(async move {
                let started = Instant::now();
                let r = client
                    .post(url)
                    .json(&json!({"resource": "fleet/wake", "holder": "b", "ttl_ms": 60_000, "wait_ms": 20_000}))
                    .send()
                    .await
                    .expect("acquire");
                (r.status(), started.elapsed())
            })
        };
        let poll = {
            let (client, url) = (b.client.clone(), b.url(&format!("/v1/events?after={after}&wait_ms=20000")));
            tokio::spawn(async move {
                let started = Instant::now();
                let r = client.get(url).send().await.expect("events");
                let body: serde_json::Value = r.json().await.expect("json");
                (body, started.elapsed())
            })
        };
        // Let both requests start waiting, then release on the other host.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = a
            .lease_op(&id(&held), "release", json!({"token": held["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);

        let (status, waited) = waiter.await.expect("waiter");
        assert_eq!(status, StatusCode::CREATED);
        assert!(waited < Duration::from_secs(10), "woken by the release, not a timeout: {waited:?}");
        let (events, waited) = poll.await.expect("poll");
        assert_eq!(events["items"][0]["type"], "lease.released", "{events}");
        assert!(waited < Duration::from_secs(10), "{waited:?}");
    })
    .await
}

#[tokio::test]
async fn operation_ids_are_fleet_wide_and_ports_are_per_host() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&[]).await;
        let first = a
            .post(
                "/v1/processes",
                json!({"kind": "job", "operation_id": "deploy-42"}),
            )
            .await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
        let second = b
            .post(
                "/v1/processes",
                json!({"kind": "job", "operation_id": "deploy-42"}),
            )
            .await;
        assert_eq!(
            (second.status, second.code()),
            (StatusCode::CONFLICT, "operation_in_progress"),
            "{}",
            second.body
        );

        // The same port number may be reserved on each host, once.
        let owner = |s: &serde_json::Value| json!({"lease": {"id": s["id"], "token": s["token"]}});
        let la = a.acquire_ok("fleet/ports-a", "a").await;
        let lb = b.acquire_ok("fleet/ports-b", "b").await;
        let range = json!([29_990, 29_990]);
        let pa = a
            .post(
                "/v1/ports",
                json!({"names": ["http"], "owner": owner(&la), "range": range}),
            )
            .await;
        assert_eq!(pa.status, StatusCode::CREATED, "{}", pa.body);
        let pb = b
            .post(
                "/v1/ports",
                json!({"names": ["http"], "owner": owner(&lb), "range": range}),
            )
            .await;
        assert_eq!(pb.status, StatusCode::CREATED, "{}", pb.body);
        assert_eq!(pa.body["ports"]["http"], pb.body["ports"]["http"]);
        let again = a
            .post(
                "/v1/ports",
                json!({"names": ["http"], "owner": owner(&la), "range": range}),
            )
            .await;
        assert_eq!(
            (again.status, again.code()),
            (StatusCode::CONFLICT, "ports_exhausted"),
            "{}",
            again.body
        );
    })
    .await
}

#[tokio::test]
async fn events_pruned_by_one_host_are_410_on_the_other_not_a_silent_gap() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts_with(
            &["--event-retention", "3", "--reconcile-interval-ms", "50"],
            &["--reconcile-interval-ms", "3600000"],
        )
        .await;
        for i in 0..5 {
            a.acquire_ok(&format!("fleet/pruned/{i}"), "a").await;
        }
        // Until the newest 3 of the 5 are all that is left: a pass that
        // began before the last acquire pruned fewer, and counting passes
        // proves nothing (one woken by a commit does not prune).
        a.eventually("/v1/events?after=0", Duration::from_secs(10), |v| {
            v["code"] == "events_pruned" && v["oldest_seq"] == 3
        })
        .await;
        let r = b.get("/v1/events?after=0").await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::GONE, "events_pruned"),
            "{}",
            r.body
        );
        let oldest = r.body["oldest_seq"].as_i64().expect("oldest_seq");
        let r = b.get(&format!("/v1/events?after={}", oldest - 1)).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["items"][0]["seq"], oldest);
    })
    .await
}

/// A host that learnt an older watermark (from its last read) still
/// reports the oldest seq the database keeps now: a reader it sent to a
/// stale one would meet a second `410`.
#[tokio::test]
async fn a_410_names_the_oldest_seq_kept_now_not_the_one_this_host_last_saw() {
    run(Store::Postgres, async {
        // Host a prunes only as it starts (its first pass); b never.
        let a_args = [
            "--event-retention",
            "3",
            "--reconcile-interval-ms",
            "3600000",
        ];
        let (a, b, dirs) = two_hosts_with(&a_args, &["--reconcile-interval-ms", "3600000"]).await;
        let dir = dirs[0].path().to_owned();
        let restart = |a: Server| {
            let dir = dir.clone();
            async move {
                a.kill9().await;
                Server::start_in(&dir, &[&["--host-id", "host-a"], &a_args[..]].concat()).await
            }
        };
        for i in 0..4 {
            a.acquire_ok(&format!("fleet/stale/{i}"), "a").await;
        }
        let a = restart(a).await;
        let oldest = |v: &serde_json::Value, n: i64| v["oldest_seq"] == n;
        a.eventually("/v1/events?after=0", Duration::from_secs(10), |v| {
            oldest(v, 2)
        })
        .await;
        let r = b.get("/v1/events?after=0").await;
        assert_eq!(
            (r.status, r.body["oldest_seq"].as_i64()),
            (StatusCode::GONE, Some(2))
        );

        a.acquire_ok("fleet/stale/4", "a").await;
        let a = restart(a).await;
        a.eventually("/v1/events?after=0", Duration::from_secs(10), |v| {
            oldest(v, 3)
        })
        .await;
        let r = b.get("/v1/events?after=0").await;
        assert_eq!(
            (r.status, r.body["oldest_seq"].as_i64()),
            (StatusCode::GONE, Some(3)),
            "{}",
            r.body
        );
        let r = b.get("/v1/events?after=2").await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    })
    .await
}

#[tokio::test]
async fn wake_ups_across_hosts_survive_dropped_database_connections() {
    run(Store::Postgres, async {
        let (a, b, dirs) = two_hosts(&["--reconcile-interval-ms", "3600000"]).await;
        let held = a.acquire_ok("fleet/reconnect", "a").await;

        // Every connection of both servers to their database is cut.
        let url = crate::stores::database_for(dirs[0].path()).await;
        let name = url.rsplit('/').next().expect("name").to_owned();
        let base = crate::stores::postgres_base().expect("on");
        let mut admin = {
            use sqlx::Connection;
            sqlx::PgConnection::connect(&format!("{base}/postgres"))
                .await
                .expect("connect")
        };
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(&name)
            .execute(&mut admin)
            .await
            .expect("terminate");

        let waiter = {
            let (client, url) = (b.client.clone(), b.url("/v1/leases"));
            tokio::spawn(async move {
                client
                    .post(url)
                    .json(&json!({"resource": "fleet/reconnect", "holder": "b", "ttl_ms": 60_000, "wait_ms": 20_000}))
                    .send()
                    .await
                    .expect("acquire")
                    .status()
            })
        };
        b.eventually("/metrics", Duration::from_secs(10), |m| {
            m.as_str()
                .is_some_and(|t| t.contains("holdfast_lease_waiters 1"))
        })
        .await;
        let started = Instant::now();
        // The first request on a cut connection may fail; the server reconnects.
        let mut released = false;
        while !released && started.elapsed() < Duration::from_secs(10) {
            let r = a
                .lease_op(&id(&held), "release", json!({"token": held["token"]}))
                .await;
            released = r.status == StatusCode::OK;
        }
        assert!(released, "release went through after the connections came back");
        assert_eq!(waiter.await.expect("waiter"), StatusCode::CREATED);
        assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    })
    .await
}

/// An acquire on `s` that waits up to 20 s, answered in the background.
fn waiting_acquire(
    s: &Server,
    resource: &str,
    holder: &str,
) -> tokio::task::JoinHandle<(StatusCode, serde_json::Value)> {
    let (client, url) = (s.client.clone(), s.url("/v1/leases"));
    let body = json!({"resource": resource, "holder": holder, "ttl_ms": 60_000, "wait_ms": 20_000});
    tokio::spawn(async move {
        let r = client.post(url).json(&body).send().await.expect("acquire");
        let status = r.status();
        (status, r.json().await.expect("json"))
    })
}

/// Until `s` counts `here` waiters of its own and `elsewhere` announced by
/// the other host.
async fn waiters_seen(s: &Server, here: u64, elsewhere: u64) {
    s.eventually("/metrics", Duration::from_secs(10), |m| {
        metric(m, "holdfast_lease_waiters") == Some(here)
            && metric(m, "holdfast_lease_waiters_remote") == Some(elsewhere)
    })
    .await;
}

async fn round_trips(s: &Server) -> u64 {
    let m = s.get("/metrics").await;
    metric(&m.body, "holdfast_store_round_trips_total").expect("round trips")
}

#[tokio::test]
async fn a_release_tells_the_other_host_what_it_left_so_its_waiter_acquires_in_one_round_trip() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "3600000"]).await;
        let held = b.acquire_ok("fleet/hint", "b").await;
        // Its first try reads the lease held on the other host.
        let waiter = waiting_acquire(&a, "fleet/hint", "a");
        // Its announcement heard there: the other host knows it has a peer.
        waiters_seen(&b, 0, 1).await;
        let before = round_trips(&a).await;
        let r = b
            .lease_op(&id(&held), "release", json!({"token": held["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let (status, got) = waiter.await.expect("waiter");
        assert_eq!(status, StatusCode::CREATED, "{got}");
        assert_eq!(got["token"], held["token"].as_i64().expect("token") + 1);
        // Told the resource is free at that token, it takes it with the
        // checks of both, in one round trip; what it read before, taken as
        // still true, would fail its check and be read again (three).
        assert_eq!(round_trips(&a).await - before, 1);
    })
    .await
}

#[tokio::test]
async fn a_waiter_on_another_host_that_came_first_is_served_first() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "3600000"]).await;
        let held = a.acquire_ok("fleet/fifo", "a-holder").await;
        let first = waiting_acquire(&b, "fleet/fifo", "b-first");
        waiters_seen(&a, 0, 1).await;
        let second = waiting_acquire(&a, "fleet/fifo", "a-second");
        waiters_seen(&a, 1, 1).await;
        waiters_seen(&b, 1, 1).await;

        // Released where the second waits: the lease still goes to the first.
        let r = a
            .lease_op(&id(&held), "release", json!({"token": held["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let (status, got) = first.await.expect("first");
        assert_eq!(status, StatusCode::CREATED, "{got}");
        assert_eq!(got["holder"], "b-first");
        assert_eq!(got["token"], held["token"].as_i64().expect("token") + 1);
        waiters_seen(&a, 1, 0).await;
        assert!(
            !second.is_finished(),
            "the second waits for the first's lease"
        );

        let r = b
            .lease_op(&id(&got), "release", json!({"token": got["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let (status, then) = second.await.expect("second");
        assert_eq!(status, StatusCode::CREATED, "{then}");
        assert_eq!(then["holder"], "a-second");
        assert_eq!(then["token"], got["token"].as_i64().expect("token") + 1);
        waiters_seen(&b, 0, 0).await;
    })
    .await
}

#[tokio::test]
async fn a_waiter_of_a_host_that_died_holds_the_others_up_for_a_moment_only() {
    run(Store::Postgres, async {
        let (a, b, _dirs) = two_hosts(&["--reconcile-interval-ms", "3600000"]).await;
        let held = a.acquire_ok("fleet/dead-waiter", "a-holder").await;
        let gone = waiting_acquire(&b, "fleet/dead-waiter", "b-gone");
        waiters_seen(&a, 0, 1).await;
        // Killed while it waits: it never says that its waiter left.
        b.kill9().await;
        let _ = gone.await;
        let next = waiting_acquire(&a, "fleet/dead-waiter", "a-next");
        waiters_seen(&a, 1, 1).await;

        let released = Instant::now();
        let r = a
            .lease_op(&id(&held), "release", json!({"token": held["token"]}))
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let (status, got) = next.await.expect("next");
        let waited = released.elapsed();
        assert_eq!(status, StatusCode::CREATED, "{got}");
        assert_eq!(got["holder"], "a-next");
        assert!(
            waited >= Duration::from_millis(900),
            "the older waiter was given its turn first: {waited:?}"
        );
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        waiters_seen(&a, 0, 0).await;
    })
    .await
}
