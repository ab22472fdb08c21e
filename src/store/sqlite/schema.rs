//! Migrations (see `store::migrate`). Before sqlx's migrator, the schema
//! version was kept in `PRAGMA user_version`; it is still set, so that an
//! older holdfast refuses a schema newer than it knows.

use sqlx::SqliteConnection;

use super::map_err;
use crate::store::Result;
use crate::store::migrate::{self, SQLITE};

pub async fn migrate(conn: &mut SqliteConnection) -> Result<()> {
    let migrator = migrate::migrator(SQLITE).await?;
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&mut *conn)
        .await
        .map_err(map_err)?;
    migrate::baseline(conn, &migrator, SQLITE, version).await?;
    migrate::run(conn, &migrator, SQLITE).await?;
    // A constant: PRAGMA takes no parameters.
    let latest = migrate::latest(SQLITE);
    sqlx::raw_sql(&format!("PRAGMA user_version = {latest}"))
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
    Ok(())
}
