//! Migrations, embedded in the binary and tracked in `holdfast_schema`.

use sqlx::PgPool;

use super::map_err;
use crate::store::{Result, StoreError};

/// (version, SQL), in order. Every file in migrations/postgres is listed here.
pub const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/postgres/0001_leases.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/postgres/0002_processes_ports.sql"),
    ),
];

/// Bring the schema up to date in one transaction. Hosts that start at
/// once take turns (an advisory lock), and each sees what the last applied.
/// Refuses a schema newer than this build knows.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    // Wait as long as another host's migration takes, not `lock_timeout`.
    sqlx::query("SET LOCAL lock_timeout = 0")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('holdfast.migrate'))")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    let tracked: bool = sqlx::query_scalar("SELECT to_regclass('holdfast_schema') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await
        .map_err(map_err)?;
    if !tracked {
        sqlx::raw_sql(
            "CREATE TABLE holdfast_schema (\
               version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        )
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    }
    let current: i64 = sqlx::query_scalar("SELECT COALESCE(max(version), 0) FROM holdfast_schema")
        .fetch_one(&mut *tx)
        .await
        .map_err(map_err)?;
    let latest = MIGRATIONS.last().map_or(0, |(v, _)| *v);
    if current > latest {
        return Err(StoreError::Unavailable(format!(
            "the database schema is version {current}, newer than this holdfast knows ({latest}): upgrade holdfast"
        )));
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > current) {
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        sqlx::query("INSERT INTO holdfast_schema (version) VALUES ($1)")
            .bind(version)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        tracing::info!(version, "applied postgres migration");
    }
    tx.commit().await.map_err(map_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
        let files = std::fs::read_dir(dir).expect("migrations dir").count();
        assert_eq!(files, MIGRATIONS.len());
    }
}
