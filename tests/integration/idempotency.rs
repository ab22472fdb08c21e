//! `Idempotency-Key`: a repeat answers the first answer and changes
//! nothing; the key with another request is refused; a repeat while the
//! first is being answered is `request_in_progress`; keys outlive restarts
//! and hold under concurrent repeats.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::stores::stores;
use crate::support::Server;

/// Makes the database refuse to keep answers (a write it cannot take, as
/// when it is briefly out of reach) until `test_refusal.refused` is false:
/// a request's change is kept, its answer is not.
pub const REFUSE_ANSWERS: &str = "CREATE TABLE test_refusal (refused boolean NOT NULL);
     INSERT INTO test_refusal VALUES (true);
     CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
     BEGIN
         IF NEW.status IS NOT NULL AND (SELECT refused FROM test_refusal) THEN
             RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'lock_not_available';
         END IF;
         RETURN NEW;
     END $$;
     CREATE TRIGGER test_refuse BEFORE UPDATE ON idempotency
         FOR EACH ROW EXECUTE FUNCTION test_refuse();";

pub fn replayed(r: &crate::support::Reply) -> bool {
    r.headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn location(r: &crate::support::Reply) -> Option<String> {
    r.headers
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// How many `lease.acquired` events the server's log holds.
async fn acquires(s: &Server) -> usize {
    s.all_events()
        .await
        .iter()
        .filter(|e| e["type"] == "lease.acquired")
        .count()
}

stores!(a_repeated_request_is_answered_again_and_changes_nothing);
async fn a_repeated_request_is_answered_again_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let body = json!({"resource": "idem/a", "holder": "h", "ttl_ms": 60000});
    let first = s.post_keyed("/v1/leases", "k-1", body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert!(!replayed(&first));
    let events = s.all_events().await.len();

    let again = s.post_keyed("/v1/leases", "k-1", body.clone()).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body, "the first answer, as it was");
    assert!(replayed(&again));
    assert_eq!(s.all_events().await.len(), events, "nothing was done again");
    assert_eq!(
        location(&again),
        Some(format!(
            "/v1/leases/{}",
            first.body["id"].as_str().expect("id")
        )),
    );
    assert_eq!(location(&again), location(&first));

    // A refusal is an answer like another: kept, and given again.
    let held = s
        .post_keyed(
            "/v1/leases",
            "k-2",
            json!({"resource": "idem/a", "holder": "x", "ttl_ms": 60000}),
        )
        .await;
    assert_eq!(held.code(), "lease_held");
    let id = first.body["id"].as_str().expect("id");
    let release = s
        .post_keyed(
            &format!("/v1/leases/{id}/release"),
            "k-3",
            json!({"token": 1}),
        )
        .await;
    assert_eq!(release.status, StatusCode::OK);
    let held_again = s
        .post_keyed(
            "/v1/leases",
            "k-2",
            json!({"resource": "idem/a", "holder": "x", "ttl_ms": 60000}),
        )
        .await;
    assert_eq!(
        (held_again.status, held_again.code()),
        (StatusCode::CONFLICT, "lease_held")
    );
    assert!(replayed(&held_again));
    let release_again = s
        .post_keyed(
            &format!("/v1/leases/{id}/release"),
            "k-3",
            json!({"token": 1}),
        )
        .await;
    assert_eq!(release_again.body, release.body);

    // Keys are stored with the change: a restart keeps them.
    s.kill9().await;
    let s = Server::start_in(dir.path(), &[]).await;
    let after = s.post_keyed("/v1/leases", "k-1", body).await;
    assert_eq!(
        (after.status, &after.body),
        (StatusCode::CREATED, &first.body)
    );
    let next = s.acquire_ok("idem/a", "other").await;
    assert_eq!(next["token"], 2, "no lease was taken again");
}

stores!(a_repeat_that_would_be_refused_before_the_store_is_answered_for_its_key);
/// A request does not read its key before it runs: its transaction claims
/// it. A repeat that its handler refuses before reaching the store (here
/// the owner it names has died since) still gets the first answer.
async fn a_repeat_that_would_be_refused_before_the_store_is_answered_for_its_key() {
    let s = Server::start().await;
    let mut owner = crate::support::Proc::sleep();
    let body = json!({"resource": "idem/owned", "holder": "h", "owner": {"pid": owner.pid()}});
    let first = s.post_keyed("/v1/leases", "o-1", body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    owner.kill_and_reap().await;
    let refused = s.post("/v1/leases", body.clone()).await;
    assert_eq!(refused.code(), "process_not_found", "{}", refused.body);

    let again = s.post_keyed("/v1/leases", "o-1", body).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &first.body)
    );
    assert!(replayed(&again));
}

