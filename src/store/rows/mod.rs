//! Every statement of the stores, written once for both databases, and each
//! record decoded once. Write transactions and reads both use these.

mod event;
mod idempotency;
mod lease;
mod port;
mod process;
mod retention;

pub use event::*;
pub use idempotency::*;
pub use lease::*;
pub use port::*;
pub use process::*;
pub use retention::*;

use super::Result;
use super::db::{Exec, Stmt, scalar};

pub async fn set_meta<E: Exec + ?Sized>(c: &mut E, key: &str, value: &str) -> Result<()> {
    let s = Stmt::new(
        "INSERT INTO meta (key, value) VALUES ($1, $2) \
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    );
    c.execute(s.text(key).text(value)).await
}

pub async fn meta<E: Exec + ?Sized>(c: &mut E, key: &str) -> Result<Option<String>> {
    let s = Stmt::new("SELECT value FROM meta WHERE key = $1").text(key);
    match c.fetch(s).await?.first() {
        Some(r) => super::db::Cols::opt_text(r, 0),
        None => Ok(None),
    }
}

/// `SELECT count(*) ...`.
pub async fn count<E: Exec + ?Sized>(c: &mut E, sql: &str) -> Result<i64> {
    Ok(scalar(c, Stmt::new(sql)).await?.unwrap_or(0))
}
