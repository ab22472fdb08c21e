//! SQL and row decoding for processes and port reservations.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::map_err;
use super::rows::{count, decode_err, from_json, to_json};
use crate::model::{
    Exit, Logs, PortOwner, PortRecord, ProcessFilter, ProcessRecord, ProcessState, TokenRef,
};
use crate::store::sql::{self, PORT_COLS, PROCESS_COLS, PROCESS_CURRENT};
use crate::store::{Result, StoreError};
use crate::time::Millis;

fn get<'r, T>(r: &'r PgRow, i: usize) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    r.try_get(i).map_err(map_err)
}

fn process_row(r: &PgRow) -> Result<ProcessRecord> {
    let lease = match (get::<Option<String>>(r, 5)?, get::<Option<i64>>(r, 6)?) {
        (Some(id), Some(token)) => Some(TokenRef { id, token }),
        _ => None,
    };
    let logs = match (get::<Option<String>>(r, 12)?, get::<Option<String>>(r, 13)?) {
        (Some(stdout), Some(stderr)) => Some(Logs { stdout, stderr }),
        _ => None,
    };
    let state: String = get(r, 2)?;
    let metadata: String = get(r, 22)?;
    Ok(ProcessRecord {
        id: get(r, 0)?,
        kind: get(r, 1)?,
        state: ProcessState::parse(&state).ok_or_else(|| decode_err("process state", &state))?,
        token: get(r, 3)?,
        operation_id: get(r, 4)?,
        lease,
        host_id: get(r, 7)?,
        identity: from_json("identity", get(r, 8)?)?,
        owner: from_json("owner", get(r, 9)?)?,
        spawned: get(r, 10)?,
        command: from_json("command", get(r, 11)?)?,
        logs,
        exit: Exit {
            code: get(r, 14)?,
            signal: get(r, 15)?,
        },
        ttl_ms: get(r, 16)?,
        expires_at: get(r, 17)?,
        created_at: get(r, 18)?,
        started_at: get(r, 19)?,
        ended_at: get(r, 20)?,
        end_reason: get(r, 21)?,
        metadata: serde_json::from_str(&metadata).map_err(|e| decode_err("metadata", e))?,
    })
}

async fn processes(c: &mut PgConnection, sql: &str, args: &[&str]) -> Result<Vec<ProcessRecord>> {
    let mut q = sqlx::query(sql);
    for a in args {
        q = q.bind(*a);
    }
    let rows = q.fetch_all(c).await.map_err(map_err)?;
    rows.iter().map(process_row).collect()
}

pub async fn process(c: &mut PgConnection, id: &str) -> Result<Option<ProcessRecord>> {
    let sql = format!("SELECT {PROCESS_COLS} FROM processes WHERE id = $1");
    Ok(processes(c, &sql, &[id]).await?.pop())
}

pub async fn process_by_operation(c: &mut PgConnection, op: &str) -> Result<Option<ProcessRecord>> {
    let sql = format!(
        "SELECT {PROCESS_COLS} FROM processes WHERE operation_id = $1 AND {PROCESS_CURRENT}"
    );
    Ok(processes(c, &sql, &[op]).await?.pop())
}

pub async fn insert_process(c: &mut PgConnection, p: &ProcessRecord) -> Result<()> {
    let sql = format!(
        "INSERT INTO processes ({PROCESS_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
         $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)"
    );
    sqlx::query(&sql)
        .bind(&p.id)
        .bind(&p.kind)
        .bind(p.state.as_str())
        .bind(p.token)
        .bind(&p.operation_id)
        .bind(p.lease.as_ref().map(|l| l.id.as_str()))
        .bind(p.lease.as_ref().map(|l| l.token))
        .bind(&p.host_id)
        .bind(p.identity.as_ref().map(to_json).transpose()?)
        .bind(p.owner.as_ref().map(to_json).transpose()?)
        .bind(p.spawned)
        .bind(p.command.as_ref().map(to_json).transpose()?)
        .bind(p.logs.as_ref().map(|l| l.stdout.as_str()))
        .bind(p.logs.as_ref().map(|l| l.stderr.as_str()))
        .bind(p.exit.code)
        .bind(p.exit.signal)
        .bind(p.ttl_ms)
        .bind(p.expires_at)
        .bind(p.created_at)
        .bind(p.started_at)
        .bind(p.ended_at)
        .bind(&p.end_reason)
        .bind(to_json(&p.metadata)?)
        .execute(c)
        .await
        .map_err(map_err)?;
    Ok(())
}

pub async fn update_process(c: &mut PgConnection, p: &ProcessRecord) -> Result<()> {
    let done = sqlx::query(
        "UPDATE processes SET state = $1, token = $2, identity = $3, owner = $4, exit_code = $5, \
         exit_signal = $6, ttl_ms = $7, expires_at = $8, started_at = $9, ended_at = $10, \
         end_reason = $11 WHERE id = $12",
    )
    .bind(p.state.as_str())
    .bind(p.token)
    .bind(p.identity.as_ref().map(to_json).transpose()?)
    .bind(p.owner.as_ref().map(to_json).transpose()?)
    .bind(p.exit.code)
    .bind(p.exit.signal)
    .bind(p.ttl_ms)
    .bind(p.expires_at)
    .bind(p.started_at)
    .bind(p.ended_at)
    .bind(&p.end_reason)
    .bind(&p.id)
    .execute(c)
    .await
    .map_err(map_err)?;
    if done.rows_affected() != 1 {
        return Err(StoreError::Other(format!(
            "process {} vanished during update",
            p.id
        )));
    }
    Ok(())
}

