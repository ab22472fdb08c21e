//! Process lifecycle rules as pure functions of (record, what was read, now).

use crate::model::{Judgement, LeaseRecord, Liveness, ProcessRecord, ProcessState};
use crate::time::Millis;

/// Whether a record in `state` is one the reconciler may claim at all.
pub fn may_be_claimed(state: ProcessState) -> bool {
    matches!(
        state,
        ProcessState::Starting | ProcessState::Running | ProcessState::Stopping
    )
}

/// Why the reconciler claims `rec`, if it must: its owning lease ended
/// (`lease` is that lease as read now, None when there is none), or its
/// heartbeat TTL passed while its owner (judged as `owner`) is not live.
/// An owner whose liveness cannot be established here (`unknown`) counts as
/// live, as a lease's does (`owner_unverifiable`): the TTL only proves that
/// observation stopped, and nothing is stopped on a guess.
pub fn claim_reason(
    rec: &ProcessRecord,
    lease: Option<&LeaseRecord>,
    owner: Option<Judgement>,
    now: Millis,
) -> Option<&'static str> {
    if !may_be_claimed(rec.state) {
        return None;
    }
    if let Some(l) = &rec.lease
        && !lease.is_some_and(|x| x.id == l.id && x.state.is_current() && x.token == l.token)
    {
        return Some("lease_ended");
    }
    let ttl_passed = rec.expires_at.is_some_and(|at| now >= at);
    let owner_live = owner.is_some_and(|j| matches!(j.status, Liveness::Live | Liveness::Unknown));
    (ttl_passed && !owner_live).then_some("heartbeat_expired")
}

/// Whether `rec` is kept only because its owner cannot be verified: its
/// TTL passed, its lease (if any) is current, and its owner is `unknown`.
/// An operator should hear of it: nobody may be renewing it.
pub fn kept_unverified(
    rec: &ProcessRecord,
    lease: Option<&LeaseRecord>,
    owner: Option<Judgement>,
    now: Millis,
) -> bool {
    may_be_claimed(rec.state)
        && claim_reason(rec, lease, owner, now).is_none()
        && rec.expires_at.is_some_and(|at| now >= at)
        && owner.is_some_and(|j| j.status == Liveness::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LeaseState, LivenessReason, TokenRef};

    const NOW: Millis = 1_000_000;

    fn process(state: ProcessState) -> ProcessRecord {
        crate::tx::fixture::process_record(state)
    }

    fn lease(state: LeaseState, token: i64) -> LeaseRecord {
        LeaseRecord {
            token,
            ..crate::tx::fixture::lease_record("l", "r", state)
        }
    }

    fn owned(token: i64) -> ProcessRecord {
        let mut p = process(ProcessState::Running);
        p.lease = Some(TokenRef {
            id: "l".into(),
            token,
        });
        p
    }

    fn kept(expires_at: Millis) -> ProcessRecord {
        let mut p = process(ProcessState::Running);
        p.ttl_ms = Some(1000);
        p.expires_at = Some(expires_at);
        p
    }

    #[test]
    fn a_process_goes_with_its_lease() {
        let current = lease(LeaseState::Active, 3);
        assert_eq!(claim_reason(&owned(3), Some(&current), None, NOW), None);
        let cases = [
            (Some(lease(LeaseState::Released, 3)), "ended"),
            (Some(lease(LeaseState::Active, 4)), "a newer token"),
            (None, "gone"),
        ];
        for (l, why) in cases {
            assert_eq!(
                claim_reason(&owned(3), l.as_ref(), None, NOW),
                Some("lease_ended"),
                "{why}"
            );
        }
    }

    #[test]
    fn a_heartbeat_ttl_counts_only_while_its_owner_is_not_live() {
        let live = Some(Judgement::LIVE);
        let unknown = Some(Judgement::unknown(LivenessReason::PermissionDenied));
        let dead = Some(Judgement::dead(LivenessReason::PidAbsent));
        let remote = Some(Judgement::remote(LivenessReason::OtherHost));
        assert_eq!(claim_reason(&kept(NOW + 1), None, None, NOW), None);
        assert_eq!(claim_reason(&kept(NOW), None, live, NOW), None);
        assert_eq!(
            claim_reason(&kept(NOW), None, unknown, NOW),
            None,
            "an owner that cannot be checked counts as alive"
        );
        assert!(kept_unverified(&kept(NOW), None, unknown, NOW));
        assert!(
            !kept_unverified(&kept(NOW + 1), None, unknown, NOW),
            "TTL not passed"
        );
        assert!(!kept_unverified(&kept(NOW), None, live, NOW));
        for owner in [None, dead, remote] {
            assert_eq!(
                claim_reason(&kept(NOW), None, owner, NOW),
                Some("heartbeat_expired")
            );
        }
    }

    #[test]
    fn only_current_unclaimed_records_are_claimed() {
        for state in [
            ProcessState::Orphaned,
            ProcessState::Exited,
            ProcessState::Stopped,
            ProcessState::Failed,
        ] {
            let mut p = kept(0);
            p.state = state;
            assert_eq!(claim_reason(&p, None, None, NOW), None, "{state:?}");
        }
        let mut p = kept(0);
        p.state = ProcessState::Starting;
        assert_eq!(claim_reason(&p, None, None, NOW), Some("heartbeat_expired"));
    }
}
