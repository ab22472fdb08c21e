//! Migrations, embedded in the binary and tracked with `PRAGMA user_version`.

use rusqlite::Connection;

use super::map_err;
use crate::store::{Result, StoreError};

/// (version, SQL), in order. Every file in migrations/sqlite is listed here.
pub const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/sqlite/0001_leases.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/sqlite/0002_processes_ports.sql"),
    ),
];

/// Bring the schema up to date, in one transaction per migration. Refuses a
/// database whose schema is newer than this build knows.
pub fn migrate(conn: &mut Connection) -> Result<()> {
    let current: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(map_err)?;
    let latest = MIGRATIONS.last().map_or(0, |(v, _)| *v);
    if current > latest {
        return Err(StoreError::Unavailable(format!(
            "the database schema is version {current}, newer than this holdfast knows ({latest}): upgrade holdfast"
        )));
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > current) {
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(map_err)?;
        tx.execute_batch(sql).map_err(map_err)?;
        tx.pragma_update(None, "user_version", version)
            .map_err(map_err)?;
        tx.commit().map_err(map_err)?;
        tracing::info!(version, "applied sqlite migration");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/sqlite");
        let files = std::fs::read_dir(dir).expect("migrations dir").count();
        assert_eq!(files, MIGRATIONS.len());
    }

    #[test]
    fn migrates_once_and_refuses_a_newer_schema() {
        let mut conn = Connection::open_in_memory().expect("open");
        migrate(&mut conn).expect("first");
        migrate(&mut conn).expect("again is a no-op");
        conn.pragma_update(None, "user_version", 99).expect("bump");
        assert!(matches!(
            migrate(&mut conn),
            Err(StoreError::Unavailable(_))
        ));
    }
}
