//! Managed processes.

use serde::{Deserialize, Serialize};

use crate::model::{Exit, Identity, Logs, ProcessFilter, ProcessRecord, ProcessState, TokenRef};
use crate::store::Result;
use crate::store::db::{Cols, Exec, Stmt, decode_err, from_json, to_json};
use crate::store::sql::{self, process_cols, process_current};

fn small(what: &str, v: Option<i64>) -> Result<Option<i32>> {
    v.map(i32::try_from)
        .transpose()
        .map_err(|e| decode_err(what, e))
}

/// The `identity` column. A group the process leads but that a stop must
/// not signal (confirmed without `process_group`) is kept under a key of
/// its own, `pgid` itself null: a version before this one, which knows no
/// such key, reads no group to signal, as it wrote it then.
#[derive(Serialize, Deserialize)]
struct StoredIdentity {
    #[serde(flatten)]
    identity: Identity,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unsignalled_group: Option<i32>,
}

fn identity_json(p: &ProcessRecord) -> Result<Option<String>> {
    p.identity
        .as_ref()
        .map(|identity| {
            let mut stored = StoredIdentity {
                identity: identity.clone(),
                unsignalled_group: None,
            };
            if !p.signal_group && identity.pgid == Some(identity.pid) {
                stored.unsignalled_group = stored.identity.pgid.take();
            }
            to_json(&stored)
        })
        .transpose()
}

/// An identity and whether a stop signals its group, as `identity_json` wrote them.
fn identity_of(json: Option<String>) -> Result<(Option<Identity>, bool)> {
    let stored: Option<StoredIdentity> = from_json("identity", json)?;
    Ok(match stored {
        Some(StoredIdentity {
            mut identity,
            unsignalled_group: Some(group),
        }) => {
            identity.pgid = Some(group);
            (Some(identity), false)
        }
        Some(s) => (Some(s.identity), true),
        None => (None, false),
    })
}

fn process_row(r: &impl Cols) -> Result<ProcessRecord> {
    let lease = match (r.opt_text(5)?, r.opt_int(6)?) {
        (Some(id), Some(token)) => Some(TokenRef { id, token }),
        _ => None,
    };
    let logs = match (r.opt_text(12)?, r.opt_text(13)?) {
        (Some(stdout), Some(stderr)) => Some(Logs { stdout, stderr }),
        _ => None,
    };
    let state = r.text(2)?;
    let (identity, signal_group) = identity_of(r.opt_text(8)?)?;
    Ok(ProcessRecord {
        id: r.text(0)?,
        kind: r.text(1)?,
        state: ProcessState::parse(&state).ok_or_else(|| decode_err("process state", &state))?,
        token: r.int(3)?,
        operation_id: r.opt_text(4)?,
        lease,
        host_id: r.text(7)?,
        identity,
        signal_group,
        owner: from_json("owner", r.opt_text(9)?)?,
        spawned: r.flag(10)?,
        command: from_json("command", r.opt_text(11)?)?,
        logs,
        exit: Exit {
            code: small("exit code", r.opt_int(14)?)?,
            signal: small("exit signal", r.opt_int(15)?)?,
        },
        ttl_ms: r.opt_int(16)?,
        expires_at: r.opt_int(17)?,
        created_at: r.int(18)?,
        started_at: r.opt_int(19)?,
        ended_at: r.opt_int(20)?,
        end_reason: r.opt_text(21)?,
        metadata: serde_json::from_str(&r.text(22)?).map_err(|e| decode_err("metadata", e))?,
    })
}

async fn processes<E: Exec + ?Sized>(c: &mut E, s: Stmt<'_>) -> Result<Vec<ProcessRecord>> {
    c.fetch(s).await?.iter().map(process_row).collect()
}

pub async fn process<E: Exec + ?Sized>(c: &mut E, id: &str) -> Result<Option<ProcessRecord>> {
    const SQL: &str = concat!("SELECT ", process_cols!(), " FROM processes WHERE id = $1");
    Ok(processes(c, Stmt::new(SQL).text(id)).await?.pop())
}

pub async fn process_by_operation<E: Exec + ?Sized>(
    c: &mut E,
    op: &str,
) -> Result<Option<ProcessRecord>> {
    const SQL: &str = concat!(
        "SELECT ",
        process_cols!(),
        " FROM processes WHERE operation_id = $1 AND ",
        process_current!()
    );
    Ok(processes(c, Stmt::new(SQL).text(op)).await?.pop())
}

