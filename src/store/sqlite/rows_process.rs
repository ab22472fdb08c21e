//! SQL and row decoding for processes and port reservations.

use rusqlite::{Connection, Row, params};

use super::map_err;
use crate::model::{
    Exit, Logs, PortOwner, PortRecord, ProcessFilter, ProcessRecord, ProcessState, TokenRef,
};
use crate::store::sql::{self, PORT_COLS, PROCESS_COLS, PROCESS_CURRENT};
use crate::store::{Result, StoreError};
use crate::time::Millis;

fn bad(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Other(format!("stored {what} does not decode: {e}"))
}

fn json<T: serde::de::DeserializeOwned>(what: &str, s: Option<String>) -> Result<Option<T>> {
    s.map(|s| serde_json::from_str(&s))
        .transpose()
        .map_err(|e| bad(what, e))
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(e.to_string()))
}

type Raw = (
    ProcessRecord,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    String,
);

fn raw(r: &Row<'_>) -> rusqlite::Result<Raw> {
    let lease = match (r.get::<_, Option<String>>(5)?, r.get::<_, Option<i64>>(6)?) {
        (Some(id), Some(token)) => Some(TokenRef { id, token }),
        _ => None,
    };
    let logs = match (
        r.get::<_, Option<String>>(12)?,
        r.get::<_, Option<String>>(13)?,
    ) {
        (Some(stdout), Some(stderr)) => Some(Logs { stdout, stderr }),
        _ => None,
    };
    let rec = ProcessRecord {
        id: r.get(0)?,
        kind: r.get(1)?,
        state: ProcessState::Starting,
        token: r.get(3)?,
        operation_id: r.get(4)?,
        lease,
        host_id: r.get(7)?,
        identity: None,
        owner: None,
        spawned: r.get(10)?,
        command: None,
        logs,
        exit: Exit {
            code: r.get(14)?,
            signal: r.get(15)?,
        },
        ttl_ms: r.get(16)?,
        expires_at: r.get(17)?,
        created_at: r.get(18)?,
        started_at: r.get(19)?,
        ended_at: r.get(20)?,
        end_reason: r.get(21)?,
        metadata: Default::default(),
    };
    Ok((rec, r.get(2)?, r.get(8)?, r.get(9)?, r.get(11)?, r.get(22)?))
}

fn finish((mut rec, state, identity, owner, command, metadata): Raw) -> Result<ProcessRecord> {
    rec.state = ProcessState::parse(&state).ok_or_else(|| bad("process state", &state))?;
    rec.identity = json("identity", identity)?;
    rec.owner = json("owner", owner)?;
    rec.command = json("command", command)?;
    rec.metadata = serde_json::from_str(&metadata).map_err(|e| bad("metadata", e))?;
    Ok(rec)
}

fn processes(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<ProcessRecord>> {
    let mut stmt = conn.prepare_cached(sql).map_err(map_err)?;
    let rows = stmt.query_map(params, raw).map_err(map_err)?;
    rows.map(|r| r.map_err(map_err).and_then(finish)).collect()
}

pub fn process(conn: &Connection, id: &str) -> Result<Option<ProcessRecord>> {
    Ok(processes(
        conn,
        &format!("SELECT {PROCESS_COLS} FROM processes WHERE id = ?1"),
        [id],
    )?
    .pop())
}

pub fn process_by_operation(conn: &Connection, op: &str) -> Result<Option<ProcessRecord>> {
    let sql = format!(
        "SELECT {PROCESS_COLS} FROM processes WHERE operation_id = ?1 AND {PROCESS_CURRENT}"
    );
    Ok(processes(conn, &sql, [op])?.pop())
}

pub fn insert_process(conn: &Connection, p: &ProcessRecord) -> Result<()> {
    let sql = format!(
        "INSERT INTO processes ({PROCESS_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, \
         ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23)"
    );
    conn.prepare_cached(&sql)
        .and_then(|mut s| {
            s.execute(params![
                p.id,
                p.kind,
                p.state.as_str(),
                p.token,
                p.operation_id,
                p.lease.as_ref().map(|l| l.id.as_str()),
                p.lease.as_ref().map(|l| l.token),
                p.host_id,
                p.identity
                    .as_ref()
                    .map(to_json)
                    .transpose()
                    .map_err(to_sql)?,
                p.owner.as_ref().map(to_json).transpose().map_err(to_sql)?,
                p.spawned,
                p.command
                    .as_ref()
                    .map(to_json)
                    .transpose()
                    .map_err(to_sql)?,
                p.logs.as_ref().map(|l| l.stdout.as_str()),
                p.logs.as_ref().map(|l| l.stderr.as_str()),
                p.exit.code,
                p.exit.signal,
                p.ttl_ms,
                p.expires_at,
                p.created_at,
                p.started_at,
                p.ended_at,
                p.end_reason,
                to_json(&p.metadata).map_err(to_sql)?,
            ])
        })
        .map_err(map_err)?;
    Ok(())
}

fn to_sql(e: StoreError) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(Box::new(std::io::Error::other(e.to_string())))
}

