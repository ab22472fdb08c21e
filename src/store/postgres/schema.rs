//! Migrations (see `store::migrate`). Hosts that start at once take turns
//! on sqlx's advisory lock. Before sqlx's migrator, versions were tracked
//! in `holdfast_schema`; a database that has it is first baselined, and it
//! is kept up to date so that an older holdfast refuses a newer schema.

use sqlx::migrate::Migrate;
use sqlx::{PgConnection, PgPool};

use super::map_err;
use crate::store::Result;
use crate::store::migrate::{self, POSTGRES, migrate_err};

pub async fn migrate(pool: &PgPool) -> Result<()> {
    let mut conn = pool.acquire().await.map_err(map_err)?;
    // Wait as long as another host's migration takes, not `lock_timeout`.
    sqlx::raw_sql("SET lock_timeout = 0")
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
    conn.lock().await.map_err(migrate_err)?;
    let out = locked(&mut conn).await;
    let unlocked = conn.unlock().await.map_err(migrate_err);
    let reset = sqlx::raw_sql("RESET lock_timeout")
        .execute(&mut *conn)
        .await
        .map_err(map_err);
    out.and(unlocked).and(reset.map(|_| ()))
}

async fn locked(conn: &mut PgConnection) -> Result<()> {
    let migrator = migrate::migrator(POSTGRES).await?;
    let legacy: bool = sqlx::query_scalar("SELECT to_regclass('holdfast_schema') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .map_err(map_err)?;
    if legacy {
        let version: i64 =
            sqlx::query_scalar("SELECT COALESCE(max(version), 0) FROM holdfast_schema")
                .fetch_one(&mut *conn)
                .await
                .map_err(map_err)?;
        migrate::baseline(conn, &migrator, POSTGRES, version).await?;
    }
    migrate::run(conn, &migrator, POSTGRES).await?;
    if legacy {
        sqlx::raw_sql(
            "INSERT INTO holdfast_schema (version) SELECT version FROM _sqlx_migrations \
             WHERE success ON CONFLICT (version) DO NOTHING",
        )
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
    }
    Ok(())
}
