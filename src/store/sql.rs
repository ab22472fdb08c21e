//! SQL text both stores share: column lists, what "current" means, filters.

use crate::model::{LeaseFilter, ProcessFilter, StateFilter};

pub const LEASE_COLS: &str = "id, resource, token, holder, state, owner, parent_id, parent_resource, \
     parent_token, ttl_ms, expires_at, acquired_at, renewed_at, ended_at, end_reason, metadata";
pub const LEASE_CURRENT: &str = "state IN ('reserved', 'active')";
pub const PROCESS_COLS: &str = "id, kind, state, token, operation_id, lease_id, lease_token, host_id, identity, owner, \
     spawned, command, stdout_path, stderr_path, exit_code, exit_signal, ttl_ms, expires_at, \
     created_at, started_at, ended_at, end_reason, metadata";
pub const PROCESS_CURRENT: &str = "state IN ('starting', 'running', 'stopping', 'orphaned')";
pub const PORT_COLS: &str =
    "id, host_id, port, name, owner_kind, owner_id, owner_token, reserved_at, released_at";

/// `SELECT cols FROM table WHERE <state filter>`, to which filters are appended.
fn select_by_state(cols: &str, table: &str, current: &str, state: StateFilter) -> String {
    match state {
        StateFilter::Current => format!("SELECT {cols} FROM {table} WHERE {current}"),
        StateFilter::Ended => format!("SELECT {cols} FROM {table} WHERE NOT {current}"),
        StateFilter::All => format!("SELECT {cols} FROM {table} WHERE 1 = 1"),
    }
}

/// Append ` AND <clause>` for each filter that has a value; `?N` in a
/// clause names that value's parameter, written as `mark` and its position
/// (`?1` for SQLite, `$1` for PostgreSQL). Returns the values, in order.
fn push_filters<'a>(
    mark: char,
    sql: &mut String,
    filters: &[(&'a Option<String>, &str)],
) -> Vec<&'a str> {
    let mut args = Vec::new();
    for (value, clause) in filters {
        if let Some(v) = value {
            args.push(v.as_str());
            sql.push_str(" AND ");
            sql.push_str(&clause.replace("?N", &format!("{mark}{}", args.len())));
        }
    }
    args
}

/// A page of `list_leases`: the SQL, with parameters written as `mark` and
/// their position, and the parameter values in order.
pub fn list_leases(mark: char, f: &LeaseFilter) -> (String, Vec<&str>) {
    let mut sql = select_by_state(LEASE_COLS, "leases", LEASE_CURRENT, f.state);
    let args = push_filters(
        mark,
        &mut sql,
        &[
            (&f.resource, "resource = ?N"),
            // substr, not LIKE: the prefix matches literally, `%` and `_` included.
            (&f.prefix, "substr(resource, 1, length(?N)) = ?N"),
            (&f.holder, "holder = ?N"),
            (&f.parent, "parent_id = ?N"),
            (&f.before_id, "id < ?N"),
        ],
    );
    sql.push_str(&format!(" ORDER BY id DESC LIMIT {}", f.limit));
    (sql, args)
}

/// A page of `list_processes`, as `list_leases`.
pub fn list_processes(mark: char, f: &ProcessFilter) -> (String, Vec<&str>) {
    let mut sql = select_by_state(PROCESS_COLS, "processes", PROCESS_CURRENT, f.state);
    let args = push_filters(
        mark,
        &mut sql,
        &[
            (&f.kind, "kind = ?N"),
            (&f.operation_id, "operation_id = ?N"),
            (&f.lease, "lease_id = ?N"),
            (&f.before_id, "id < ?N"),
        ],
    );
    sql.push_str(&format!(" ORDER BY id DESC LIMIT {}", f.limit));
    (sql, args)
}
