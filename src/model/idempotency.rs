//! A request made with an `Idempotency-Key`, as stored.

use crate::time::Millis;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotentRequest {
    /// Method, path and body of the request that first used the key.
    pub request: String,
    /// Tells that request from a later one with the same key.
    pub request_id: String,
    /// Its answer, once it was given: status, content type, body.
    pub status: Option<u16>,
    pub content_type: Option<String>,
    pub body: Option<String>,
    pub created_at: Millis,
    /// The server run answering it while a retry may take its key over
    /// once that run has ended (see `crate::idempotency`).
    pub run_id: Option<String>,
}

impl IdempotentRequest {
    /// Whether the key is still kept at `now`: recorded within
    /// `idempotency::KEEP_MS` (an older record is replaced by a new claim).
    pub fn kept_at(&self, now: Millis) -> bool {
        self.created_at >= now - crate::idempotency::KEEP_MS
    }
}

/// What a request records under its key in each of its transactions.
#[derive(Debug, Clone, Copy)]
pub struct KeyClaim<'a> {
    pub key: &'a str,
    /// Method, path and body.
    pub request: &'a str,
    pub request_id: &'a str,
    /// The server run answering it.
    pub run_id: &'a str,
    /// The request, still in progress in a run that has ended, whose key
    /// this one may take over (see `crate::idempotency`).
    pub supersedes: Option<&'a str>,
    pub at: Millis,
    /// A record made before this is replaced.
    pub stale: Millis,
}
