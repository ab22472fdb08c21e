//! Commits made on other hosts reach this host's waiters through
//! LISTEN/NOTIFY: a transaction notifies inside itself (so the message goes
//! out only if it commits), and every host listens and replays the effects.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

use super::learned::{Hint, Learned};
use super::map_err;
use crate::store::{CommitListener, Effect, Result};
use crate::waiters::remote::WaitNews;

pub(super) const CHANNEL: &str = "holdfast";
/// NOTIFY payloads must stay under 8000 bytes.
pub(super) const MAX_PAYLOAD: usize = 7000;

/// A waiter that joined a queue: resource, ticket, milliseconds it may wait.
#[derive(Serialize, Deserialize)]
pub(super) struct Wait(pub String, pub u64, pub u64);

/// A waiter that left a queue: resource, ticket.
#[derive(Serialize, Deserialize)]
pub(super) struct Left(pub String, pub u64);

/// A commit's message, or an announcement of waiters (`announce`), which
/// a holdfast that knows none reads as a commit without effects.
#[derive(Serialize, Deserialize)]
pub(super) struct Message {
    /// The sending server instance, which ignores its own messages.
    from: String,
    /// The newest event seq of the commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seq: Option<i64>,
    /// Resources whose lease ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    ended: Vec<String>,
    /// An announcement's stamp: the database's clock, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    at: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<Wait>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left: Vec<Left>,
    /// What the commit left on the resources it touched (only in the
    /// last message of a commit, and only if they fit).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    hints: Vec<Hint>,
}

impl Message {
    /// An announcement of waiters from `instance`, empty.
    pub fn announcing(instance: &str) -> Self {
        Self {
            from: instance.to_owned(),
            seq: None,
            ended: Vec::new(),
            at: None,
            waits: Vec::new(),
            left: Vec::new(),
            hints: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.waits.is_empty() && self.left.is_empty()
    }

    /// What an announcement tells, as `WaitNews`; None for a commit's.
    fn news(&mut self, me: &str) -> Option<WaitNews> {
        let at = self.at?;
        let mine = self.from == me;
        Some(WaitNews {
            from: self.from.clone(),
            mine,
            at,
            waits: std::mem::take(&mut self.waits)
                .into_iter()
                .map(|Wait(r, t, ms)| (r, t, ms))
                .collect(),
            // This host's own leaving it knows already.
            left: if mine {
                Vec::new()
            } else {
                std::mem::take(&mut self.left)
                    .into_iter()
                    .map(|Left(r, t)| (r, t))
                    .collect()
            },
        })
    }
}

/// A message without its seq, which the commit puts in front (shifted
/// by the same amount as the batch's events): `{"seq":N,` and the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Notice {
    /// The message as JSON, without `seq`.
    pub rest: String,
    /// The batch's newest event, in the batch's count.
    pub seq: Option<i64>,
}

impl Notice {
    /// The payload as the commit's function sends it, with the seqs shifted
    /// by `shift` (`pipeline::FUNCTION` builds the same text in SQL).
    #[cfg(test)]
    pub fn text(&self, shift: i64) -> String {
        match self.seq {
            None => self.rest.clone(),
            Some(s) => format!("{{\"seq\":{},{}", s + shift, &self.rest[1..]),
        }
    }
}

#[derive(Clone)]
pub struct Notifier {
    instance: String,
}

impl Notifier {
    /// This server instance's id, new at every start.
    pub(super) fn instance(&self) -> &str {
        &self.instance
    }
}

impl Notifier {
    pub fn new() -> Self {
        Self {
            instance: uuid::Uuid::now_v7().to_string(),
        }
    }

