//! A keyed request whose server was killed before it answered: the
//! client's retry with the same key is done afresh, not refused as
//! `request_in_progress` for a day, unless the first request created a
//! record (a lease, a process, a port reservation) that a second run would
//! create again; and it waits for the run answering it while that lives.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::idempotency::{REFUSE_ANSWERS, replayed};
use crate::stores::{Store, current, database_for, run, share_database, stores};
use crate::support::Server;

/// POST `body` to `path` of `s` with `key` from a task of its own, which
/// is left to fail when the server dies.
fn post_in_background(s: &Server, path: &str, key: &'static str, body: &Value) {
    let (client, url, body) = (s.client.clone(), s.url(path), body.clone());
    tokio::spawn(async move {
        let _ = client
            .post(url)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await;
    });
}

/// Which sessions of PostgreSQL belong to the server run that recorded
/// key `$1`.
const RUN_OF_KEY: &str =
    "application_name = 'holdfast ' || (SELECT run_id FROM idempotency WHERE key = $1)";

/// Poll the count that `sql` gives (with `$1` bound to `arg`, if given)
/// until `done` holds, for 30 s at most, then panic with `failed`:
/// PostgreSQL's sessions and locks send no event a test could await.
async fn until_count(
    db: &mut sqlx::PgConnection,
    sql: &str,
    arg: Option<&str>,
    done: impl Fn(i64) -> bool,
    failed: &str,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut count = sqlx::query_scalar(sql);
        if let Some(a) = arg {
            count = count.bind(a);
        }
        let n: i64 = count.fetch_one(&mut *db).await.expect("count");
        if done(n) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{failed}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// On PostgreSQL, wait until no session of the run that recorded `key` is
/// left (a killed server's sessions end as the database sees its sockets
/// close); on SQLite a run ends with its process.
async fn run_of_key_gone(dir: &std::path::Path, key: &str) {
    use sqlx::Connection;
    if current() != Store::Postgres {
        return;
    }
    let url = database_for(dir).await;
    let mut db = sqlx::PgConnection::connect(&url).await.expect("connect");
    until_count(
        &mut db,
        &format!("SELECT count(*) FROM pg_stat_activity WHERE {RUN_OF_KEY}"),
        Some(key),
        |left| left == 0,
        "the killed server's sessions are still open after 30 s",
    )
    .await;
}

stores!(
    a_retry_after_the_server_died_mid_wait_is_done_once_afresh,
    "multi_thread"
);
async fn a_retry_after_the_server_died_mid_wait_is_done_once_afresh() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Server::start_in(dir.path(), &[]).await;
    let held = s.acquire_ok("crash/w", "first").await;
    let body = json!({"resource": "crash/w", "holder": "next", "ttl_ms": 60000, "wait_ms": 30000});
    post_in_background(&s, "/v1/leases", "w-1", &body);
    s.queued(1).await;
    let during = s.post_keyed("/v1/leases", "w-1", body.clone()).await;
    assert_eq!(
        during.code(),
        "request_in_progress",
        "recorded: {}",
        during.body
    );
    s.kill9().await;
    run_of_key_gone(dir.path(), "w-1").await;

    let s = Server::start_in(dir.path(), &[]).await;
    let id = held["id"].as_str().expect("id");
    let released = s.lease_op(id, "release", json!({"token": 1})).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.body);
    // Retries racing on the key of the dead run: one takes it over.
    let tries: Vec<_> = (0..8)
        .map(|_| {
            let (client, url, body) = (s.client.clone(), s.url("/v1/leases"), body.clone());
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .header("idempotency-key", "w-1")
                    .json(&body)
                    .send()
                    .await
                    .expect("POST");
                (r.status(), r.json::<Value>().await.expect("json"))
            })
        })
        .collect();
    let mut granted = Vec::new();
    for t in tries {
        let (status, answer) = t.await.expect("join");
        match status {
            StatusCode::CREATED => granted.push(answer),
            StatusCode::CONFLICT => {
                assert_eq!(answer["code"], "request_in_progress", "{answer}");
            }
            other => panic!("{other}: {answer}"),
        }
    }
    // Those after the first's answer are given it again.
    assert!(!granted.is_empty());
    assert!(granted.iter().all(|g| g == &granted[0]), "{granted:?}");
    assert_eq!(granted[0]["holder"], "next");
    assert_eq!(granted[0]["token"], 2);
    let acquired = s
        .all_events()
        .await
        .iter()
        .filter(|e| e["type"] == "lease.acquired")
        .count();
    assert_eq!(acquired, 2, "the first holder's, and one retry's");

    let again = s.post_keyed("/v1/leases", "w-1", body).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::CREATED, &granted[0])
    );
    assert!(replayed(&again));
}

/// Blocks the transaction that records a started child while the test's
/// session holds advisory lock 4242: the server can be killed between a
/// spawn's two transactions.
const HOLD_STARTED: &str = "CREATE FUNCTION test_hold() RETURNS trigger LANGUAGE plpgsql AS $$
     BEGIN
         IF NEW.state = 'running' THEN
             PERFORM pg_advisory_xact_lock(4242);
         END IF;
         RETURN NEW;
     END $$;
     CREATE TRIGGER test_hold BEFORE UPDATE ON processes
         FOR EACH ROW EXECUTE FUNCTION test_hold();";