stores!(a_repeat_of_a_request_queued_before_it_tried_is_request_in_progress_at_once);
/// A keyed acquire that joins a queue before it tries has recorded
/// nothing yet; its repeat on the same host still takes no place in the
/// queue: it is `409 request_in_progress` at once, not after its wait.
async fn a_repeat_of_a_request_queued_before_it_tried_is_request_in_progress_at_once() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("idem/queued", "first").await;
    let plain = s.acquire_in_background(
        None,
        &json!({"resource": "idem/queued", "holder": "plain", "ttl_ms": 60000, "wait_ms": 30000}),
    );
    s.queued(1).await;
    let body =
        json!({"resource": "idem/queued", "holder": "keyed", "ttl_ms": 60000, "wait_ms": 30000});
    let first = s.acquire_in_background(Some("q-1"), &body);
    s.queued(2).await;
    let repeat = tokio::time::timeout(
        Duration::from_secs(10),
        s.post_keyed("/v1/leases", "q-1", body),
    )
    .await
    .expect("answered before its wait ran out");
    assert_eq!(
        (repeat.status, repeat.code()),
        (StatusCode::CONFLICT, "request_in_progress"),
        "{}",
        repeat.body
    );
    let id = held["id"].as_str().expect("id");
    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert_eq!(plain.await.expect("join").0, StatusCode::CREATED);
    // Still waiting behind the plain waiter's lease.
    first.abort();
}

