//! Retention of ended records: leases, processes and port reservations that
//! ended before a cutoff are deleted, a bounded number per pass, so that the
//! store does not grow with every lease ever taken. Token counters
//! (`resources`) are never deleted: tokens keep increasing whatever is pruned.
//!
//! Ids are UUIDv7, whose text sorts by creation time, and a record ends after
//! it is created: `id < cutoff` lets each delete walk the primary key from
//! its oldest end instead of scanning the table.

use crate::store::Result;
use crate::store::db::{Cols, Exec, Stmt};
use crate::time::Millis;

/// The text that every UUIDv7 id created before `at` sorts below.
pub fn id_cutoff(at: Millis) -> String {
    let ms = u64::try_from(at).unwrap_or(0);
    format!("{:08x}-{:04x}", ms >> 16, ms & 0xffff)
}

/// Delete up to `limit` each of the leases, the processes of `host_id` and
/// the port reservations that ended before `before`. A lease that a current
/// process is bound to stays. The log files of the processes deleted, for
/// the caller to remove once this has committed (they are on `host_id`).
pub async fn prune_records<E: Exec + ?Sized>(
    c: &mut E,
    before: Millis,
    host_id: &str,
    limit: u32,
) -> Result<Vec<String>> {
    let (cutoff, limit) = (id_cutoff(before), i64::from(limit));
    let leases = Stmt::new(
        "DELETE FROM leases WHERE id IN (SELECT l.id FROM leases l \
         WHERE l.id < $1 AND l.ended_at < $2 AND NOT EXISTS (SELECT 1 FROM processes p \
         WHERE p.lease_id = l.id AND p.ended_at IS NULL) ORDER BY l.id LIMIT $3)",
    );
    c.execute(leases.text(&cutoff).int(before).int(limit))
        .await?;
    let ports = Stmt::new(
        "DELETE FROM ports WHERE id IN (SELECT id FROM ports \
         WHERE id < $1 AND released_at < $2 ORDER BY id LIMIT $3)",
    );
    c.execute(ports.text(&cutoff).int(before).int(limit))
        .await?;
    let processes = Stmt::new(
        "DELETE FROM processes WHERE id IN (SELECT id FROM processes \
         WHERE id < $1 AND ended_at < $2 AND host_id = $3 ORDER BY id LIMIT $4) \
         RETURNING stdout_path, stderr_path",
    );
    let rows = c
        .fetch(processes.text(&cutoff).int(before).text(host_id).int(limit))
        .await?;
    let mut logs = Vec::new();
    for r in &rows {
        logs.extend(r.opt_text(0)?);
        logs.extend(r.opt_text(1)?);
    }
    Ok(logs)
}

#[cfg(test)]
mod tests {
    use super::id_cutoff;

    #[test]
    fn ids_created_before_the_cutoff_sort_below_it_and_later_ones_above() {
        let at = 1_700_000_000_000;
        let id_at = |ms: i64| {
            let ts = uuid::Timestamp::from_unix(
                uuid::NoContext,
                (ms / 1000) as u64,
                ((ms % 1000) * 1_000_000) as u32,
            );
            uuid::Uuid::new_v7(ts).to_string()
        };
        assert!(id_at(at - 1) < id_cutoff(at));
        assert!(id_at(at) > id_cutoff(at));
        assert!(id_at(at + 86_400_000) > id_cutoff(at));
        assert!(id_at(0) < id_cutoff(at));
    }
}