    /// One message per chunk of ended resources, each under the payload
    /// limit and each with the commit's newest seq, the last with `hints`
    /// if they fit. The seqs of `effects` are the batch's own count
    /// (`pipeline`): the commit's function puts the seq in, shifted to the
    /// database's (`Notice::text`).
    pub(super) fn payloads(&self, effects: &[Effect], hints: Vec<Hint>) -> Vec<Notice> {
        let seq = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Event(s) => Some(*s),
                _ => None,
            })
            .max();
        let mut chunks: Vec<Vec<String>> = vec![Vec::new()];
        let mut size = 0;
        for e in effects {
            let Effect::LeaseEnded(resource) = e else {
                continue;
            };
            // As JSON, where quotes and backslashes take two bytes.
            let len = serde_json::to_string(resource).map_or(resource.len() * 6, |j| j.len());
            if size + len > MAX_PAYLOAD && chunks.last().is_some_and(|c| !c.is_empty()) {
                chunks.push(Vec::new());
                size = 0;
            }
            size += len + 1;
            if let Some(chunk) = chunks.last_mut() {
                chunk.push(resource.clone());
            }
        }
        let chunks: Vec<Vec<String>> = chunks
            .into_iter()
            .filter(|ended| seq.is_some() || !ended.is_empty())
            .collect();
        let last = chunks.len().saturating_sub(1);
        let mut hints = Some(hints);
        chunks
            .into_iter()
            .enumerate()
            .filter_map(|(i, ended)| {
                let from = self.instance.clone();
                let mut msg = Message {
                    ended,
                    ..Message::announcing(&from)
                };
                let plain = serde_json::to_string(&msg).ok()?;
                if i == last {
                    msg.hints = hints.take().unwrap_or_default();
                }
                let rest = match serde_json::to_string(&msg) {
                    Ok(with) if !msg.hints.is_empty() && with.len() <= MAX_PAYLOAD => with,
                    _ => plain,
                };
                Some(Notice { rest, seq })
            })
            .collect()
    }

    /// Listen for other hosts' commits until the pool closes, on a
    /// connection of its own (made with `opts`), so that it never takes one
    /// of the pool's. After every (re)connection, notifications may have been
    /// missed: the listener is told the newest seq and to wake every
    /// waiter, who then re-check. What the commits left (their hints) goes
    /// to `learned`.
    pub fn spawn_listener(
        &self,
        opts: PgConnectOptions,
        pool: PgPool,
        listener: Arc<dyn CommitListener>,
        learned: Arc<Learned>,
    ) {
        let me = self.instance.clone();
        tokio::spawn(async move {
            while !pool.is_closed() {
                if let Err(e) = listen(&opts, &pool, &me, listener.as_ref(), &learned).await {
                    if pool.is_closed() {
                        return;
                    }
                    tracing::warn!(error = %e, "listening for other hosts' changes failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        });
    }
}

async fn resync(pool: &PgPool, listener: &dyn CommitListener) -> Result<()> {
    let mut c = pool
        .acquire()
        .await
        .map_err(|e| crate::store::db::conn_err(pool, e))?;
    let seq = crate::store::db::Exec::last_event_seq(&mut *c).await?;
    listener.committed(&[Effect::Event(seq), Effect::Missed]);
    Ok(())
}

/// How often an idle listening connection is checked: a half-open socket
/// (after a partition) never fails on its own.
const PING_EVERY: Duration = Duration::from_secs(10);

async fn listen(
    opts: &PgConnectOptions,
    pool: &PgPool,
    me: &str,
    listener: &dyn CommitListener,
    learned: &Learned,
) -> Result<()> {
    // As `PgListener::connect` does, with this run's options: a pool of
    // one, which the listener reconnects through.
    let one = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_with(opts.clone())
        .await
        .map_err(map_err)?;
    let mut l = PgListener::connect_with(&one).await.map_err(map_err)?;
    l.ignore_pool_close_event(true);
    l.listen(CHANNEL).await.map_err(map_err)?;
    resync(pool, listener).await?;
    loop {
        let received = match tokio::time::timeout(PING_EVERY, l.try_recv()).await {
            Ok(r) => r.map_err(map_err)?,
            Err(_) => {
                let ping = sqlx::query("SELECT 1").execute(&mut l);
                match tokio::time::timeout(PING_EVERY, ping).await {
                    Ok(Ok(_)) => continue,
                    // Listen afresh, then resync.
                    _ => return Ok(()),
                }
            }
        };
        match received {
            Some(n) => {
                let Ok(mut msg) = serde_json::from_str::<Message>(n.payload()) else {
                    tracing::warn!(payload = n.payload(), "ignoring an unreadable notification");
                    continue;
                };
                if msg.from != me {
                    listener.peer_heard(&msg.from);
                }
                if let Some(news) = msg.news(me) {
                    // Empty: a host saying it is alive, heard just now.
                    if !(news.waits.is_empty() && news.left.is_empty()) {
                        listener.committed(&[Effect::Waiters(news)]);
                    }
                    continue;
                }
                if msg.from == me {
                    continue;
                }
                // Learned before the waiters are woken, who then try on it.
                learned.heard(std::mem::take(&mut msg.hints));
                let mut effects: Vec<Effect> =
                    msg.ended.into_iter().map(Effect::LeaseEnded).collect();
                effects.extend(msg.seq.map(Effect::Event));
                listener.committed(&effects);
            }
            // The connection was lost: listen afresh, then resync.
            None => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lists_of_ended_leases_are_split_under_the_payload_limit() {
        let n = Notifier::new();
        let mut effects: Vec<Effect> = (0..2000)
            .map(|i| Effect::LeaseEnded(format!("resource-{i:05}")))
            .collect();
        effects.push(Effect::Event(41));
        effects.push(Effect::Event(42));
        let payloads = n.payloads(&effects, Vec::new());
        assert!(payloads.len() > 1);
        let mut ended = 0;
        for p in &payloads {
            let p = p.text(1_000_000_000_000);
            assert!(p.len() < 8000, "{} bytes", p.len());
            let m: Message = serde_json::from_str(&p).expect("decodes");
            assert_eq!(m.seq, Some(1_000_000_000_042));
            ended += m.ended.len();
        }
        assert_eq!(ended, 2000);
        assert!(n.payloads(&[], Vec::new()).is_empty());
        // Hints go in the last message only, and only if they fit.
        let hints = vec![Hint("r".into(), 3, true)];
        let p = n.payloads(&effects, hints.clone());
        let m: Message = serde_json::from_str(&p[p.len() - 1].text(0)).expect("decodes");
        assert_eq!(m.hints, hints);
        let m: Message = serde_json::from_str(&p[0].text(0)).expect("decodes");
        assert!(m.hints.is_empty());
        let many: Vec<Hint> = (0..2000).map(|i| Hint(format!("r{i}"), i, true)).collect();
        let p = n.payloads(&[Effect::Event(1)], many);
        assert_eq!(p.len(), 1);
        assert!(p[0].rest.len() <= MAX_PAYLOAD && !p[0].rest.contains("hints"));
    }

    #[test]
    fn announcements_are_news_and_commits_are_not() {
        let text = r#"{"at":77,"from":"b","waits":[["r",1,500]],"left":[["s",2]]}"#;
        let mut m: Message = serde_json::from_str(text).expect("decodes");
        let news = m.news("a").expect("an announcement");
        assert_eq!(
            news,
            WaitNews {
                from: "b".into(),
                mine: false,
                at: 77,
                waits: vec![("r".into(), 1, 500)],
                left: vec![("s".into(), 2)],
            }
        );
        let mut m: Message = serde_json::from_str(text).expect("decodes");
        let own = m.news("b").expect("an announcement");
        assert!(own.mine && own.left.is_empty() && own.waits.len() == 1);
        let mut commit: Message =
            serde_json::from_str(r#"{"seq":4,"from":"b","ended":["r"]}"#).expect("decodes");
        assert!(commit.news("a").is_none());
    }
}
