//! A store outage as the log tells it: a line when the store stops
//! answering, one every `REMINDER` while it stays away, with the requests
//! refused meanwhile, and one when a write commits again. A line per failed
//! request buried the start and the end of an outage under thousands of the
//! same line, and nothing said when it was over.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const REMINDER: Duration = Duration::from_secs(30);

struct Down {
    since: Instant,
    told: Instant,
    refused: u64,
}

pub struct Outage {
    /// Whether `down` holds an outage: the check on every commit.
    is_down: AtomicBool,
    down: Mutex<Option<Down>>,
}

/// The store of this process (one per server).
pub static OUTAGE: Outage = Outage::new();

impl Outage {
    const fn new() -> Self {
        Self {
            is_down: AtomicBool::new(false),
            down: Mutex::new(None),
        }
    }

    /// A request met the store unavailable, for `why`, and is answered 503.
    pub fn refused(&self, why: &str) {
        self.met(why, 1);
    }

    /// Work of the server's own (a reconciler pass) met the store unavailable.
    pub fn failed(&self, why: &str) {
        self.met(why, 0);
    }

    fn met(&self, why: &str, refused: u64) {
        let now = Instant::now();
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *down {
            None => {
                *down = Some(Down {
                    since: now,
                    told: now,
                    refused,
                });
                self.is_down.store(true, Ordering::Release);
                tracing::error!(
                    error = why,
                    "store unavailable: what needs it is answered 503 until it is back"
                );
            }
            Some(d) => {
                d.refused += refused;
                if now.duration_since(d.told) >= REMINDER {
                    d.told = now;
                    tracing::error!(
                        error = why,
                        for_s = now.duration_since(d.since).as_secs(),
                        refused = d.refused,
                        "store still unavailable"
                    );
                } else {
                    tracing::debug!(error = why, "store unavailable");
                }
            }
        }
    }

    /// A write committed: an outage, if one was on, is over.
    pub fn answered(&self) {
        if !self.is_down.load(Ordering::Acquire) {
            return;
        }
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = down.take() {
            self.is_down.store(false, Ordering::Release);
            tracing::warn!(
                after_ms = u64::try_from(d.since.elapsed().as_millis()).unwrap_or(u64::MAX),
                refused = d.refused,
                "store available again"
            );
        }
    }

    /// Whether an outage is on (for tests).
    #[cfg(test)]
    fn on(&self) -> Option<u64> {
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        down.as_ref().map(|d| d.refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_counts_its_refusals_and_ends_at_a_commit() {
        let o = Outage::new();
        o.answered();
        assert_eq!(o.on(), None);
        o.failed("down");
        assert_eq!(o.on(), Some(0), "begun by the server's own work");
        o.refused("down");
        o.refused("down");
        assert_eq!(o.on(), Some(2));
        o.answered();
        assert_eq!(o.on(), None);
        assert!(!o.is_down.load(Ordering::Acquire));
    }
}
