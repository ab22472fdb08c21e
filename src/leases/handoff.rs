//! Hand-off: a release while acquirers wait grants the lease to the first
//! of them in the release's own transaction, so that a hand-off costs one
//! durable commit instead of two (the release, then the woken waiter's own
//! acquire).
//!
//! A waiter parked in its resource's queue leaves an offer: its request and
//! where to answer. The releasing transaction takes the offer of the queue's
//! head, and only the head's (first come, first served), and acquires for
//! it; once that commit is done the releaser hands the lease over. A waiter
//! that is about to act on its own again (woken, or its wait ran out) first
//! withdraws its offer. If a releaser took it already, the waiter awaits
//! that outcome: the lease, or nothing when the releasing transaction was
//! undone or the acquire was refused, and then it tries itself as before.
//! So a waiter is never both offered and trying, and a lease granted to it
//! is never granted to another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::{Acquire, Acquired, ops};
use crate::idempotency::Claim;
use crate::store::{Result, Tx};
use crate::tx::Ctx;
use crate::waiters::Waiters;

struct Offer {
    cmd: Acquire,
    reply: oneshot::Sender<Acquired>,
    /// The waiter's Idempotency-Key: recorded in the transaction that
    /// grants it the lease, as in its own.
    claim: Option<Arc<Claim>>,
}

/// The standing offers of parked waiters, by ticket.
#[derive(Default)]
pub(super) struct Offers(Mutex<HashMap<u64, Offer>>);

/// A lease acquired for a waiter, to hand over once its transaction commits.
pub(super) struct Handed {
    reply: oneshot::Sender<Acquired>,
    pub acquired: Acquired,
    /// The waiter's key, whose answer the transaction kept.
    answered: Option<Arc<Claim>>,
}

impl Handed {
    /// Give the waiter its lease. The commit is done: a waiter gone by
    /// now leaves the lease to end by its TTL or owner, as any acquire
    /// whose client went away does.
    pub fn deliver(self) {
        if let Some(claim) = self.answered {
            claim.mark_answered();
        }
        let _ = self.reply.send(self.acquired);
    }
}

impl Offers {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Offer>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Offer `cmd` on behalf of the waiter holding `ticket`, until the
    /// returned `Parked` is withdrawn or dropped.
    pub fn park(self: &Arc<Self>, ticket: u64, cmd: Acquire, claim: Option<Arc<Claim>>) -> Parked {
        let (reply, rx) = oneshot::channel();
        self.lock().insert(ticket, Offer { cmd, reply, claim });
        Parked {
            offers: self.clone(),
            ticket,
            rx,
        }
    }

    /// In the transaction that ended the current lease on `resource`:
    /// acquire it for the head of its queue, if that waiter stands parked.
    pub async fn grant_head(
        &self,
        tx: &mut dyn Tx,
        cx: Ctx<'_>,
        waiters: &Waiters,
        resource: &str,
    ) -> Result<Option<Handed>> {
        let Some(head) = waiters.head(resource) else {
            return Ok(None);
        };
        // An older waiter on another host goes first: the lease just ends,
        // and that host's waiter takes it in a transaction of its own.
        if !waiters.remote_ahead(resource, true).is_empty() {
            return Ok(None);
        }
        let Some(offer) = self.lock().remove(&head) else {
            return Ok(None);
        };
        // Its key held by another request: the waiter meets that itself.
        if let Some(claim) = &offer.claim
            && !crate::store::record_claim(claim, tx).await?
        {
            return Ok(None);
        }
        // A refusal (its parent fenced, say) drops the reply: the waiter
        // then tries in a transaction of its own and meets it there.
        let Ok(acquired) = ops::acquire(tx, cx, offer.cmd).await? else {
            return Ok(None);
        };
        let mut answered = None;
        if let Some(claim) = &offer.claim {
            crate::store::claim_created(claim, tx).await?;
            // The waiter's answer, kept with its lease.
            let out: super::Outcome<Acquired> = Ok(acquired.clone());
            if crate::store::answer_claim(claim, &out, tx).await? {
                answered = Some(claim.clone());
            }
        }
        Ok(Some(Handed {
            reply: offer.reply,
            acquired,
            answered,
        }))
    }
}

/// A waiter's standing offer.
pub(super) struct Parked {
    offers: Arc<Offers>,
    ticket: u64,
    rx: oneshot::Receiver<Acquired>,
}

impl Parked {
    /// The lease a releaser handed over; None when the releaser took the
    /// offer but granted nothing (the waiter is to try itself).
    pub async fn handed(&mut self) -> Option<Acquired> {
        (&mut self.rx).await.ok()
    }

