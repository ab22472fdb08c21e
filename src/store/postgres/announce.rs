//! This host's waiters, announced to the fleet (`waiters::remote`) on the
//! channel of the commits' notifications: a message of its own per batch,
//! `{"at":…,"from":…,"waits":[[resource, ticket, ms left]],"left":[[resource,
//! ticket]]}`, with `at` the database's clock (so that every host orders
//! waiters alike). Announcements that gather while one is sent go in the
//! next; a waiter that joins and leaves within one batch is not announced at
//! all. A batch that only says this host is alive is `{"at":…,"from":…}`.
//! Sending one writes nothing durable: a transaction whose only change is a
//! notification has no transaction id, so its commit waits for no WAL
//! flush.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;

use super::notify::{CHANNEL, Left, MAX_PAYLOAD, Message, Wait};
use crate::waiters::remote::Announce;

enum Note {
    Wait(String, u64, u64),
    Left(String, u64),
    Alive,
}

pub struct Announcer {
    instance: String,
    tx: mpsc::UnboundedSender<Note>,
}

impl Announcer {
    /// Announce on `pool`, as `instance`, until the pool closes.
    pub fn start(pool: PgPool, instance: String) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(pool, instance.clone(), rx));
        Self { instance, tx }
    }
}

impl Announce for Announcer {
    fn instance(&self) -> &str {
        &self.instance
    }

    fn waiting(&self, resource: &str, ticket: u64, left: Duration) {
        let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        let _ = self.tx.send(Note::Wait(resource.to_owned(), ticket, ms));
    }

    fn left(&self, resource: &str, ticket: u64) {
        let _ = self.tx.send(Note::Left(resource.to_owned(), ticket));
    }

    fn alive(&self) {
        let _ = self.tx.send(Note::Alive);
    }
}

async fn run(pool: PgPool, instance: String, mut rx: mpsc::UnboundedReceiver<Note>) {
    while let Some(first) = rx.recv().await {
        let mut notes = vec![first];
        while let Ok(n) = rx.try_recv() {
            notes.push(n);
        }
        if pool.is_closed() {
            return;
        }
        let payloads = payloads(&instance, notes);
        if payloads.is_empty() {
            continue;
        }
        // Lost announcements cost fairness, not safety: the other hosts
        // defer to a waiter they heard of for `DEFER` at most, and one
        // they did not hear of is served when its turn comes here.
        if let Err(e) = send(&pool, &payloads).await {
            tracing::debug!(error = %e, "announcing waiters to the fleet failed");
        }
    }
}

async fn send(pool: &PgPool, payloads: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT pg_notify($1, '{\"at\":' || (extract(epoch FROM clock_timestamp()) * 1000000)::bigint \
         || ',' || substr(p, 2)) FROM unnest($2::text[]) AS p",
    )
    .bind(CHANNEL)
    .bind(payloads)
    .execute(pool)
    .await
    .map(|_| ())
}

/// The messages of one batch, each under the payload limit, without `at`;
/// an empty one when the batch tells nothing but that this host is alive.
fn payloads(instance: &str, notes: Vec<Note>) -> Vec<String> {
    let alive = notes.iter().any(|n| matches!(n, Note::Alive));
    // A waiter that joined and left in this batch: nobody need hear of it.
    let joined: std::collections::HashSet<u64> = notes
        .iter()
        .filter_map(|n| match n {
            Note::Wait(_, t, _) => Some(*t),
            Note::Left(..) | Note::Alive => None,
        })
        .collect();
    let gone: std::collections::HashSet<u64> = notes
        .iter()
        .filter_map(|n| match n {
            Note::Left(_, t) if joined.contains(t) => Some(*t),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    let mut msg = Message::announcing(instance);
    let mut size = 0;
    for n in notes {
        let (ticket, len) = match &n {
            Note::Wait(r, t, _) | Note::Left(r, t) => (*t, r.len() * 6 + 48),
            Note::Alive => continue,
        };
        if gone.contains(&ticket) {
            continue;
        }
        if size + len > MAX_PAYLOAD && !msg.is_empty() {
            out.extend(serde_json::to_string(&msg).ok());
            msg = Message::announcing(instance);
            size = 0;
        }
        size += len;
        match n {
            Note::Wait(r, t, ms) => msg.waits.push(Wait(r, t, ms)),
            Note::Left(r, t) => msg.left.push(Left(r, t)),
            Note::Alive => {}
        }
    }
    // Any message says so; an empty one only when there is no other.
    if !msg.is_empty() || (alive && out.is_empty()) {
        out.extend(serde_json::to_string(&msg).ok());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_that_joined_and_left_in_one_batch_is_not_announced() {
        let notes = vec![
            Note::Wait("a".into(), 1, 500),
            Note::Wait("b".into(), 2, 500),
            Note::Left("a".into(), 1),
            Note::Left("c".into(), 0),
        ];
        let p = payloads("me", notes);
        assert_eq!(
            p,
            vec![r#"{"from":"me","waits":[["b",2,500]],"left":[["c",0]]}"#.to_owned()]
        );
    }

    #[test]
    fn a_batch_that_only_says_alive_is_one_empty_message_and_is_folded_into_others() {
        let p = payloads("me", vec![Note::Alive, Note::Alive]);
        assert_eq!(p, vec![r#"{"from":"me"}"#.to_owned()]);
        let p = payloads("me", vec![Note::Alive, Note::Left("r".into(), 4)]);
        assert_eq!(p, vec![r#"{"from":"me","left":[["r",4]]}"#.to_owned()]);
        assert!(payloads("me", Vec::new()).is_empty());
        // A waiter that joined and left says nothing, but the host is alive.
        let p = payloads(
            "me",
            vec![
                Note::Wait("a".into(), 1, 9),
                Note::Left("a".into(), 1),
                Note::Alive,
            ],
        );
        assert_eq!(p, vec![r#"{"from":"me"}"#.to_owned()]);
    }

    #[test]
    fn long_batches_are_split_under_the_payload_limit() {
        let notes = (0..500)
            .map(|i| Note::Wait(format!("resource/{i:04}"), i, 60_000))
            .collect();
        let p = payloads("me", notes);
        assert!(p.len() > 1);
        let mut n = 0;
        for m in &p {
            assert!(m.len() + 32 < 8000, "{}", m.len());
            let msg: Message = serde_json::from_str(m).expect("json");
            n += msg.waits.len();
        }
        assert_eq!(n, 500);
    }
}