pub async fn insert_process<E: Exec + ?Sized>(c: &mut E, p: &ProcessRecord) -> Result<()> {
    const SQL: &str = concat!(
        "INSERT INTO processes (",
        process_cols!(),
        ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
         $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)"
    );
    let s = Stmt::new(SQL)
        .text(&p.id)
        .text(&p.kind)
        .text(p.state.as_str())
        .int(p.token)
        .opt_text(p.operation_id.as_deref())
        .opt_text(p.lease.as_ref().map(|l| l.id.as_str()))
        .opt_int(p.lease.as_ref().map(|l| l.token))
        .text(&p.host_id)
        .owned(identity_json(p)?)
        .owned(p.owner.as_ref().map(to_json).transpose()?)
        .flag(p.spawned)
        .owned(p.command.as_ref().map(to_json).transpose()?)
        .opt_text(p.logs.as_ref().map(|l| l.stdout.as_str()))
        .opt_text(p.logs.as_ref().map(|l| l.stderr.as_str()))
        .opt_int(p.exit.code.map(i64::from))
        .opt_int(p.exit.signal.map(i64::from))
        .opt_int(p.ttl_ms)
        .opt_int(p.expires_at)
        .int(p.created_at)
        .opt_int(p.started_at)
        .opt_int(p.ended_at)
        .opt_text(p.end_reason.as_deref())
        .owned(Some(to_json(&p.metadata)?));
    c.execute(s).await
}

pub async fn update_process<E: Exec + ?Sized>(c: &mut E, p: &ProcessRecord) -> Result<()> {
    let s = Stmt::new(
        "UPDATE processes SET state = $1, token = $2, identity = $3, owner = $4, exit_code = $5, \
         exit_signal = $6, ttl_ms = $7, expires_at = $8, started_at = $9, ended_at = $10, \
         end_reason = $11 WHERE id = $12",
    )
    .text(p.state.as_str())
    .int(p.token)
    .owned(identity_json(p)?)
    .owned(p.owner.as_ref().map(to_json).transpose()?)
    .opt_int(p.exit.code.map(i64::from))
    .opt_int(p.exit.signal.map(i64::from))
    .opt_int(p.ttl_ms)
    .opt_int(p.expires_at)
    .opt_int(p.started_at)
    .opt_int(p.ended_at)
    .opt_text(p.end_reason.as_deref())
    .text(&p.id);
    c.execute_one(s, format!("process {}", p.id)).await
}

pub async fn list_processes<E: Exec + ?Sized>(
    c: &mut E,
    f: &ProcessFilter,
) -> Result<Vec<ProcessRecord>> {
    let page = sql::list_processes(f);
    processes(c, page.stmt()).await
}

pub async fn current_processes<E: Exec + ?Sized>(
    c: &mut E,
    host_id: &str,
) -> Result<Vec<ProcessRecord>> {
    const SQL: &str = concat!(
        "SELECT ",
        process_cols!(),
        " FROM processes WHERE host_id = $1 AND ",
        process_current!(),
        " ORDER BY id"
    );
    processes(c, Stmt::new(SQL).text(host_id)).await
}

pub async fn count_current_processes<E: Exec + ?Sized>(c: &mut E) -> Result<i64> {
    super::count(
        c,
        concat!("SELECT count(*) FROM processes WHERE ", process_current!()),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(pgid: Option<i32>) -> Identity {
        serde_json::from_value(serde_json::json!({
            "pid": 40, "start_time": "9", "pidfd_inode": null, "boot_id": "b",
            "host_id": "h", "pid_ns": "n", "hostname": "x", "executable": null,
            "uid": 0, "pgid": pgid, "sid": 40
        }))
        .expect("identity")
    }

    #[test]
    fn a_group_not_to_signal_is_hidden_from_versions_that_would_signal_it() {
        let mut rec = crate::tx::fixture::process_record(ProcessState::Running);
        for (pgid, signal_group, stored_pgid) in [
            (Some(40), false, None),
            (Some(40), true, Some(40)),
            (Some(7), false, Some(7)),
        ] {
            rec.identity = Some(identity(pgid));
            rec.signal_group = signal_group;
            let json = identity_json(&rec).expect("encode").expect("some");
            let raw: serde_json::Value = serde_json::from_str(&json).expect("json");
            assert_eq!(raw["pgid"], serde_json::json!(stored_pgid), "{json}");
            let (back, signals) = identity_of(Some(json)).expect("decode");
            assert_eq!(back.and_then(|i| i.pgid), pgid);
            // A group the process does not lead is never signalled, flag or not.
            assert_eq!(signals, signal_group || pgid != Some(40));
        }
        // Written by a version before the flag: its group is signalled
        // where `pgid` says it leads one, and null was its "not signalled".
        let old = serde_json::to_string(&identity(Some(40))).expect("old row");
        assert!(identity_of(Some(old)).expect("decode").1);
        let old = serde_json::to_string(&identity(None)).expect("old row");
        let (ident, _) = identity_of(Some(old)).expect("decode");
        rec.identity = ident;
        rec.signal_group = true;
        assert_eq!(rec.pgid(), None);
    }
}