stores!(a_key_used_for_another_request_or_malformed_is_422);
async fn a_key_used_for_another_request_or_malformed_is_422() {
    let s = Server::start().await;
    let body = json!({"resource": "idem/b", "holder": "h", "ttl_ms": 60000});
    let first = s.post_keyed("/v1/leases", "k", body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The same JSON built again: members in another order, other spacing.
    let rebuilt = s
        .client
        .post(s.url("/v1/leases"))
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(r#"{ "ttl_ms": 60000,  "holder": "h", "resource": "idem/b" }"#)
        .send()
        .await
        .expect("POST");
    let rebuilt = Server::reply(rebuilt).await;
    assert!(replayed(&rebuilt), "{}", rebuilt.body);
    assert_eq!(rebuilt.body, first.body);
    let other_body = s
        .post_keyed(
            "/v1/leases",
            "k",
            json!({"resource": "idem/b", "holder": "z", "ttl_ms": 60000}),
        )
        .await;
    let id = first.body["id"].as_str().expect("id");
    let other_path = s
        .post_keyed(&format!("/v1/leases/{id}/renew"), "k", json!({"token": 1}))
        .await;
    for r in [&other_body, &other_path] {
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
        assert_eq!(
            (r.code(), r.body["field"].as_str()),
            ("validation", Some("Idempotency-Key"))
        );
    }
    for key in ["x".repeat(129), "tab\there".into()] {
        let r = s
            .post_keyed(
                "/v1/leases",
                &key,
                json!({"resource": "idem/c", "holder": "h", "ttl_ms": 60000}),
            )
            .await;
        assert_eq!(r.body["field"], "Idempotency-Key", "{key:?}: {}", r.body);
    }
    let ok = s
        .post_keyed(
            "/v1/leases",
            &"y".repeat(128),
            json!({"resource": "idem/c", "holder": "h", "ttl_ms": 60000}),
        )
        .await;
    assert_eq!(ok.status, StatusCode::CREATED, "128 bytes are allowed");
}

stores!(a_repeat_while_the_first_waits_is_request_in_progress);
async fn a_repeat_while_the_first_waits_is_request_in_progress() {
    let s = Server::start().await;
    let held = s.acquire_ok("idem/w", "first").await;
    let body = json!({"resource": "idem/w", "holder": "next", "ttl_ms": 60000, "wait_ms": 30000});
    let waiting = s.acquire_in_background(Some("w"), &body);
    s.queued(1).await;
    let during = s.post_keyed("/v1/leases", "w", body.clone()).await;
    assert_eq!(
        (during.status, during.code()),
        (StatusCode::CONFLICT, "request_in_progress")
    );
    let id = held["id"].as_str().expect("id");
    s.lease_op(id, "release", json!({"token": 1})).await;
    let (status, granted) = waiting.await.expect("join");
    assert_eq!(status, StatusCode::CREATED, "{granted}");
    let after = s.post_keyed("/v1/leases", "w", body).await;
    assert_eq!((after.status, after.body), (StatusCode::CREATED, granted));
}

stores!(concurrent_repeats_make_one_change);
async fn concurrent_repeats_make_one_change() {
    let s = Server::start().await;
    let body = json!({"resource": "idem/race", "holder": "h", "ttl_ms": 60000});
    let tasks: Vec<_> = (0..16)
        .map(|_| s.acquire_in_background(Some("race"), &body))
        .collect();
    let mut created = Vec::new();
    for t in tasks {
        let (status, body) = t.await.expect("join");
        match status {
            StatusCode::CREATED => created.push(body),
            StatusCode::CONFLICT => assert_eq!(body["code"], "request_in_progress", "{body}"),
            other => panic!("{other}: {body}"),
        }
    }
    assert!(!created.is_empty());
    eprintln!("concurrent repeats: {} of 16 answered 201", created.len());
    assert!(
        created.iter().all(|b| b == &created[0]),
        "one lease, one answer"
    );
    assert_eq!(acquires(&s).await, 1);
}

stores!(a_spawn_retried_with_its_key_starts_one_process);
async fn a_spawn_retried_with_its_key_starts_one_process() {
    let s = Server::start().await;
    let body = json!({"kind": "dev", "command": {"argv": ["sleep", "600"]}});
    let first = s.post_keyed("/v1/processes", "spawn-1", body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = s.post_keyed("/v1/processes", "spawn-1", body).await;
    assert_eq!(again.body["id"], first.body["id"]);
    assert_eq!(again.body["pid"], first.body["pid"]);
    assert!(replayed(&again));
    assert!(location(&first).is_some());
    assert_eq!(location(&again), location(&first), "the same Location");
    let listed = s.get("/v1/processes?state=all").await;
    assert_eq!(
        listed.body["items"].as_array().map(Vec::len),
        Some(1),
        "{}",
        listed.body
    );
}

stores!(a_keyed_lease_request_keeps_its_answer_in_its_change_s_commit);
/// API.md, "Safe retries": the answer is stored in the same transaction
/// as the change. A lease request's is: a keyed acquire costs one durable
/// commit, as a plain one does, and a keyed renewal none more.
async fn a_keyed_lease_request_keeps_its_answer_in_its_change_s_commit() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let before = s.durable_transactions().await;
    let body = json!({"resource": "idem/sync", "holder": "h", "ttl_ms": 60000});
    let acquired = s.post_keyed("/v1/leases", "s-1", body.clone()).await;
    assert_eq!(acquired.status, StatusCode::CREATED, "{}", acquired.body);
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the acquire, with its answer"
    );
    let again = s.post_keyed("/v1/leases", "s-1", body).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &acquired.body)
    );
    assert!(replayed(&again));
    let before = s.durable_transactions().await;
    let path = format!(
        "/v1/leases/{}/renew",
        acquired.body["id"].as_str().expect("id")
    );
    let renewed = s.post_keyed(&path, "s-2", json!({"token": 1})).await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);
    // PostgreSQL writes every renewal before it answers it (docs/fleet.md).
    let renewal = u64::from(crate::stores::current() == crate::stores::Store::Postgres);
    assert_eq!(
        s.durable_transactions().await - before,
        renewal,
        "the renewal, with its answer"
    );
    let again = s.post_keyed(&path, "s-2", json!({"token": 1})).await;
    assert_eq!((again.status, &again.body), (StatusCode::OK, &renewed.body));
    assert!(replayed(&again));
}

