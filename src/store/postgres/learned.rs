//! What the writer's cache learns between its batches from outside its
//! own transactions: leases renewed by `renewals`, and what other hosts'
//! commits left on the resources they touched (`notify::Hint`). Either is
//! only a hint: the cache answers from it through checks at commit
//! (`cache::Check`), so a hint out of date costs a batch its second run,
//! never a wrong answer. Without them a host that shares resources with
//! another keeps failing its checks, and reads every row afresh.

use std::sync::{Mutex, PoisonError};

use super::notify::Hint;
use crate::model::LeaseRecord;
use crate::store::cache::Cache;

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
