//! Every test written with `stores!` runs twice: against the embedded
//! SQLite store and against PostgreSQL, each server with a database of its
//! own. `HOLDFAST_TEST_POSTGRES` names the PostgreSQL server; once it is set,
//! PostgreSQL is required and a test fails if it cannot reach it. `off` skips
//! those runs. Unset, the default `postgres://postgres@127.0.0.1:5432` is used
//! if something answers there; if nothing does, the PostgreSQL runs are
//! skipped, with one line on stderr. (`HOLDFAST_TEST_POSTGRES_DEFAULT`
//! replaces that default address: for the test of the skip itself.)

use std::cell::Cell;
use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

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
        return;
    }
    STORE.with(|s| s.set(store));
    test.await
}

pub fn current() -> Store {
    STORE.with(Cell::get)
}

const DEFAULT_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432";

/// The PostgreSQL server of the tests, or None when its half is skipped.
/// Decided once per process; a skip is announced then, in one line.
pub fn postgres_base() -> Option<String> {
    static BASE: OnceLock<Option<String>> = OnceLock::new();
    BASE.get_or_init(|| {
        let (base, skipped) = decide_postgres();
        if let Some(why) = skipped {
            // Straight to stderr: the test harness captures `eprintln!`.
            let _ = writeln!(
                std::io::stderr(),
                "holdfast tests: skipping every ::postgres test: {why}"
            );
        }
        base
    })
    .clone()
}

fn decide_postgres() -> (Option<String>, Option<String>) {
    let named = std::env::var("HOLDFAST_TEST_POSTGRES").unwrap_or_default();
    if named == "off" {
        return (None, Some("HOLDFAST_TEST_POSTGRES=off".into()));
    }
    if !named.is_empty() {
        return (Some(named.trim_end_matches('/').to_owned()), None);
    }
    let default = std::env::var("HOLDFAST_TEST_POSTGRES_DEFAULT")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_POSTGRES.to_owned());
    let default = default.trim_end_matches('/').to_owned();
    if answers(&default) {
        (Some(default), None)
    } else {
        let why = format!(
            "HOLDFAST_TEST_POSTGRES is unset and nothing answers at {default} \
             (set HOLDFAST_TEST_POSTGRES to a server on which the tests may create databases)"
        );
        (None, Some(why))
    }
}

/// Whether anything accepts a TCP connection at the host and port of `url`.
fn answers(url: &str) -> bool {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host_port = rest.split(['/', '?']).next().unwrap_or(rest);
    let with_port = if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    };
    with_port.to_socket_addrs().is_ok_and(|mut addrs| {
        addrs.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
    })
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
            panic!(
                "cannot reach the test PostgreSQL at {base} (HOLDFAST_TEST_POSTGRES names \
                 another server; =off skips the PostgreSQL half): {e}"
            )
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

/// Run `sql` on the store of the (stopped) server of `dir`: to stage a
/// state the server could have left when killed at a given instant.
pub async fn execute_sql(dir: &Path, sql: &str) {
    match current() {
        Store::Sqlite => {
            let url = format!("sqlite://{}", dir.join("holdfast.db").display());
            let mut db = sqlx::SqliteConnection::connect(&url).await.expect("open");
            sqlx::raw_sql(sql).execute(&mut db).await.expect("execute");
            db.close().await.expect("close");
        }
        Store::Postgres => {
            let url = database_for(dir).await;
            let mut db = sqlx::PgConnection::connect(&url).await.expect("connect");
            sqlx::raw_sql(sql).execute(&mut db).await.expect("execute");
            db.close().await.expect("close");
        }
    }
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

/// Run two PostgreSQL tests of this binary in a process of their own, with
/// `HOLDFAST_TEST_POSTGRES` unset and `var` set to `value`: exit status and
/// all it wrote.
fn postgres_tests_with(var: &str, value: &str) -> (bool, String) {
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "service::health_and_readiness::postgres",
            "database::a_schema_newer_than_this_build_is_refused",
            "--exact",
        ])
        .env_remove("HOLDFAST_TEST_POSTGRES")
        .env_remove("HOLDFAST_TEST_POSTGRES_DEFAULT")
        .env(var, value)
        .output()
        .expect("run the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn postgres_half_is_skipped_only_when_unnamed_and_nothing_answers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let nowhere = format!("postgres://postgres@127.0.0.1:{port}");

    // Unset, and nothing answers at the default: skipped, said once, passed.
    let (ok, out) = postgres_tests_with("HOLDFAST_TEST_POSTGRES_DEFAULT", &nowhere);
    assert!(ok, "{out}");
    let line = format!(
        "holdfast tests: skipping every ::postgres test: HOLDFAST_TEST_POSTGRES is unset \
         and nothing answers at {nowhere}"
    );
    assert_eq!(out.matches(&line).count(), 1, "{out}");
    assert!(out.contains("2 passed; 0 failed"), "{out}");

    // Named: required, so the same tests fail.
    let (ok, out) = postgres_tests_with("HOLDFAST_TEST_POSTGRES", &nowhere);
    assert!(!ok, "{out}");
    assert!(!out.contains("skipping"), "{out}");
    assert!(
        out.contains(&format!("cannot reach the test PostgreSQL at {nowhere}")),
        "{out}"
    );
    assert!(out.contains("0 passed; 2 failed"), "{out}");
}
