//! The event log and its retention.

use crate::model::EventRow;
use crate::store::Result;
use crate::store::db::{Cols, Exec, Stmt, scalar};
use crate::time::Millis;

/// Appends an event under a seq its writer chose: `$1` seq, `$2` at, `$3` body.
pub const INSERT_EVENT: &str = "INSERT INTO events (seq, at, body) VALUES ($1, $2, $3)";

/// `INSERT_EVENT` of one event.
pub fn insert_event(seq: i64, at: Millis, body: &str) -> Stmt<'_> {
    Stmt::new(INSERT_EVENT).int(seq).int(at).text(body)
}

pub async fn events<E: Exec + ?Sized>(c: &mut E, after: i64, limit: u32) -> Result<Vec<EventRow>> {
    let s = Stmt::new("SELECT seq, body FROM events WHERE seq > $1 ORDER BY seq LIMIT $2")
        .int(after)
        .int(i64::from(limit));
    c.fetch(s)
        .await?
        .iter()
        .map(|r| {
            Ok(EventRow {
                seq: r.int(0)?,
                payload: r.text(1)?,
            })
        })
        .collect()
}

pub async fn pruned_through<E: Exec + ?Sized>(c: &mut E) -> Result<i64> {
    Ok(super::meta(c, "pruned_through")
        .await?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// Delete events beyond the newest `keep_last` or older than `older_than`;
/// the highest seq pruned so far.
pub async fn prune_events<E: Exec + ?Sized>(
    c: &mut E,
    keep_last: Option<u64>,
    older_than: Option<Millis>,
) -> Result<i64> {
    let before = pruned_through(c).await?;
    let mut through = before;
    if let Some(keep) = keep_last {
        let max = c.last_event_seq().await?;
        through = through.max(max - i64::try_from(keep).unwrap_or(i64::MAX));
    }
    if let Some(at) = older_than {
        let s = Stmt::new("SELECT max(seq) FROM events WHERE at < $1").int(at);
        through = through.max(scalar(c, s).await?.unwrap_or(0));
    }
    if through > before {
        c.execute(Stmt::new("DELETE FROM events WHERE seq <= $1").int(through))
            .await?;
        super::set_meta(c, "pruned_through", &through.to_string()).await?;
    }
    Ok(through)
}
