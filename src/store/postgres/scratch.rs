//! For unit tests: a new database of the test PostgreSQL, with holdfast's
//! schema made, as the integration tests find their server
//! (tests/integration/stores.rs).

use std::sync::Arc;

use sqlx::Connection;

use super::{PgStore, PoolSettings};
use crate::store::{Backend, CommitListener, Effect};

/// A listener of no commits, for stores whose tests read what they wrote.
pub struct Nobody;
impl CommitListener for Nobody {
    fn committed(&self, _: &[Effect]) {}
}

/// The URL of a new database with the schema made, or None when
/// `HOLDFAST_TEST_POSTGRES` is `off`, or unset and nothing answers at the
/// default address (the test then says it skipped).
pub async fn database() -> Option<String> {
    let (base, required) = match std::env::var("HOLDFAST_TEST_POSTGRES") {
        Ok(v) if v == "off" => {
            eprintln!("SKIPPED: HOLDFAST_TEST_POSTGRES=off");
            return None;
        }
        Ok(v) if !v.is_empty() => (v, true),
        _ => ("postgres://postgres@127.0.0.1:5432".into(), false),
    };
    let name = format!("hf_t_{}", uuid::Uuid::now_v7().simple());
    let mut admin = match sqlx::PgConnection::connect(&format!("{base}/postgres")).await {
        Ok(c) => c,
        Err(sqlx::Error::Io(e)) if !required => {
            eprintln!("SKIPPED: HOLDFAST_TEST_POSTGRES is unset and {base} does not answer: {e}");
            return None;
        }
        Err(e) => panic!("cannot reach the test PostgreSQL at {base}: {e}"),
    };
    sweep(&mut admin).await;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create");
    let settings = PoolSettings {
        max_connections: 4,
        timeout: std::time::Duration::from_secs(5),
    };
    let url = format!("{base}/{name}");
    let store = PgStore::connect(&url, &settings, Arc::new(Nobody))
        .await
        .expect("store");
    store.close().await;
    Some(url)
}

/// Drops the test databases (these and the integration tests', both named
/// `hf_t_<uuid v7>`) made over an hour ago: these are never dropped by the
/// test that made them, which cannot wait in a `Drop`, and a test run
/// killed midway leaves the others. No test runs for an hour.
async fn sweep(admin: &mut sqlx::PgConnection) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'hf\\_t\\_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for name in names {
        let made = uuid::Uuid::parse_str(&name["hf_t_".len()..])
            .ok()
            .and_then(|u| u.get_timestamp())
            .map(|t| t.to_unix().0);
        if made.is_some_and(|at| at + 3600 < now) {
            let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            let _ = sqlx::query(&drop).execute(&mut *admin).await;
        }
    }
}
