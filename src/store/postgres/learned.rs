//! What the writer's cache learns between its batches from outside its
//! own transactions: leases renewed by `renewals`, and what other hosts'
//! commits left on the resources they touched (`Hint`, carried by
//! `notify`). Either is only a hint: the cache answers from it through
//! checks at commit (`cache::Check`), so a hint out of date costs a batch
//! its second run, never a wrong answer. Without them a host that shares resources with
//! another keeps failing its checks, and reads every row afresh.

use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::model::LeaseRecord;
use crate::store::cache::Cache;

/// What a commit left on a resource whose current lease it read or wrote:
/// resource, last token, whether it is free. Another host's writer takes
/// it as a hint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hint(pub String, pub i64, pub bool);

/// Past this many of either not yet taught, the older are forgotten: the
/// cache's checks catch what it does not learn.
const CAP: usize = 4096;

#[derive(Default)]
pub struct Learned {
    /// Leases renewed outside the writer's transactions, with their row
    /// versions.
    renewed: Mutex<Vec<(LeaseRecord, i64)>>,
    /// What other hosts' commits left on resources.
    heard: Mutex<Vec<Hint>>,
}

fn push<T>(queue: &Mutex<Vec<T>>, items: impl IntoIterator<Item = T>) {
    let mut q = queue.lock().unwrap_or_else(PoisonError::into_inner);
    q.extend(items);
    if q.len() > CAP {
        let extra = q.len() - CAP;
        q.drain(..extra);
    }
}

fn take<T>(queue: &Mutex<Vec<T>>) -> Vec<T> {
    std::mem::take(&mut *queue.lock().unwrap_or_else(PoisonError::into_inner))
}

impl Learned {
    pub fn renewed(&self, renewed: impl IntoIterator<Item = (LeaseRecord, i64)>) {
        push(&self.renewed, renewed);
    }

    pub fn heard(&self, hints: impl IntoIterator<Item = Hint>) {
        push(&self.heard, hints);
    }

    /// Teach `cache`, between two batches, what was learned since the last.
    pub fn teach(&self, cache: &mut Cache) {
        for (rec, version) in take(&self.renewed) {
            cache.renewed(&rec, version);
        }
        for Hint(resource, last, free) in take(&self.heard) {
            cache.heard(&resource, last, free);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_heard_is_taught_once_and_capped() {
        let l = Learned::default();
        l.heard((0..CAP as i64 + 10).map(|i| Hint(format!("r{i}"), i, true)));
        let mut c = Cache::guarded();
        l.teach(&mut c);
        assert_eq!(c.current_lease("r9"), None, "the oldest forgotten");
        assert_eq!(c.current_lease("r10"), Some(None));
        assert_eq!(c.next_token("r10"), Some(11));
        let mut again = Cache::guarded();
        l.teach(&mut again);
        assert_eq!(again.current_lease("r10"), None, "taught once");
    }
}
