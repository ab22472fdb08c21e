//! Data written by earlier versions opens: a data directory made by the
//! build that ran SQLite on rusqlite (its schema version in `user_version`),
//! and a PostgreSQL database migrated before sqlx's migrator (versions in
//! `holdfast_schema`). A schema newer than this build is refused.

use serde_json::json;
use sqlx::Connection;

use crate::stores::{Store, database_for, run};
use crate::support::Server;

/// Made by the last rusqlite build (commit 001b270): three leases on two
/// resources (two released, one held with a port), an exited process, nine events.
const FIXTURE: &[u8] = include_bytes!("../fixtures/rusqlite-data-dir.db");
/// Servers on the fixture keep every ended record, however old.
const KEEP: &[&str] = &["--record-retention", "off"];
const HELD: &str = "01a22f4c-db59-7290-8f5c-cdb44653f53f";
const RELEASED: &str = "01a22f4c-daf4-71b8-8e77-846af001e96c";
const EXITED: &str = "01a22f4c-e230-7499-ad94-0cbda1652b43";
/// The versions sqlx's migrator records as applied.
const APPLIED: &str = "SELECT version FROM _sqlx_migrations WHERE success ORDER BY version";

async fn sqlite_at(dir: &std::path::Path) -> sqlx::SqliteConnection {
    sqlx::SqliteConnection::connect(&format!("sqlite://{}", dir.join("holdfast.db").display()))
        .await
        .expect("open the data dir's database")
}

#[tokio::test]
async fn a_data_dir_made_by_the_rusqlite_build_opens_with_everything_in_it() {
    run(Store::Sqlite, async {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("holdfast.db"), FIXTURE).expect("fixture");
        // The fixture's ended records outlive any retention: they were made
        // on 2026-12-01, and the default (7d) deleted them from 12-08 on.
        let s = Server::start_in(dir.path(), KEEP).await;

        let held = s.lease(HELD).await;
        assert_eq!(
            (&held["resource"], &held["holder"], &held["token"]),
            (&json!("legacy/held"), &json!("keeper"), &json!(1))
        );
        assert_eq!(
            held["metadata"],
            json!({"note": "made by the rusqlite build"})
        );
        assert_eq!(s.lease(RELEASED).await["state"], "released");
        let p = s.process(EXITED).await;
        assert_eq!(
            (&p["state"], &p["kind"]),
            (&json!("exited"), &json!("legacy"))
        );
        // Nine events were written; the held lease may have expired since
        // the fixture was made (then its end and its port's are added).
        let seqs = |events: &[serde_json::Value]| -> Vec<i64> {
            events
                .iter()
                .map(|e| e["seq"].as_i64().expect("seq"))
                .collect()
        };
        let before = seqs(&s.all_events().await);
        assert!(before.len() >= 9, "{before:?}");
        assert_eq!(before, (1..=before.len() as i64).collect::<Vec<_>>());

        let next = s.acquire_ok("legacy/released", "new").await;
        assert_eq!(next["token"], 3, "tokens go on from the old counter");
        let after = seqs(&s.all_events().await);
        assert_eq!(
            after.last(),
            Some(&(before.len() as i64 + 1)),
            "seqs go on too"
        );
        s.kill9().await;

        // Opened again, it is not baselined a second time.
        let s = Server::start_in(dir.path(), KEEP).await;
        let id = next["id"].as_str().expect("id");
        assert_eq!(
            s.lease_op(id, "release", json!({"token": 3})).await.body["state"],
            "released"
        );
        assert_eq!(s.acquire_ok("legacy/released", "newer").await["token"], 4);
        s.kill9().await;

        let mut db = sqlite_at(dir.path()).await;
        let versions: Vec<i64> = sqlx::query_scalar(APPLIED)
            .fetch_all(&mut db)
            .await
            .expect("migrations");
        assert_eq!(
            versions,
            [1, 2, 3, 4, 5, 6],
            "baselined at 2, then migrated"
        );
        let user_version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&mut db)
            .await
            .expect("user_version");
        assert_eq!(user_version, 6, "kept for older builds");
    })
    .await
}

