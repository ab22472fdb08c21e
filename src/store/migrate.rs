//! Schema migrations, run by sqlx's migrator from the files in
//! `migrations/sqlite` and `migrations/postgres`, embedded in the binary.
//! Databases made before holdfast used sqlx's migrator tracked their schema
//! version elsewhere (SQLite's `user_version`, PostgreSQL's
//! `holdfast_schema`); those versions are first recorded as applied.

use std::borrow::Cow;

use futures_util::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migrate, MigrateError, Migration, MigrationSource, MigrationType, Migrator};

use super::{Result, StoreError};

/// One migration file: its version, its description, its SQL.
pub type File = (i64, &'static str, &'static str);

pub const SQLITE: &[File] = &[
    (
        1,
        "leases",
        include_str!("../../migrations/sqlite/0001_leases.sql"),
    ),
    (
        2,
        "processes ports",
        include_str!("../../migrations/sqlite/0002_processes_ports.sql"),
    ),
    (
        3,
        "idempotency",
        include_str!("../../migrations/sqlite/0003_idempotency.sql"),
    ),
    (
        4,
        "partial parent index",
        include_str!("../../migrations/sqlite/0004_partial_parent_index.sql"),
    ),
    (
        5,
        "renewals in place",
        include_str!("../../migrations/sqlite/0005_renewals_in_place.sql"),
    ),
    (
        6,
        "idempotency run",
        include_str!("../../migrations/sqlite/0006_idempotency_run.sql"),
    ),
];

pub const POSTGRES: &[File] = &[
    (
        1,
        "leases",
        include_str!("../../migrations/postgres/0001_leases.sql"),
    ),
    (
        2,
        "processes ports",
        include_str!("../../migrations/postgres/0002_processes_ports.sql"),
    ),
    (
        3,
        "idempotency",
        include_str!("../../migrations/postgres/0003_idempotency.sql"),
    ),
    (
        4,
        "partial parent index",
        include_str!("../../migrations/postgres/0004_partial_parent_index.sql"),
    ),
    (
        5,
        "renewals in place",
        include_str!("../../migrations/postgres/0005_renewals_in_place.sql"),
    ),
    (
        6,
        "idempotency run",
        include_str!("../../migrations/postgres/0006_idempotency_run.sql"),
    ),
];

/// The embedded files, as sqlx's migrator takes its migrations.
#[derive(Debug)]
struct Embedded(&'static [File]);

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        let migrations = self
            .0
            .iter()
            .map(|(version, description, sql)| {
                Migration::new(
                    *version,
                    Cow::Borrowed(*description),
                    MigrationType::Simple,
                    Cow::Borrowed(*sql),
                    false,
                )
            })
            .collect();
        Box::pin(std::future::ready(Ok(migrations)))
    }
}

pub async fn migrator(files: &'static [File]) -> Result<Migrator> {
    let mut m = Migrator::new(Embedded(files)).await.map_err(migrate_err)?;
    // The caller takes the lock itself, around the baseline too.
    m.set_locking(false);
    Ok(m)
}

pub fn latest(files: &[File]) -> i64 {
    files.last().map_or(0, |f| f.0)
}

pub fn newer_schema(version: i64, files: &[File]) -> StoreError {
    StoreError::Unavailable(format!(
        "the database schema is version {version}, newer than this holdfast knows ({}): upgrade holdfast",
        latest(files)
    ))
}

/// Record versions `1..=through` as applied when the database predates
/// sqlx's migrator (its table is empty) but its schema is at `through`.
pub async fn baseline<C: Migrate>(
    conn: &mut C,
    migrator: &Migrator,
    files: &[File],
    through: i64,
) -> Result<()> {
    conn.ensure_migrations_table().await.map_err(migrate_err)?;
    let applied = conn.list_applied_migrations().await.map_err(migrate_err)?;
    if !applied.is_empty() || through == 0 {
        return Ok(());
    }
    if through > latest(files) {
        return Err(newer_schema(through, files));
    }
    for m in migrator.iter().filter(|m| m.version <= through) {
        // Record it, with the file's checksum, without running its SQL again.
        let record = Migration {
            sql: Cow::Borrowed("SELECT 1"),
            ..m.clone()
        };
        conn.apply(&record).await.map_err(migrate_err)?;
    }
    tracing::info!(
        through,
        "recorded the existing schema in sqlx's migration table"
    );
    Ok(())
}

pub fn migrate_err(e: MigrateError) -> StoreError {
    StoreError::Unavailable(format!("migrating the database: {e}"))
}

/// Run the migrations not applied yet; a schema newer than this build is refused.
pub async fn run<C: Migrate>(conn: &mut C, migrator: &Migrator, files: &[File]) -> Result<()> {
    match migrator.run_direct(conn).await {
        Ok(()) => Ok(()),
        Err(MigrateError::VersionMissing(v)) => Err(newer_schema(v, files)),
        Err(e) => Err(migrate_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded_in_order() {
        for (dir, files) in [("sqlite", SQLITE), ("postgres", POSTGRES)] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(dir);
            let mut names: Vec<String> = std::fs::read_dir(path)
                .expect("migrations dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            let versions: Vec<i64> = names
                .iter()
                .map(|n| n[..4].parse().expect("NNNN_ prefix"))
                .collect();
            let embedded: Vec<i64> = files.iter().map(|f| f.0).collect();
            assert_eq!(versions, embedded, "{dir}");
        }
    }
}