stores!(a_keyed_port_request_keeps_its_answer_in_its_change_s_commit);
/// A port reservation and its release keep their answers with their
/// change, as lease requests do: one durable commit each.
async fn a_keyed_port_request_keeps_its_answer_in_its_change_s_commit() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let lease = s.acquire_ok("idem/ports", "h").await;
    let owner = json!({"lease": {"id": lease["id"], "token": 1}});
    let body = json!({"names": ["http"], "owner": owner, "range": [31500, 31599]});
    let before = s.durable_transactions().await;
    let reserved = s.post_keyed("/v1/ports", "pr-1", body.clone()).await;
    assert_eq!(reserved.status, StatusCode::CREATED, "{}", reserved.body);
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the reservation, with its answer"
    );
    let again = s.post_keyed("/v1/ports", "pr-1", body).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &reserved.body)
    );
    assert!(replayed(&again));

    let port = reserved.body["ports"]["http"].as_u64().expect("port");
    let path = format!("/v1/ports/{port}/release");
    let before = s.durable_transactions().await;
    let released = s.post_keyed(&path, "pr-2", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the release, with its answer"
    );
    let again = s.post_keyed(&path, "pr-2", json!({"token": 1})).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::OK, &released.body)
    );
    assert!(replayed(&again));
}

stores!(a_keyed_stop_is_answered_again_as_it_was);
/// A stop's answer is kept by its last transaction, the one that records
/// the end after the signal; a stop of a process already ended, by its
/// first. Both are given again as they were, and signal nothing more.
async fn a_keyed_stop_is_answered_again_as_it_was() {
    let s = Server::start().await;
    let p = s
        .spawn(json!({"kind": "idem-stop", "command": {"argv": ["sleep", "600"]}}))
        .await;
    let path = format!("/v1/processes/{}/stop", p["id"].as_str().expect("id"));
    let body = json!({"token": 1, "grace_ms": 2000});
    let stopped = s.post_keyed(&path, "st-1", body.clone()).await;
    assert_eq!(stopped.status, StatusCode::OK, "{}", stopped.body);
    assert_eq!(stopped.body["state"], "stopped", "{}", stopped.body);
    let again = s.post_keyed(&path, "st-1", body.clone()).await;
    assert_eq!((again.status, &again.body), (StatusCode::OK, &stopped.body));
    assert!(replayed(&again));

    let ended = s.post_keyed(&path, "st-2", body.clone()).await;
    assert_eq!(ended.status, StatusCode::OK, "{}", ended.body);
    let again = s.post_keyed(&path, "st-2", body).await;
    assert_eq!((again.status, &again.body), (StatusCode::OK, &ended.body));
    assert!(replayed(&again));
}

stores!(a_keyed_create_costs_one_durable_commit_and_a_waiter_s_late_answer_none);
/// A keyed registration or spawn keeps its answer in its last
/// transaction: the durable commits of a plain one. Of the answers kept
/// after their change (a waiter's whose wait ran out), a lost one lets its
/// retry be done afresh, which is safe for a request that created nothing,
/// so it is committed without an fsync (docs/durability.md).
async fn a_keyed_create_costs_one_durable_commit_and_a_waiter_s_late_answer_none() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let register = json!({"kind": "idem", "ttl_ms": 60000});
    let spawn = json!({"kind": "idem", "command": {"argv": ["sleep", "30"]}});
    let mut made = Vec::new();
    for (key, body) in [("p-1", &register), ("p-3", &spawn)] {
        let before = s.durable_transactions().await;
        let r = s.post_keyed("/v1/processes", key, body.clone()).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        assert_eq!(
            s.durable_transactions().await - before,
            1,
            "{key}: the record (a spawn's started child) with its answer"
        );
        let again = s.post_keyed("/v1/processes", key, body.clone()).await;
        assert_eq!((again.status, &again.body), (StatusCode::CREATED, &r.body));
        assert!(replayed(&again));
        made.push(r.body);
    }
    assert_eq!(made[1]["state"], "running", "{}", made[1]);
    let listed = s.get("/v1/processes?state=all&kind=idem").await;
    assert_eq!(listed.body["items"].as_array().map(Vec::len), Some(2));
    let id = made[1]["id"].as_str().expect("id");
    let stop = s.process_op(id, "stop", json!({"token": 1})).await;
    assert_eq!(stop.status, StatusCode::OK, "{}", stop.body);
    // A waiter whose wait runs out answers after its transactions.
    s.acquire_ok("idem/ran-out", "first").await;
    let before = s.durable_transactions().await;
    let wait = json!({"resource": "idem/ran-out", "holder": "h", "ttl_ms": 60000, "wait_ms": 1000});
    let ran_out = s.post_keyed("/v1/leases", "p-2", wait.clone()).await;
    assert_eq!(ran_out.code(), "lease_held", "{}", ran_out.body);
    assert_eq!(
        s.durable_transactions().await - before,
        2,
        "its tries (at once, and as its wait ran out), not its answer"
    );
    let again = s.post_keyed("/v1/leases", "p-2", wait).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CONFLICT, &ran_out.body)
    );
    assert!(replayed(&again));
}