    /// Withdraw the offer before acting alone; if a releaser took it
    /// already, the outcome of that releaser's transaction.
    pub async fn withdraw(mut self) -> Option<Acquired> {
        if self.offers.lock().remove(&self.ticket).is_some() {
            return None;
        }
        self.handed().await
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.offers.lock().remove(&self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::tx::fixture::{Fixture, run};

    fn cmd(holder: &str) -> Acquire {
        Acquire {
            resource: "r".into(),
            holder: holder.into(),
            ttl_ms: Some(10_000),
            owner: None,
            parent: None,
            reserve: false,
            metadata: Default::default(),
        }
    }

    /// The fixture's store, queue and offers, with a lease held on "r".
    async fn setup() -> (Fixture, Arc<Waiters>, Arc<Offers>, String) {
        let fx = Fixture::new().await;
        let held = run!(fx, |tx, cx| ops::acquire(tx, cx, cmd("first")))
            .expect("granted")
            .lease;
        (fx, Arc::default(), Arc::default(), held.id)
    }

    /// Release `id` (token 1) and grant the head's offer in the same transaction.
    async fn release_granting(
        fx: &Fixture,
        waiters: &Arc<Waiters>,
        offers: &Arc<Offers>,
        id: &str,
    ) -> Option<Handed> {
        let (w, o, id) = (waiters.clone(), offers.clone(), id.to_owned());
        run!(fx, |tx, cx| async move {
            ops::release(tx, cx, &id, 1).await?.expect("released");
            o.grant_head(tx, cx, &w, "r").await
        })
    }

    #[tokio::test]
    async fn the_head_is_granted_the_lease_in_the_releasing_transaction() {
        let (fx, waiters, offers, id) = setup().await;
        let mark = fx.mark().await;
        let t = waiters.enqueue("r", waiters.ends_seen());
        let parked = offers.park(t.id(), cmd("second"), None);
        let handed = release_granting(&fx, &waiters, &offers, &id).await;
        let handed = handed.expect("granted to the parked head");
        assert_eq!(handed.acquired.lease.holder, "second");
        assert_eq!(handed.acquired.lease.token, 2);
        assert_eq!(
            fx.types_after(mark).await,
            ["lease.released", "lease.acquired"]
        );
        handed.deliver();
        // Taken: withdrawing yields the lease instead of withdrawing.
        let got = parked.withdraw().await.expect("handed over");
        assert_eq!(got.lease.token, 2);
    }

    #[tokio::test]
    async fn a_withdrawn_offer_is_not_granted() {
        let (fx, waiters, offers, id) = setup().await;
        let t = waiters.enqueue("r", waiters.ends_seen());
        let parked = offers.park(t.id(), cmd("second"), None);
        assert!(parked.withdraw().await.is_none());
        assert!(
            release_granting(&fx, &waiters, &offers, &id)
                .await
                .is_none()
        );
        let current = fx.backend().list_leases(&Default::default()).await;
        let current: Vec<_> = current
            .expect("list")
            .into_iter()
            .filter(|l| l.state.is_current())
            .collect();
        assert!(current.is_empty(), "nobody holds r: {current:?}");
    }

    #[tokio::test]
    async fn only_the_head_of_the_queue_is_granted() {
        let (fx, waiters, offers, id) = setup().await;
        let head = waiters.enqueue("r", waiters.ends_seen());
        let second = waiters.enqueue("r", waiters.ends_seen());
        let _parked = offers.park(second.id(), cmd("second"), None);
        assert!(
            release_granting(&fx, &waiters, &offers, &id)
                .await
                .is_none(),
            "the head makes no offer (it is trying itself): nobody is granted"
        );
        drop(head);
    }

    #[tokio::test]
    async fn a_grant_undone_with_its_transaction_tells_the_waiter_to_try_itself() {
        let (fx, waiters, offers, id) = setup().await;
        let t = waiters.enqueue("r", waiters.ends_seen());
        let mut parked = offers.park(t.id(), cmd("second"), None);
        let handed = release_granting(&fx, &waiters, &offers, &id).await;
        // As when the releasing transaction is rolled back: never delivered.
        drop(handed.expect("granted"));
        assert!(parked.handed().await.is_none());
    }

    #[tokio::test]
    async fn a_release_grants_nothing_while_an_older_waiter_waits_on_another_host() {
        let (fx, waiters, offers, id) = setup().await;
        let t = waiters.enqueue("r", waiters.ends_seen());
        let mut parked = offers.park(t.id(), cmd("second"), None);
        // Unstamped, this host's waiter comes after any announced elsewhere.
        waiters.news(&crate::waiters::remote::WaitNews {
            from: "other-host".into(),
            mine: false,
            at: 1,
            waits: vec![("r".into(), 7, 60_000)],
            left: vec![],
        });
        assert!(
            release_granting(&fx, &waiters, &offers, &id)
                .await
                .is_none()
        );
        // The offer still stands, for a release after the other's turn.
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), parked.handed())
                .await
                .is_err()
        );
    }
}
