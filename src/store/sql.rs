//! SQL text both stores share: column lists, what "current" means, filters.
//! Columns are macros so that statements are `concat!`ed at compile time.

use super::db::Stmt;
use crate::model::{LeaseFilter, ProcessFilter, StateFilter};

macro_rules! lease_cols {
    () => {
        "id, resource, token, holder, state, owner, parent_id, parent_resource, parent_token, \
         ttl_ms, expires_at, acquired_at, renewed_at, ended_at, end_reason, metadata"
    };
}
macro_rules! lease_current {
    () => {
        "state IN ('reserved', 'active')"
    };
}
macro_rules! process_cols {
    () => {
        "id, kind, state, token, operation_id, lease_id, lease_token, host_id, identity, owner, \
         spawned, command, stdout_path, stderr_path, exit_code, exit_signal, ttl_ms, expires_at, \
         created_at, started_at, ended_at, end_reason, metadata"
    };
}
macro_rules! process_current {
    () => {
        "state IN ('starting', 'running', 'stopping', 'orphaned')"
    };
}
macro_rules! port_cols {
    () => {
        "id, host_id, port, name, owner_kind, owner_id, owner_token, reserved_at, released_at"
    };
}
pub(crate) use {lease_cols, lease_current, port_cols, process_cols, process_current};

/// `SELECT cols FROM table WHERE <state filter>`, to which filters are appended.
fn select_by_state(cols: &str, table: &str, current: &str, state: StateFilter) -> String {
    match state {
        StateFilter::Current => format!("SELECT {cols} FROM {table} WHERE {current}"),
        StateFilter::Ended => format!("SELECT {cols} FROM {table} WHERE NOT {current}"),
        StateFilter::All => format!("SELECT {cols} FROM {table} WHERE 1 = 1"),
    }
}

/// Append ` AND <clause>` for each filter that has a value, `?N` in a clause
/// standing for that value's parameter. Returns the values, in order.
fn push_filters<'a>(sql: &mut String, filters: &[(Option<&'a str>, &str)]) -> Vec<&'a str> {
    let mut args = Vec::new();
    for (value, clause) in filters {
        if let Some(v) = *value {
            args.push(v);
            sql.push_str(" AND ");
            sql.push_str(&clause.replace("?N", &format!("${}", args.len())));
        }
    }
    args
}

/// A page of SQL with its text values, `$1` first.
pub struct Page<'a> {
    pub sql: String,
    pub args: Vec<&'a str>,
}

impl Page<'_> {
    pub fn stmt(&self) -> Stmt<'_> {
        self.args
            .iter()
            .fold(Stmt::new(&self.sql), |s, a| s.text(a))
    }
}

/// A page of `list_leases`.
pub fn list_leases(f: &LeaseFilter) -> Page<'_> {
    let mut sql = select_by_state(lease_cols!(), "leases", lease_current!(), f.state);
    let args = push_filters(
        &mut sql,
        &[
            (f.resource.as_deref(), "resource = ?N"),
            // substr, not LIKE: the prefix matches literally, `%` and `_` included.
            (f.prefix.as_deref(), "substr(resource, 1, length(?N)) = ?N"),
            (f.holder.as_deref(), "holder = ?N"),
            (f.parent.as_deref(), "parent_id = ?N"),
            (f.before_id.as_deref(), "id < ?N"),
        ],
    );
    sql.push_str(&format!(" ORDER BY id DESC LIMIT {}", f.limit));
    Page { sql, args }
}

/// A page of `list_processes`, as `list_leases`.
pub fn list_processes(f: &ProcessFilter) -> Page<'_> {
    let mut sql = select_by_state(process_cols!(), "processes", process_current!(), f.state);
    let args = push_filters(
        &mut sql,
        &[
            (f.kind.as_deref(), "kind = ?N"),
            (f.operation_id.as_deref(), "operation_id = ?N"),
            (f.lease.as_deref(), "lease_id = ?N"),
            (f.before_id.as_deref(), "id < ?N"),
        ],
    );
    sql.push_str(&format!(" ORDER BY id DESC LIMIT {}", f.limit));
    Page { sql, args }
}

/// A page of `list_ports`, as `list_leases`.
pub fn list_ports<'a>(
    host_id: Option<&'a str>,
    before_id: Option<&'a str>,
    limit: u32,
) -> Page<'a> {
    let mut sql = format!(
        "SELECT {} FROM ports WHERE released_at IS NULL",
        port_cols!()
    );
    let args = push_filters(
        &mut sql,
        &[(host_id, "host_id = ?N"), (before_id, "id < ?N")],
    );
    sql.push_str(&format!(" ORDER BY id DESC LIMIT {limit}"));
    Page { sql, args }
}

/// The current reservations of `owner_ids`, by owner then name.
pub fn ports_of_owners(owner_ids: &[String]) -> Page<'_> {
    let marks: Vec<String> = (1..=owner_ids.len()).map(|i| format!("${i}")).collect();
    Page {
        sql: format!(
            "SELECT {} FROM ports WHERE released_at IS NULL AND owner_id IN ({}) \
             ORDER BY owner_id, name",
            port_cols!(),
            marks.join(", ")
        ),
        args: owner_ids.iter().map(String::as_str).collect(),
    }
}

/// For the stores' tests: `defs`, the indexes of leases as their schema
/// writes them, hold none of the columns a renewal sets (see migration 5).
#[cfg(test)]
pub(crate) fn assert_no_index_holds_renewal_columns(defs: &[String]) {
    assert!(defs.len() >= 4, "the indexes of leases: {defs:?}");
    for def in defs {
        for col in ["expires_at", "ttl_ms", "renewed_at"] {
            assert!(!def.contains(col), "{def}");
        }
    }
}

/// For the stores' plan tests: 20,000 released leases (ids `ended-1`..,
/// each on its own resource `r-1`..), as a long-running store keeps them;
/// the same statement on either database.
#[cfg(test)]
pub(crate) const ENDED_LEASES: &str = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL \
     SELECT i + 1 FROM n WHERE i < 20000) \
     INSERT INTO leases (id, resource, token, holder, state, ttl_ms, expires_at, \
     acquired_at, ended_at, end_reason, metadata) \
     SELECT 'ended-' || i, 'r-' || i, 1, 'h', 'released', 1000, 1000, 0, 1, \
     'released', '{}' FROM n";

/// For the stores' plan tests: two current leases among the ended ones,
/// one with an owner and one without.
#[cfg(test)]
pub(crate) const CURRENT_LEASES: &str = "INSERT INTO leases (id, resource, token, holder, \
     state, owner, ttl_ms, expires_at, acquired_at, metadata) VALUES \
     ('current', 'r-0', 1, 'h', 'active', NULL, 1000, 5000, 0, '{}'), \
     ('owned', 'o-0', 1, 'h', 'active', '{}', NULL, NULL, 0, '{}')";
