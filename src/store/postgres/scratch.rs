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
