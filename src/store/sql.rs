//! SQL text both stores share: column lists, what "current" means, filters.

use crate::model::StateFilter;

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
pub fn select_by_state(cols: &str, table: &str, current: &str, state: StateFilter) -> String {
    match state {
        StateFilter::Current => format!("SELECT {cols} FROM {table} WHERE {current}"),
        StateFilter::Ended => format!("SELECT {cols} FROM {table} WHERE NOT {current}"),
        StateFilter::All => format!("SELECT {cols} FROM {table} WHERE 1 = 1"),
    }
}

/// Append ` AND <clause>` for each filter that has a value; `?N` in a
/// clause names that value's parameter, written as `mark` and its position
/// (`?1` for SQLite, `$1` for PostgreSQL). Returns the values, in order.
pub fn push_filters<'a>(
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
