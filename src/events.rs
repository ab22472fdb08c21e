//! Event append: every state change writes one, in its own transaction,
//! carrying the whole record as it is after the change.

use serde_json::{Value, json};

use crate::model::{EventType, LeaseView, PortRecord, ProcessView};
use crate::store::{Result, Tx};
use crate::time::{Millis, rfc3339};

/// The record an event is about.
pub enum Subject<'a> {
    Lease(&'a LeaseView),
    Process(&'a ProcessView),
    Port(&'a PortRecord),
}

pub async fn append(
    tx: &mut dyn Tx,
    now: Millis,
    kind: EventType,
    subject: Subject<'_>,
    detail: Value,
) -> Result<i64> {
    let (lease, process, port) = match subject {
        Subject::Lease(l) => (json!(l), Value::Null, Value::Null),
        Subject::Process(p) => (Value::Null, json!(p), Value::Null),
        Subject::Port(p) => (Value::Null, Value::Null, json!(p)),
    };
    let body = json!({
        "at": rfc3339(now), "type": kind.as_str(), "lease": lease,
        "process": process, "port": port, "detail": detail,
    });
    tx.append_event(now, body.to_string()).await
}