stores!(a_keyed_release_that_hands_the_lease_over_created_nothing_of_its_own);
/// The lease a release hands to a waiter is the waiter's record: the
/// release's answer is kept like any other that created nothing.
async fn a_keyed_release_that_hands_the_lease_over_created_nothing_of_its_own() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("idem/handoff", "first").await;
    let waiter = s.acquire_in_background(
        None,
        &json!({"resource": "idem/handoff", "holder": "next", "ttl_ms": 60000, "wait_ms": 30000}),
    );
    s.queued(1).await;
    let before = s.durable_transactions().await;
    let path = format!("/v1/leases/{}/release", held["id"].as_str().expect("id"));
    let released = s.post_keyed(&path, "h-1", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    assert_eq!(waiter.await.expect("join").0, StatusCode::CREATED);
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the release with its hand-off; its answer waits for no fsync"
    );
}

stores!(a_keyed_waiter_is_handed_the_lease_in_the_release_s_commit);
/// A waiter with a key is granted the lease by the release's transaction,
/// which records the waiter's key and answer with it: one durable commit
/// for the hand-off.
async fn a_keyed_waiter_is_handed_the_lease_in_the_release_s_commit() {
    let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
    let held = s.acquire_ok("idem/keyed-wait", "first").await;
    let body =
        json!({"resource": "idem/keyed-wait", "holder": "next", "ttl_ms": 60000, "wait_ms": 30000});
    let waiting = s.acquire_in_background(Some("kw-1"), &body);
    s.queued(1).await;
    let before = s.durable_transactions().await;
    let id = held["id"].as_str().expect("id");
    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    let (status, granted) = waiting.await.expect("join");
    assert_eq!(status, StatusCode::CREATED, "{granted}");
    assert_eq!(
        (&granted["holder"], &granted["token"]),
        (&json!("next"), &json!(2))
    );
    assert_eq!(
        s.durable_transactions().await - before,
        1,
        "the release with the hand-off and the waiter's answer"
    );
    let again = s.post_keyed("/v1/leases", "kw-1", body).await;
    assert_eq!((again.status, &again.body), (StatusCode::CREATED, &granted));
    assert!(replayed(&again));
    assert_eq!(acquires(&s).await, 2);
}

/// On PostgreSQL a key's claim and answer go with the transaction's other
/// writes, the claim checked inside its commit: a keyed acquire costs the
/// writer the round trips of a plain one.
#[tokio::test]
async fn a_keyed_acquire_on_postgres_costs_the_round_trips_of_a_plain_one() {
    use crate::stores::{Store, run};
    use crate::support::metric;
    run(Store::Postgres, async {
        let s = Server::start_with(&["--reconcile-interval-ms", "3600000"]).await;
        let trips = || async {
            let m = s.get("/metrics").await;
            metric(&m.body, "holdfast_store_round_trips_total").expect("round trips")
        };
        // The startup pass of the reconciler writes too.
        s.eventually("/metrics", Duration::from_secs(10), |m| {
            metric(m, "holdfast_reconciler_passes_total").unwrap_or(0) >= 1
        })
        .await;
        // The first write of a connection reads what the cache lacks.
        s.acquire_ok("idem/rt/warm", "h").await;
        // The fewest of three: a write of the server's own in between
        // only adds.
        let (mut plain, mut keyed) = (u64::MAX, u64::MAX);
        for i in 0..3 {
            let before = trips().await;
            s.acquire_ok(&format!("idem/rt/plain/{i}"), "h").await;
            plain = plain.min(trips().await - before);
            let before = trips().await;
            let body =
                json!({"resource": format!("idem/rt/keyed/{i}"), "holder": "h", "ttl_ms": 60000});
            let r = s.post_keyed("/v1/leases", &format!("rt-{i}"), body).await;
            assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
            keyed = keyed.min(trips().await - before);
        }
        assert_eq!(keyed, plain, "plain: {plain}");
    })
    .await
}

