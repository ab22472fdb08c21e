use super::{LocalFacts, ObserveError};
use crate::model::{Identity, Judgement, LivenessReason as R};

/// Decide whether `recorded` is the same process as what `observe` reads now.
/// Host, namespace and boot are compared first so that a remote or pre-reboot
/// identity is never looked up in this host's /proc.
pub fn judge(
    local: &LocalFacts,
    recorded: &Identity,
    observe: impl FnOnce() -> Result<Identity, ObserveError>,
) -> Judgement {
    if recorded.host_id != local.host_id {
        return Judgement::remote(R::OtherHost);
    }
    if recorded.pid_ns != local.pid_ns {
        return Judgement::remote(R::OtherPidNamespace);
    }
    if recorded.boot_id != local.boot_id {
        return Judgement::dead(R::Rebooted);
    }
    match observe() {
        Ok(now) if recorded.same_process(&now) => Judgement::LIVE,
        Ok(_) => Judgement::dead(R::PidReused),
        Err(ObserveError::NotFound(_)) => Judgement::dead(R::PidAbsent),
        Err(ObserveError::PermissionDenied(_)) => Judgement::unknown(R::PermissionDenied),
        Err(ObserveError::Unreadable { .. }) => Judgement::unknown(R::ProcUnreadable),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Liveness;

    fn local() -> LocalFacts {
        LocalFacts {
            host_id: "host-a".into(),
            boot_id: "boot-1".into(),
            pid_ns: "4026531836".into(),
            hostname: "vm".into(),
        }
    }

    fn ident(pid: i32, start: &str, inode: Option<&str>) -> Identity {
        Identity {
            pid,
            start_time: start.into(),
            pidfd_inode: inode.map(Into::into),
            boot_id: "boot-1".into(),
            host_id: "host-a".into(),
            pid_ns: "4026531836".into(),
            hostname: "vm".into(),
            executable: Some("/bin/sleep".into()),
            uid: Some(1000),
            pgid: Some(pid),
            sid: Some(pid),
            kernel_thread: false,
        }
    }

    fn never() -> Result<Identity, ObserveError> {
        panic!("a remote or rebooted identity must not be looked up locally")
    }

    #[test]
    fn same_process_is_live_even_after_exec_or_setpgid() {
        let rec = ident(42, "100", Some("7"));
        let mut now = rec.clone();
        now.executable = Some("/usr/bin/node".into());
        now.pgid = Some(1);
        now.uid = Some(0);
        assert_eq!(judge(&local(), &rec, || Ok(now)), Judgement::LIVE);
    }

    #[test]
    fn pidfd_inode_decides_when_both_have_one() {
        let rec = ident(42, "100", Some("7"));
        let now = ident(42, "100", Some("8"));
        assert_eq!(
            judge(&local(), &rec, || Ok(now)),
            Judgement::dead(R::PidReused)
        );
    }

    #[test]
    fn start_time_decides_without_pidfd_inode() {
        let rec = ident(42, "100", None);
        assert_eq!(
            judge(&local(), &rec, || Ok(ident(42, "100", Some("9")))),
            Judgement::LIVE
        );
        assert_eq!(
            judge(&local(), &rec, || Ok(ident(42, "101", Some("9")))),
            Judgement::dead(R::PidReused)
        );
    }

    #[test]
    fn absent_pid_is_dead() {
        let rec = ident(42, "100", None);
        let j = judge(&local(), &rec, || Err(ObserveError::NotFound(42)));
        assert_eq!(j, Judgement::dead(R::PidAbsent));
    }

    #[test]
    fn other_boot_is_dead_rebooted_without_lookup() {
        let mut rec = ident(42, "100", None);
        rec.boot_id = "boot-0".into();
        assert_eq!(judge(&local(), &rec, never), Judgement::dead(R::Rebooted));
    }

    #[test]
    fn other_host_or_namespace_is_remote() {
        let mut rec = ident(42, "100", None);
        rec.host_id = "host-b".into();
        assert_eq!(judge(&local(), &rec, never).status, Liveness::Remote);
        let mut rec = ident(42, "100", None);
        rec.pid_ns = "1".into();
        assert_eq!(judge(&local(), &rec, never).status, Liveness::Remote);
    }

    #[test]
    fn unreadable_is_unknown() {
        let rec = ident(42, "100", None);
        let j = judge(&local(), &rec, || Err(ObserveError::PermissionDenied(42)));
        assert_eq!(j, Judgement::unknown(R::PermissionDenied));
        let j = judge(&local(), &rec, || {
            Err(ObserveError::Unreadable {
                pid: 42,
                source: std::io::Error::other("eio"),
            })
        });
        assert_eq!(j, Judgement::unknown(R::ProcUnreadable));
    }
}
