//! The takeover table of the contract, as pure functions of
//! (lease, owner judgement, now).

use crate::model::{Judgement, LeaseRecord, LeaseState, Liveness};
use crate::time::Millis;

/// What the table says about a current lease when someone else wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It stays current and blocks other acquirers (`lease_held`).
    Held,
    /// Owner on another host and no TTL that could expire (`owner_remote`).
    OwnerRemote,
    /// The owner's liveness cannot be established here (`owner_unverifiable`).
    OwnerUnverifiable,
    /// It ends now, in this state, for this reason.
    End { state: LeaseState, reason: String },
}

/// Apply the takeover table to a current lease. `owner` is the judgement of
/// `lease.owner`, None when the lease has no owner.
pub fn verdict(lease: &LeaseRecord, owner: Option<Judgement>, now: Millis) -> Verdict {
    let expired = || Verdict::End {
        state: LeaseState::Expired,
        reason: "ttl_expired".into(),
    };
    match owner {
        None if lease.ttl_passed(now) => expired(),
        None => Verdict::Held,
        Some(j) => match j.status {
            // A live process is never robbed, stale or not.
            Liveness::Live => Verdict::Held,
            Liveness::Dead => Verdict::End {
                state: LeaseState::Reclaimed,
                reason: format!("owner_dead:{}", j.reason.map_or("unknown", |r| r.as_str())),
            },
            Liveness::Remote if lease.expires_at.is_none() => Verdict::OwnerRemote,
            Liveness::Remote if lease.ttl_passed(now) => expired(),
            Liveness::Remote => Verdict::Held,
            Liveness::Unknown => Verdict::OwnerUnverifiable,
        },
    }
}

/// Expiry time for a TTL given at `now`.
pub fn expiry(ttl_ms: Option<i64>, now: Millis) -> Option<Millis> {
    ttl_ms.map(|ttl| now + ttl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LivenessReason as R;

    const NOW: Millis = 1_000_000;

    fn lease(ttl: Option<i64>, expires_at: Option<Millis>) -> LeaseRecord {
        LeaseRecord {
            id: "l1".into(),
            resource: "r".into(),
            token: 1,
            holder: "h".into(),
            state: LeaseState::Active,
            owner: None,
            parent: None,
            ttl_ms: ttl,
            expires_at,
            acquired_at: NOW - 10_000,
            renewed_at: None,
            ended_at: None,
            end_reason: None,
            metadata: Default::default(),
        }
    }
    fn fresh() -> LeaseRecord {
        lease(Some(30_000), Some(NOW + 1))
    }
    fn passed() -> LeaseRecord {
        lease(Some(30_000), Some(NOW))
    }
    fn no_ttl() -> LeaseRecord {
        lease(None, None)
    }
    fn end(state: LeaseState, reason: &str) -> Verdict {
        Verdict::End {
            state,
            reason: reason.into(),
        }
    }

    #[test]
    fn live_owner_is_held_fresh_stale_or_without_ttl() {
        for l in [fresh(), passed(), no_ttl()] {
            assert_eq!(verdict(&l, Some(Judgement::LIVE), NOW), Verdict::Held);
        }
    }

    #[test]
    fn dead_owner_is_reclaimed_at_once_with_its_reason() {
        for (reason, text) in [
            (R::PidAbsent, "owner_dead:pid_absent"),
            (R::PidReused, "owner_dead:pid_reused"),
            (R::Rebooted, "owner_dead:rebooted"),
        ] {
            for l in [fresh(), passed(), no_ttl()] {
                let v = verdict(&l, Some(Judgement::dead(reason)), NOW);
                assert_eq!(v, end(LeaseState::Reclaimed, text));
            }
        }
    }

    #[test]
    fn remote_owner_falls_back_to_ttl() {
        let remote = Some(Judgement::remote(R::OtherHost));
        assert_eq!(
            verdict(&passed(), remote, NOW),
            end(LeaseState::Expired, "ttl_expired")
        );
        assert_eq!(verdict(&fresh(), remote, NOW), Verdict::Held);
        assert_eq!(verdict(&no_ttl(), remote, NOW), Verdict::OwnerRemote);
    }

    #[test]
    fn unknown_owner_is_unverifiable_whatever_the_ttl() {
        for l in [fresh(), passed(), no_ttl()] {
            let v = verdict(&l, Some(Judgement::unknown(R::PermissionDenied)), NOW);
            assert_eq!(v, Verdict::OwnerUnverifiable);
        }
    }

    #[test]
    fn ownerless_lease_expires_exactly_at_expires_at() {
        assert_eq!(
            verdict(&passed(), None, NOW),
            end(LeaseState::Expired, "ttl_expired")
        );
        assert_eq!(verdict(&fresh(), None, NOW), Verdict::Held);
        assert_eq!(
            verdict(&fresh(), None, NOW + 1),
            end(LeaseState::Expired, "ttl_expired")
        );
    }
}