/// A server on PostgreSQL, in its data dir, and a connection to its database.
async fn on_postgres() -> (tempfile::TempDir, Server, sqlx::PgConnection) {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let url = crate::stores::database_for(s.dir()).await;
    let db = sqlx::PgConnection::connect(&url).await.expect("connect");
    (dir, s, db)
}

/// The status kept with key `u-1`.
async fn status_kept(db: &mut sqlx::PgConnection) -> Option<i64> {
    status_kept_of(db, "u-1").await
}

async fn status_kept_of(db: &mut sqlx::PgConnection, key: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT status::bigint FROM idempotency WHERE key = $1")
        .bind(key)
        .fetch_one(db)
        .await
        .expect("key row")
}

/// An answer that the store refuses to keep when it is given (a database
/// briefly unable to write) is given again from memory to a retry, and kept
/// as soon as the store takes writes again: the key does not stay
/// `request_in_progress`.
#[tokio::test]
async fn an_answer_the_store_cannot_keep_at_once_is_replayed_and_kept_later() {
    use crate::stores::{Store, run};
    run(Store::Postgres, async {
        let (dir, s, mut db) = on_postgres().await;
        // Recording a key inserts its row; keeping its answer updates it.
        sqlx::raw_sql(REFUSE_ANSWERS)
            .execute(&mut db)
            .await
            .expect("trigger");

        // A waiter whose wait runs out keeps its answer after its change.
        s.acquire_ok("idem/unkept", "first").await;
        let body =
            json!({"resource": "idem/unkept", "holder": "h", "ttl_ms": 60000, "wait_ms": 500});
        let first = s.post_keyed("/v1/leases", "u-1", body.clone()).await;
        assert_eq!(first.code(), "lease_held", "{}", first.body);
        assert_eq!(
            status_kept(&mut db).await,
            None,
            "the answer is not kept yet"
        );

        let again = s.post_keyed("/v1/leases", "u-1", body.clone()).await;
        assert_eq!(
            (again.status, &again.body),
            (StatusCode::CONFLICT, &first.body),
            "the first answer, from memory"
        );
        assert!(replayed(&again));

        sqlx::query("UPDATE test_refusal SET refused = false")
            .execute(&mut db)
            .await
            .expect("allow");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while status_kept(&mut db).await != Some(409) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the answer was not kept within 30 s of the store taking writes"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // Kept by the store: a restart answers it too, and nothing was done twice.
        s.kill9().await;
        let s = Server::start_in(dir.path(), &[]).await;
        let after = s.post_keyed("/v1/leases", "u-1", body).await;
        assert_eq!(
            (after.status, &after.body),
            (StatusCode::CONFLICT, &first.body)
        );
        assert!(replayed(&after));
        assert_eq!(acquires(&s).await, 1, "the first holder's only");
    })
    .await
}

