//! The PostgreSQL store's own behaviour: clear startup errors, a database
//! outage answered with 503 and recovered from without a restart, and
//! connections cut between requests replaced before a request meets them.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Connection;

use crate::stores::{Store, database_for, postgres_base, run};
use crate::support::{Server, fails_to_start, until};

async fn admin() -> sqlx::PgConnection {
    let base = postgres_base().expect("PostgreSQL tests are on");
    sqlx::PgConnection::connect(&format!("{base}/postgres"))
        .await
        .expect("connect")
}

#[tokio::test]
async fn an_unreachable_database_is_a_clear_startup_error_without_the_password() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = "postgres://holdfast:s3cret@127.0.0.1:1/fleet";
    let err = fails_to_start(
        dir.path(),
        &["--database", url, "--database-timeout-ms", "500"],
    )
    .await;
    assert!(
        err.contains("cannot reach PostgreSQL at postgres://127.0.0.1:1/fleet"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
}

#[tokio::test]
async fn a_schema_newer_than_this_build_is_refused() {
    run(Store::Postgres, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Server::start_in(dir.path(), &[]).await;
        s.kill9().await;
        let url = database_for(dir.path()).await;
        let mut db = sqlx::PgConnection::connect(&url).await.expect("connect");
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99, 'from the future', TRUE, '\\x00', 0)",
        )
            .execute(&mut db)
            .await
            .expect("insert");
        let err = fails_to_start(dir.path(), &["--database", &url]).await;
        assert!(
            err.contains("schema is version 99, newer than this holdfast knows"),
            "{err}"
        );
    })
    .await
}

/// `GET /metrics`, which must answer 200.
async fn scrape(s: &Server) -> String {
    let res = s.client.get(s.url("/metrics")).send().await.expect("send");
    assert_eq!(res.status(), StatusCode::OK);
    res.text().await.expect("text")
}

#[tokio::test]
async fn a_database_outage_answers_503_and_the_server_recovers_by_itself() {
    run(Store::Postgres, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Server::start_in(dir.path(), &["--database-timeout-ms", "1000"]).await;
        let ready = s.get("/readyz").await;
        assert_eq!(ready.status, StatusCode::OK);
        assert_eq!(ready.body, json!({"status": "ok", "store": "postgres"}));
        let held = s.acquire_ok("outage/a", "h").await;
        let before = scrape(&s).await;
        assert!(
            before.contains("holdfast_store_up 1") && before.contains("holdfast_leases_current 1"),
            "{before}"
        );

        let url = database_for(dir.path()).await;
        let name = url.rsplit('/').next().expect("name").to_owned();
        let mut admin = admin().await;
        for sql in [
            format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"),
            format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
            ),
        ] {
            sqlx::query(&sql).execute(&mut admin).await.expect("outage");
        }
        let r = s.get("/readyz").await;
        assert_eq!(
            (r.status, r.code()),
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            "{}",
            r.body
        );
        let r = s
            .acquire(json!({"resource": "outage/b", "holder": "h", "ttl_ms": 60_000}))
            .await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
        assert!(["unavailable", "busy"].contains(&r.code()), "{}", r.body);
        // Monitoring is served through the outage, and says it.
        let during = scrape(&s).await;
        assert!(
            during.contains("holdfast_store_up 0") && during.contains("holdfast_leases_current 1"),
            "{during}"
        );

        sqlx::query(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
            .execute(&mut admin)
            .await
            .expect("recover");
        s.eventually("/readyz", Duration::from_secs(10), |v| v["status"] == "ok")
            .await;
        // The log says when the outage began and when it ended, once each,
        // not once per refused request.
        assert!(
            until(Duration::from_secs(5), || s.logged("store available again")).await,
            "the end of the outage is not logged"
        );
        assert_eq!(s.lines_saying("store unavailable"), 1);
        assert_eq!(
            s.lease(held["id"].as_str().expect("id")).await["state"],
            "active"
        );
        let r = s
            .acquire(json!({"resource": "outage/b", "holder": "h", "ttl_ms": 60_000}))
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    })
    .await
}

#[tokio::test]
async fn connections_cut_between_requests_are_replaced_before_a_request_meets_them() {
    run(Store::Postgres, async {
        let dir = tempfile::tempdir().expect("tempdir");
        // No reconciler pass meanwhile, to meet the cut connections first.
        let s = Server::start_in(dir.path(), &["--reconcile-interval-ms", "3600000"]).await;
        let held = s.acquire_ok("idle/a", "h").await;
        let id = held["id"].as_str().expect("id");
        let renewed = s
            .lease_op(id, "renew", json!({"token": held["token"]}))
            .await;
        assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.body);

        // A database restart or a proxy's idle timeout, as the pool meets it.
        let url = database_for(dir.path()).await;
        let name = url.rsplit('/').next().expect("name").to_owned();
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(&name)
            .execute(&mut admin().await)
            .await
            .expect("terminate");

        // Readiness first: its probe is the first write to meet the
        // writer's cut connection, and runs again on a new one.
        let ready = s.get("/readyz").await;
        assert_eq!(ready.status, StatusCode::OK, "readiness: {}", ready.body);
        assert_eq!(s.lease(id).await["state"], "active", "a read");
        let renewed = s
            .lease_op(id, "renew", json!({"token": held["token"]}))
            .await;
        assert_eq!(
            renewed.status,
            StatusCode::OK,
            "a renewal: {}",
            renewed.body
        );
        let r = s
            .acquire(json!({"resource": "idle/b", "holder": "h", "ttl_ms": 60_000}))
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "a write: {}", r.body);
    })
    .await
}

/// On PostgreSQL a server writes nothing of its data dir but `logs/`: one
/// whose data dir is not its own to write (a read-only root, systemd's
/// `ReadWritePaths=` on the logs alone) starts.
#[tokio::test]
async fn on_postgresql_only_the_logs_dir_need_be_writable() {
    use std::os::unix::fs::PermissionsExt;
    let nobody = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    let probe = std::process::Command::new(nobody[0])
        .args(&nobody[1..])
        .args([env!("CARGO_BIN_EXE_holdfast"), "--version"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: uid 65534 cannot run the server's binary here: {probe:?}");
        return;
    }
    run(Store::Postgres, async {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        database_for(dir).await;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let logs = dir.join("logs");
        std::fs::create_dir(&logs).expect("logs");
        std::os::unix::fs::chown(&logs, Some(65534), Some(65534)).expect("chown");
        let s = Server::start_under(
            &[nobody[0], nobody[1], nobody[2], nobody[3], "setsid"],
            dir,
            &[],
        )
        .await;
        assert_eq!(s.get("/readyz").await.status, StatusCode::OK);
        assert!(logs.join("holdfast.lock").exists());
    })
    .await
}
