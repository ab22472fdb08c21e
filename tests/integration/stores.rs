//! Every test written with `stores!` runs twice: against the embedded
//! SQLite store and against PostgreSQL, each server with a database of its
//! own. `HOLDFAST_TEST_POSTGRES` names the PostgreSQL server
//! (default `postgres://postgres@127.0.0.1:5432`); `off` skips those runs.

use std::cell::Cell;
use std::future::Future;
use std::path::Path;

use sqlx::Connection;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Sqlite,
    Postgres,
}

thread_local! {
    // Thread-local, not global: `cargo test` runs tests on threads of one
    // process, and a `#[tokio::test]` runs its tasks on its own thread.
    static STORE: Cell<Store> = const { Cell::new(Store::Sqlite) };
}

/// `name` as one test per store: `name::sqlite` and `name::postgres`.
macro_rules! stores {
    ($name:ident $(, $flavor:tt)?) => {
        mod $name {
            #[tokio::test $( (flavor = $flavor, worker_threads = 2) )?]
            async fn sqlite() {
                crate::stores::run(crate::stores::Store::Sqlite, super::$name()).await
            }
            #[tokio::test $( (flavor = $flavor, worker_threads = 2) )?]
            async fn postgres() {
                crate::stores::run(crate::stores::Store::Postgres, super::$name()).await
            }
        }
    };
}
pub(crate) use stores;

pub async fn run(store: Store, test: impl Future<Output = ()>) {
    if store == Store::Postgres && postgres_base().is_none() {
        eprintln!("SKIPPED: HOLDFAST_TEST_POSTGRES=off");
        return;
    }
    STORE.with(|s| s.set(store));
    test.await
}

pub fn current() -> Store {
    STORE.with(Cell::get)
}

/// The PostgreSQL server of the tests, or None when they are turned off.
pub fn postgres_base() -> Option<String> {
    match std::env::var("HOLDFAST_TEST_POSTGRES") {
        Ok(v) if v == "off" => None,
        Ok(v) if !v.is_empty() => Some(v.trim_end_matches('/').to_owned()),
        _ => Some("postgres://postgres@127.0.0.1:5432".to_owned()),
    }
}

const MARKER: &str = "test-database-url";

/// The `--database` arguments for a server on `dir` under the current
/// store. On PostgreSQL, the first server on a directory gets a new
/// database; later ones (restarts, a second "host") share it.
pub async fn database_args(dir: &Path) -> Vec<String> {
    match current() {
        Store::Sqlite => Vec::new(),
        Store::Postgres => vec!["--database".into(), database_for(dir).await],
    }
}

pub async fn database_for(dir: &Path) -> String {
    let marker = dir.join(MARKER);
    if let Ok(url) = std::fs::read_to_string(&marker) {
        return url;
    }
    let base = postgres_base().expect("PostgreSQL tests are on");
    let name = format!("hf_t_{}", uuid::Uuid::now_v7().simple());
    let mut admin = sqlx::PgConnection::connect(&format!("{base}/postgres"))
        .await
        .unwrap_or_else(|e| {
            panic!("cannot reach the test PostgreSQL at {base} (set HOLDFAST_TEST_POSTGRES, or =off): {e}")
        });
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create the test database");
    let _ = admin.close().await;
    let url = format!("{base}/{name}");
    std::fs::write(&marker, &url).expect("write the database marker");
    url
}

/// Drop the database of `dir`, if it has one, without waiting: for a
/// server's `Drop`, when its directory goes too.
pub fn drop_database_of(dir: &Path) {
    let Ok(url) = std::fs::read_to_string(dir.join(MARKER)) else {
        return;
    };
    let Some((base, name)) = url.rsplit_once('/') else {
        return;
    };
    let _ = std::process::Command::new("psql")
        .arg(format!("{base}/postgres"))
        .args([
            "-qc",
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
}

/// Let servers on `to` use the database of `from`: two "hosts" of one fleet.
pub fn share_database(from: &Path, to: &Path) {
    let url = std::fs::read_to_string(from.join(MARKER)).expect("the first server made a database");
    std::fs::write(to.join(MARKER), url).expect("write the database marker");
}