pub fn update_process(conn: &Connection, p: &ProcessRecord) -> Result<()> {
    let n = conn
        .prepare_cached(
            "UPDATE processes SET state = ?1, token = ?2, identity = ?3, owner = ?4, exit_code = ?5, \
             exit_signal = ?6, ttl_ms = ?7, expires_at = ?8, started_at = ?9, ended_at = ?10, \
             end_reason = ?11 WHERE id = ?12",
        )
        .and_then(|mut s| {
            s.execute(params![
                p.state.as_str(),
                p.token,
                p.identity.as_ref().map(to_json).transpose().map_err(to_sql)?,
                p.owner.as_ref().map(to_json).transpose().map_err(to_sql)?,
                p.exit.code,
                p.exit.signal,
                p.ttl_ms,
                p.expires_at,
                p.started_at,
                p.ended_at,
                p.end_reason,
                p.id,
            ])
        })
        .map_err(map_err)?;
    if n != 1 {
        return Err(StoreError::Other(format!(
            "process {} vanished during update",
            p.id
        )));
    }
    Ok(())
}

pub fn list_processes(conn: &Connection, f: &ProcessFilter) -> Result<Vec<ProcessRecord>> {
    let (sql, args) = sql::list_processes('?', f);
    processes(conn, &sql, rusqlite::params_from_iter(args))
}

pub fn current_processes(conn: &Connection, host_id: &str) -> Result<Vec<ProcessRecord>> {
    let sql = format!(
        "SELECT {PROCESS_COLS} FROM processes WHERE host_id = ?1 AND {PROCESS_CURRENT} ORDER BY id"
    );
    processes(conn, &sql, [host_id])
}

pub fn count_current_processes(conn: &Connection) -> Result<i64> {
    let sql = format!("SELECT count(*) FROM processes WHERE {PROCESS_CURRENT}");
    conn.query_row(&sql, [], |r| r.get(0)).map_err(map_err)
}

fn port_row(r: &Row<'_>) -> rusqlite::Result<PortRecord> {
    let kind: String = r.get(4)?;
    let target = TokenRef {
        id: r.get(5)?,
        token: r.get(6)?,
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
    Ok(PortRecord {
        id: r.get(0)?,
        host_id: r.get(1)?,
        port: r.get(2)?,
        name: r.get(3)?,
        owner,
        reserved_at: r.get(7)?,
        released_at: r.get(8)?,
    })
}

fn ports(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<Vec<PortRecord>> {
    let mut stmt = conn.prepare_cached(sql).map_err(map_err)?;
    let rows = stmt.query_map(params, port_row).map_err(map_err)?;
    rows.map(|r| r.map_err(map_err)).collect()
}

pub fn held_ports(conn: &Connection, host_id: &str) -> Result<Vec<u16>> {
    let mut stmt = conn
        .prepare_cached("SELECT port FROM ports WHERE host_id = ?1 AND released_at IS NULL")
        .map_err(map_err)?;
    let rows = stmt.query_map([host_id], |r| r.get(0)).map_err(map_err)?;
    rows.map(|r| r.map_err(map_err)).collect()
}

pub fn current_port(conn: &Connection, host_id: &str, port: u16) -> Result<Option<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE host_id = ?1 AND port = ?2 AND released_at IS NULL"
    );
    Ok(ports(conn, &sql, params![host_id, port])?.pop())
}

pub fn insert_port(conn: &Connection, p: &PortRecord) -> Result<()> {
    let target = p
        .owner
        .target()
        .ok_or_else(|| StoreError::Other("a port without an owner".into()))?;
    let sql =
        format!("INSERT INTO ports ({PORT_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)");
    conn.prepare_cached(&sql)
        .and_then(|mut s| {
            s.execute(params![
                p.id,
                p.host_id,
                p.port,
                p.name,
                p.owner.kind(),
                target.id,
                target.token,
                p.reserved_at,
                p.released_at
            ])
        })
        .map_err(map_err)?;
    Ok(())
}

pub fn ports_of(conn: &Connection, owner_id: &str) -> Result<Vec<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE owner_id = ?1 AND released_at IS NULL ORDER BY name"
    );
    ports(conn, &sql, [owner_id])
}

pub fn ports_of_owners(conn: &Connection, owner_ids: &[String]) -> Result<Vec<PortRecord>> {
    if owner_ids.is_empty() {
        return Ok(Vec::new());
    }
    // One statement per page size: prepare_cached keeps each.
    let marks = vec!["?"; owner_ids.len()].join(",");
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE owner_id IN ({marks}) AND released_at IS NULL \
         ORDER BY owner_id, name"
    );
    ports(conn, &sql, rusqlite::params_from_iter(owner_ids))
}

pub fn release_port(conn: &Connection, id: &str, at: Millis) -> Result<()> {
    conn.prepare_cached("UPDATE ports SET released_at = ?1 WHERE id = ?2 AND released_at IS NULL")
        .and_then(|mut s| s.execute(params![at, id]))
        .map_err(map_err)?;
    Ok(())
}

pub fn list_ports(
    conn: &Connection,
    host_id: Option<&str>,
    after_port: u16,
    limit: u32,
) -> Result<Vec<PortRecord>> {
    let sql = format!(
        "SELECT {PORT_COLS} FROM ports WHERE released_at IS NULL AND (?1 IS NULL OR host_id = ?1) \
         AND port > ?2 ORDER BY port, host_id LIMIT ?3"
    );
    ports(conn, &sql, params![host_id, after_port, limit])
}