/// Run `holdfast serve` on `dir`, expecting it to exit: its stderr.
async fn refused(dir: &std::path::Path, args: &[&str]) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_holdfast"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(args)
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success(), "it started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn a_sqlite_schema_newer_than_this_build_is_refused_either_way_it_is_recorded() {
    run(Store::Sqlite, async {
        // As an older build recorded it, and as sqlx's migrator does.
        let legacy = tempfile::tempdir().expect("tempdir");
        std::fs::write(legacy.path().join("holdfast.db"), FIXTURE).expect("fixture");
        let mut db = sqlite_at(legacy.path()).await;
        sqlx::raw_sql("PRAGMA user_version = 99")
            .execute(&mut db)
            .await
            .expect("bump");
        db.close().await.expect("close");
        let err = refused(legacy.path(), &[]).await;
        assert!(err.contains("schema is version 99, newer than this holdfast knows"), "{err}");

        let current = tempfile::tempdir().expect("tempdir");
        Server::start_in(current.path(), &[]).await.kill9().await;
        let mut db = sqlite_at(current.path()).await;
        sqlx::raw_sql(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99, 'from the future', TRUE, x'00', 0)",
        )
        .execute(&mut db)
        .await
        .expect("insert");
        db.close().await.expect("close");
        let err = refused(current.path(), &[]).await;
        assert!(err.contains("schema is version 99, newer than this holdfast knows"), "{err}");
    })
    .await
}

/// The schema as the build before sqlx's migrator left it: the migration
/// files applied, their versions in `holdfast_schema`.
async fn legacy_postgres(url: &str, versions: &[i64]) {
    let mut db = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::raw_sql(
        "CREATE TABLE holdfast_schema (\
           version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(&mut db)
    .await
    .expect("holdfast_schema");
    for sql in [
        include_str!("../../migrations/postgres/0001_leases.sql"),
        include_str!("../../migrations/postgres/0002_processes_ports.sql"),
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut db)
            .await
            .expect("migration");
    }
    for v in versions {
        sqlx::query("INSERT INTO holdfast_schema (version) VALUES ($1)")
            .bind(v)
            .execute(&mut db)
            .await
            .expect("version");
    }
    sqlx::raw_sql("INSERT INTO resources (resource, last_token) VALUES ('legacy', 7)")
        .execute(&mut db)
        .await
        .expect("a token counter");
}

#[tokio::test]
async fn a_postgres_database_migrated_before_sqlx_opens_and_a_newer_one_is_refused() {
    run(Store::Postgres, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = database_for(dir.path()).await;
        legacy_postgres(&url, &[1, 2]).await;
        let s = Server::start_in(dir.path(), &[]).await;
        assert_eq!(s.acquire_ok("legacy", "h").await["token"], 8);
        s.kill9().await;
        let mut db = sqlx::PgConnection::connect(&url).await.expect("connect");
        let versions: Vec<i64> = sqlx::query_scalar(APPLIED)
            .fetch_all(&mut db)
            .await
            .expect("migrations");
        assert_eq!(
            versions,
            [1, 2, 3, 4, 5, 6],
            "baselined at 2, then migrated"
        );

        let newer = tempfile::tempdir().expect("tempdir");
        let url = database_for(newer.path()).await;
        legacy_postgres(&url, &[1, 2, 99]).await;
        let err = refused(newer.path(), &["--database", &url]).await;
        assert!(
            err.contains("schema is version 99, newer than this holdfast knows"),
            "{err}"
        );
    })
    .await
}

/// An unconfirmed registration that an earlier version claimed stayed
/// `orphaned` for ever, keeping its operation id and ports: the first pass
/// of this build ends it, as it now ends one when it claims it.
#[tokio::test]
async fn an_unconfirmed_orphan_left_by_an_earlier_version_is_ended() {
    run(Store::Sqlite, async {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Server::start_in(dir.path(), &[]).await;
        let reg = s
            .spawn(json!({"kind": "job", "operation_id": "op-old", "ports": ["http"]}))
            .await;
        let id = reg["id"].as_str().expect("id").to_owned();
        s.kill9().await;
        // As the earlier version's claim left it.
        let mut db = sqlite_at(dir.path()).await;
        sqlx::query("UPDATE processes SET state = 'orphaned', token = 2 WHERE id = $1")
            .bind(&id)
            .execute(&mut db)
            .await
            .expect("update");
        db.close().await.expect("close");

        let s = Server::start_in(dir.path(), &["--reconcile-interval-ms", "100"]).await;
        let ended = s
            .eventually(
                &format!("/v1/processes/{id}"),
                std::time::Duration::from_secs(10),
                |v| v["state"] == "stopped",
            )
            .await;
        assert_eq!(ended["end_reason"], "orphan_reconciled", "{ended}");
        assert_eq!(s.get("/v1/ports").await.body["items"], json!([]));
        let again = s
            .post(
                "/v1/processes",
                json!({"kind": "job", "operation_id": "op-old"}),
            )
            .await;
        assert_eq!(again.status, reqwest::StatusCode::CREATED, "{}", again.body);
    })
    .await
}