pub async fn list_processes(c: &mut PgConnection, f: &ProcessFilter) -> Result<Vec<ProcessRecord>> {
    let (sql, args) = sql::list_processes('$', f);
    processes(c, &sql, &args).await
}

pub async fn current_processes(c: &mut PgConnection, host_id: &str) -> Result<Vec<ProcessRecord>> {
    let sql = format!(
        "SELECT {PROCESS_COLS} FROM processes WHERE host_id = $1 AND {PROCESS_CURRENT} ORDER BY id"
    );
    processes(c, &sql, &[host_id]).await
}

pub async fn count_current_processes(c: &mut PgConnection) -> Result<i64> {
    count(
        c,
        &format!("SELECT count(*) FROM processes WHERE {PROCESS_CURRENT}"),
    )
    .await
}

fn port_row(r: &PgRow) -> Result<PortRecord> {
    let kind: String = get(r, 4)?;
    let target = TokenRef {
        id: get(r, 5)?,
        token: get(r, 6)?,
    };
    let owner = if kind == "process" {
        PortOwner {
            process: Some(target),
            lease: None,
        }
    } else {
        PortOwner {
            process: None,
            lease: Some(target),
        }
    };
    let port: i32 = get(r, 2)?;
    Ok(PortRecord {
        id: get(r, 0)?,
        host_id: get(r, 1)?,
        port: u16::try_from(port).map_err(|e| decode_err("port", e))?,
        name: get(r, 3)?,
        owner,
        reserved_at: get(r, 7)?,
        released_at: get(r, 8)?,
    })
}

async fn ports(
    q: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    c: &mut PgConnection,
) -> Result<Vec<PortRecord>> {
    let rows = q.fetch_all(c).await.map_err(map_err)?;
    rows.iter().map(port_row).collect()
}

pub async fn held_ports(c: &mut PgConnection, host_id: &str) -> Result<Vec<u16>> {
    let held: Vec<i32> =
        sqlx::query_scalar("SELECT port FROM ports WHERE host_id = $1 AND released_at IS NULL")
            .bind(host_id)
            .fetch_all(c)
            .await
            .map_err(map_err)?;
    held.into_iter()
        .map(|p| u16::try_from(p).map_err(|e| decode_err("port", e)))
        .collect()
}

pub async fn current_port(
    c: &mut PgConnection,
    host_id: &str,
    port: u16,
) -> Result<Option<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE host_id = $1 AND port = $2 AND released_at IS NULL"
    );
    let q = sqlx::query(&sql).bind(host_id).bind(i32::from(port));
    Ok(ports(q, c).await?.pop())
}

pub async fn insert_port(c: &mut PgConnection, p: &PortRecord) -> Result<()> {
    let target = p
        .owner
        .target()
        .ok_or_else(|| StoreError::Other("a port without an owner".into()))?;
    let sql =
        format!("INSERT INTO ports ({PORT_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)");
    sqlx::query(&sql)
        .bind(&p.id)
        .bind(&p.host_id)
        .bind(i32::from(p.port))
        .bind(&p.name)
        .bind(p.owner.kind())
        .bind(&target.id)
        .bind(target.token)
        .bind(p.reserved_at)
        .bind(p.released_at)
        .execute(c)
        .await
        .map_err(map_err)?;
    Ok(())
}

pub async fn ports_of(c: &mut PgConnection, owner_id: &str) -> Result<Vec<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE owner_id = $1 AND released_at IS NULL ORDER BY name"
    );
    ports(sqlx::query(&sql).bind(owner_id), c).await
}

pub async fn ports_of_owners(
    c: &mut PgConnection,
    owner_ids: &[String],
) -> Result<Vec<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE owner_id = ANY($1) AND released_at IS NULL \
         ORDER BY owner_id, name"
    );
    ports(sqlx::query(&sql).bind(owner_ids), c).await
}

pub async fn release_port(c: &mut PgConnection, id: &str, at: Millis) -> Result<()> {
    sqlx::query("UPDATE ports SET released_at = $1 WHERE id = $2 AND released_at IS NULL")
        .bind(at)
        .bind(id)
        .execute(c)
        .await
        .map_err(map_err)?;
    Ok(())
}

pub async fn list_ports(
    c: &mut PgConnection,
    host_id: Option<&str>,
    after_port: u16,
    limit: u32,
) -> Result<Vec<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE released_at IS NULL \
         AND ($1::text IS NULL OR host_id = $1) \
         AND port > $2 ORDER BY port, host_id LIMIT $3"
    );
    let q = sqlx::query(&sql)
        .bind(host_id)
        .bind(i32::from(after_port))
        .bind(i64::from(limit));
    ports(q, c).await
}