/// The server dies in the middle of a keyed spawn (its record made, the
/// started child not recorded yet) and after a keyed acquire whose wait
/// ran out (which keeps its answer after its change) before that answer
/// was kept: the spawn's retry is refused (it would create a second
/// record), the waiter's is done again.
#[tokio::test]
async fn after_a_crash_a_created_record_keeps_its_key_and_an_update_is_done_again() {
    run(Store::Postgres, async {
        use sqlx::Connection;
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Server::start_in(dir.path(), &[]).await;
        s.acquire_ok("crash/held", "first").await;
        let url = database_for(dir.path()).await;
        let mut db = sqlx::PgConnection::connect(&url).await.expect("connect");
        sqlx::raw_sql(REFUSE_ANSWERS)
            .execute(&mut db)
            .await
            .expect("trigger");
        sqlx::raw_sql(HOLD_STARTED)
            .execute(&mut db)
            .await
            .expect("trigger");
        sqlx::query("SELECT pg_advisory_lock(4242)")
            .execute(&mut db)
            .await
            .expect("lock");

        let wait =
            json!({"resource": "crash/held", "holder": "h", "ttl_ms": 60000, "wait_ms": 1000});
        let ran_out = s.post_keyed("/v1/leases", "r-1", wait.clone()).await;
        assert_eq!(ran_out.code(), "lease_held", "{}", ran_out.body);
        let spawn = json!({"kind": "crash-created", "command": {"argv": ["true"]}});
        post_in_background(&s, "/v1/processes", "c-1", &spawn);
        until_count(
            &mut db,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            None,
            |waiting| waiting > 0,
            "the started child was not recorded within 30 s",
        )
        .await;
        let runs: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT key, run_id FROM idempotency WHERE status IS NULL ORDER BY key")
                .fetch_all(&mut db)
                .await
                .expect("keys");
        let runs: Vec<(&str, bool)> = runs
            .iter()
            .map(|(k, r)| (k.as_str(), r.is_some()))
            .collect();
        assert_eq!(
            runs,
            [("c-1", false), ("r-1", true)],
            "in progress, with a run or not"
        );
        s.kill9().await;
        // The blocked transaction would commit once the lock is let go:
        // its session ends first, as a dead server's would.
        sqlx::query(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {RUN_OF_KEY}"
        ))
        .bind("r-1")
        .execute(&mut db)
        .await
        .expect("terminate");
        run_of_key_gone(dir.path(), "r-1").await;
        sqlx::query("SELECT pg_advisory_unlock(4242)")
            .execute(&mut db)
            .await
            .expect("unlock");

        let s = Server::start_in(dir.path(), &[]).await;
        let retried = s.post_keyed("/v1/processes", "c-1", spawn).await;
        assert_eq!(
            (retried.status, retried.code()),
            (StatusCode::CONFLICT, "request_in_progress"),
            "{}",
            retried.body
        );
        let listed = s.get("/v1/processes?state=all&kind=crash-created").await;
        let items = listed.body["items"].as_array().cloned().unwrap_or_default();
        assert_eq!(items.len(), 1, "{}", listed.body);
        assert_ne!(items[0]["state"], "running", "never recorded started");

        let waited_again = s.post_keyed("/v1/leases", "r-1", wait).await;
        assert_eq!(waited_again.code(), "lease_held", "{}", waited_again.body);
        assert!(!replayed(&waited_again), "done afresh");
    })
    .await
}

/// On a fleet, a retry sent to another host is `request_in_progress` while
/// the host answering the first request lives, and done once it is gone.
#[tokio::test]
async fn a_retry_on_another_host_waits_for_the_first_host_to_go() {
    run(Store::Postgres, async {
        let dirs = [
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        ];
        let a = Server::start_in(dirs[0].path(), &["--host-id", "host-a"]).await;
        share_database(dirs[0].path(), dirs[1].path());
        let b = Server::start_in(dirs[1].path(), &["--host-id", "host-b"]).await;
        let held = a.acquire_ok("crash/fleet", "first").await;
        let body =
            json!({"resource": "crash/fleet", "holder": "next", "ttl_ms": 60000, "wait_ms": 30000});
        post_in_background(&a, "/v1/leases", "f-1", &body);
        a.queued(1).await;

        let during = b.post_keyed("/v1/leases", "f-1", body.clone()).await;
        assert_eq!(
            (during.status, during.code()),
            (StatusCode::CONFLICT, "request_in_progress"),
            "{}",
            during.body
        );
        a.kill9().await;
        run_of_key_gone(dirs[0].path(), "f-1").await;
        let id = held["id"].as_str().expect("id");
        let released = b.lease_op(id, "release", json!({"token": 1})).await;
        assert_eq!(released.status, StatusCode::OK, "{}", released.body);
        let after = b.post_keyed("/v1/leases", "f-1", body).await;
        assert_eq!(after.status, StatusCode::CREATED, "{}", after.body);
        assert_eq!(after.body["holder"], "next");
    })
    .await
}