/// On PostgreSQL a keyed lease or heartbeat request's answer is kept by its change's
/// transaction, under the fleet's write lock (the row of `event_seq`) as
/// every write transaction of the writer; a waiter's whose wait ran out,
/// kept after the change, by a statement of its own, which takes no part
/// of that lock.
#[tokio::test]
async fn a_keyed_answer_on_postgres_is_kept_with_its_change_or_without_the_fleet_lock() {
    use crate::stores::{Store, run};
    run(Store::Postgres, async {
        let (_dir, s, mut db) = on_postgres().await;
        // Each write of an answer notes whether its transaction holds a
        // lock on `event_seq`, as every write transaction of the writer does.
        sqlx::raw_sql(
            "CREATE TABLE test_answers (status bigint, fleet_locked boolean NOT NULL, sync text);
             CREATE FUNCTION test_note() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.status IS NOT NULL THEN
                     INSERT INTO test_answers SELECT NEW.status, EXISTS (
                         SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()
                             AND relation = 'event_seq'::regclass),
                         current_setting('synchronous_commit');
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER test_note BEFORE UPDATE ON idempotency
                 FOR EACH ROW EXECUTE FUNCTION test_note();",
        )
        .execute(&mut db)
        .await
        .expect("trigger");

        let body = json!({"resource": "idem/alone", "holder": "h", "ttl_ms": 60000});
        let first = s.post_keyed("/v1/leases", "alone-1", body.clone()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
        let path = format!(
            "/v1/leases/{}/renew",
            first.body["id"].as_str().expect("id")
        );
        let renewed = s.post_keyed(&path, "alone-2", json!({"token": 1})).await;
        assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);
        let process = json!({"kind": "idem-alone", "ttl_ms": 60000});
        let registered = s.post_keyed("/v1/processes", "alone-3", process).await;
        assert_eq!(registered.status, StatusCode::CREATED, "{}", registered.body);
        let path = format!(
            "/v1/processes/{}/heartbeat",
            registered.body["id"].as_str().expect("id")
        );
        let beat = s.post_keyed(&path, "alone-5", json!({"token": 1})).await;
        assert_eq!(beat.status, StatusCode::OK, "{}", beat.body);
        let wait = json!({"resource": "idem/alone", "holder": "w", "ttl_ms": 60000, "wait_ms": 1000});
        let ran_out = s.post_keyed("/v1/leases", "alone-4", wait).await;
        assert_eq!(ran_out.code(), "lease_held", "{}", ran_out.body);
        let noted: Vec<(Option<i64>, bool, String)> = sqlx::query_as(
            "SELECT status, fleet_locked, sync FROM test_answers ORDER BY status DESC, fleet_locked",
        )
        .fetch_all(&mut db)
        .await
        .expect("noted");
        let kept: Vec<_> = noted
            .iter()
            .map(|(s, locked, sync)| (*s, *locked, sync == "off"))
            .collect();
        assert_eq!(
            kept,
            [
                (Some(409), false, true),
                (Some(201), true, false),
                (Some(201), true, false),
                (Some(200), true, false),
                (Some(200), true, false),
            ],
            "the lease's, the registration's and the heartbeat's answers with their change, \
             the waiter's unlocked, without waiting for the WAL's flush: \
             {noted:?}"
        );

        let again = s.post_keyed("/v1/leases", "alone-1", body).await;
        assert_eq!(
            (again.status, &again.body),
            (StatusCode::CREATED, &first.body)
        );
        assert!(replayed(&again));
        assert_eq!(acquires(&s).await, 1);
    })
    .await
}

/// A lease request's change and its answer are one transaction: when the
/// answer cannot be kept, neither is the change, and the client's retry
/// finds the lease as it was.
#[tokio::test]
async fn a_lease_change_whose_answer_cannot_be_kept_is_not_kept_either() {
    use crate::stores::{Store, run};
    run(Store::Postgres, async {
        let (_dir, s, mut db) = on_postgres().await;
        let held = s.acquire_ok("idem/atomic", "h").await;
        sqlx::raw_sql(REFUSE_ANSWERS)
            .execute(&mut db)
            .await
            .expect("trigger");
        let path = format!("/v1/leases/{}/release", held["id"].as_str().expect("id"));
        let refused = s.post_keyed(&path, "a-1", json!({"token": 1})).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            refused.body
        );
        let lease = s.lease(held["id"].as_str().expect("id")).await;
        assert_eq!(lease["state"], "active", "{lease}");

        sqlx::query("UPDATE test_refusal SET refused = false")
            .execute(&mut db)
            .await
            .expect("allow");
        let released = s.post_keyed(&path, "a-1", json!({"token": 1})).await;
        assert_eq!(released.status, StatusCode::OK, "{}", released.body);
        assert!(!replayed(&released));
        assert_eq!(released.body["state"], "released");
        assert_eq!(status_kept_of(&mut db, "a-1").await, Some(200));
    })
    .await
}
