use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::process::{Pid, PidfdFlags, pidfd_open};

use super::{Host, ObserveError};
use crate::model::Identity;

/// `statfs` magic of pidfs: only there is a pidfd's inode unique per process.
const PIDFS_MAGIC: u64 = 0x5049_4446;

/// What every identity recorded on this host shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFacts {
    pub host_id: String,
    pub boot_id: String,
    pub pid_ns: String,
    pub hostname: String,
}

impl LocalFacts {
    /// Read this host's facts; `host_id` overrides `/etc/machine-id`.
    pub fn read(host_id: Option<String>) -> std::io::Result<Self> {
        let hostname = read_trimmed("/proc/sys/kernel/hostname")?;
        let host_id = match host_id {
            Some(id) => id,
            None => read_trimmed("/etc/machine-id")
                .ok()
                .filter(|id| !id.is_empty())
                .unwrap_or_else(|| hostname.clone()),
        };
        Ok(Self {
            host_id,
            boot_id: read_trimmed("/proc/sys/kernel/random/boot_id")?,
            pid_ns: fs::metadata("/proc/self/ns/pid")?.ino().to_string(),
            hostname,
        })
    }
}

fn read_trimmed(path: &str) -> std::io::Result<String> {
    Ok(fs::read_to_string(path)?.trim().to_owned())
}

/// The real host: identities come from `/proc` and pidfds.
pub struct ProcHost {
    facts: LocalFacts,
    proc_root: PathBuf,
}

impl ProcHost {
    pub fn new(facts: LocalFacts) -> Self {
        Self {
            facts,
            proc_root: PathBuf::from("/proc"),
        }
    }

    fn stat(&self, pid: i32, zombie_ok: bool) -> Result<Stat, ObserveError> {
        let path = self.proc_root.join(pid.to_string()).join("stat");
        let text = fs::read(path).map_err(|e| map_io(pid, e))?;
        let stat = Stat::parse(&text).ok_or_else(|| ObserveError::Unreadable {
            pid,
            source: std::io::Error::new(ErrorKind::InvalidData, "unparsable /proc/<pid>/stat"),
        })?;
        if stat.zombie && !zombie_ok {
            return Err(ObserveError::NotFound(pid));
        }
        Ok(stat)
    }
}

fn map_io(pid: i32, e: std::io::Error) -> ObserveError {
    match e.kind() {
        ErrorKind::NotFound => ObserveError::NotFound(pid),
        ErrorKind::PermissionDenied => ObserveError::PermissionDenied(pid),
        // ESRCH surfaces when the process exits while its files are read.
        _ if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {
            ObserveError::NotFound(pid)
        }
        _ => ObserveError::Unreadable { pid, source: e },
    }
}

/// `flags` bit of a kernel thread (include/linux/sched.h). Its pgid and sid
/// read 0 too, but so do those of any process whose group or session leader
/// is outside our PID namespace, as in a container.
const PF_KTHREAD: u64 = 0x0020_0000;

/// The fields of `/proc/<pid>/stat` that identify a process.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Stat {
    pub zombie: bool,
    pub pgid: i32,
    pub sid: i32,
    pub start_time: String,
    pub kernel_thread: bool,
}

impl Stat {
    /// Fields are counted after the last `)`, since the command name in
    /// field 2 may itself contain spaces, parentheses, newlines and bytes
    /// that are not UTF-8 (it is bytes, as the process or its file named
    /// itself): only what follows it is read as text.
    pub(crate) fn parse(text: &[u8]) -> Option<Self> {
        let after = text.iter().rposition(|b| *b == b')')? + 1;
        let rest = std::str::from_utf8(&text[after..]).ok()?;
        let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
        // fields[0] is field 3 (state); field N is fields[N - 3].
        let state = *fields.first()?;
        Some(Self {
            zombie: matches!(state, "Z" | "X" | "x"),
            pgid: fields.get(2)?.parse().ok()?,
            sid: fields.get(3)?.parse().ok()?,
            start_time: fields.get(19)?.parse::<u64>().ok()?.to_string(),
            kernel_thread: fields.get(6)?.parse::<u64>().ok()? & PF_KTHREAD != 0,
        })
    }
}

/// The inode of a pidfd, when it is on pidfs (Linux 6.9 and later): only
/// there is it unique per process.
pub fn pidfs_inode(fd: &impl std::os::fd::AsFd) -> Option<u64> {
    let on_pidfs = rustix::fs::fstatfs(fd)
        .is_ok_and(|s| u64::try_from(s.f_type).is_ok_and(|t| t == PIDFS_MAGIC));
    if !on_pidfs {
        return None;
    }
    rustix::fs::fstat(fd).ok().map(|st| st.st_ino)
}

/// The pidfs inode of a pidfd for `pid`, or None where there is no pidfs.
fn pidfd_inode(pid: i32) -> Result<Option<String>, ObserveError> {
    let Some(p) = Pid::from_raw(pid) else {
        return Err(ObserveError::NotFound(pid));
    };
    match pidfd_open(p, PidfdFlags::empty()) {
        Ok(fd) => Ok(pidfs_inode(&fd).map(|i| i.to_string())),
        Err(rustix::io::Errno::SRCH) => Err(ObserveError::NotFound(pid)),
        Err(rustix::io::Errno::NOSYS | rustix::io::Errno::INVAL) => Ok(None),
        Err(e) => Err(map_io(pid, e.into())),
    }
}

impl Host for ProcHost {
    fn local(&self) -> &LocalFacts {
        &self.facts
    }

    fn observe(&self, pid: i32) -> Result<Identity, ObserveError> {
        self.read_identity(pid, false)
    }

    fn observe_child(&self, pid: i32) -> Result<Identity, ObserveError> {
        self.read_identity(pid, true)
    }

    fn writers_of(&self, files: &[&Path]) -> Vec<i32> {
        // The kernel shows an open file's path resolved, as canonicalize does.
        let wanted: Vec<PathBuf> = files.iter().filter_map(|f| f.canonicalize().ok()).collect();
        if wanted.is_empty() {
            return Vec::new();
        }
        let Ok(dir) = fs::read_dir(&self.proc_root) else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                let dir = self.proc_root.join(pid.to_string());
                fs::read_dir(dir.join("fd")).is_ok_and(|fds| {
                    fds.flatten().any(|fd| {
                        fs::read_link(fd.path()).is_ok_and(|target| wanted.contains(&target))
                            && opened_for_writing(&dir.join("fdinfo").join(fd.file_name()))
                    })
                })
            })
            .collect()
    }
}

/// Whether the descriptor `/proc/<pid>/fdinfo/<fd>` describes was opened
/// to write (its `flags`, in octal, with an access mode other than O_RDONLY).
fn opened_for_writing(fdinfo: &Path) -> bool {
    fs::read_to_string(fdinfo).is_ok_and(|info| {
        info.lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok())
            .is_some_and(|flags| flags & rustix::fs::OFlags::ACCMODE.bits() != 0)
    })
}

impl ProcHost {
    fn read_identity(&self, pid: i32, zombie_ok: bool) -> Result<Identity, ObserveError> {
        if pid <= 0 {
            return Err(ObserveError::NotFound(pid));
        }
        // Read the start time on both sides of opening the pidfd: if they agree,
        // the pidfd refers to the process whose start time we record.
        for _ in 0..3 {
            let before = self.stat(pid, zombie_ok)?;
            let inode = pidfd_inode(pid)?;
            let after = self.stat(pid, zombie_ok)?;
            if before.start_time != after.start_time {
                continue;
            }
            let dir = self.proc_root.join(pid.to_string());
            let uid = fs::metadata(&dir).map_err(|e| map_io(pid, e))?.uid();
            let executable = fs::read_link(dir.join("exe"))
                .ok()
                .map(|p| p.to_string_lossy().into_owned());
            return Ok(Identity {
                pid,
                start_time: after.start_time,
                pidfd_inode: inode,
                boot_id: self.facts.boot_id.clone(),
                host_id: self.facts.host_id.clone(),
                pid_ns: self.facts.pid_ns.clone(),
                hostname: self.facts.hostname.clone(),
                executable,
                uid: Some(uid),
                pgid: Some(after.pgid),
                sid: Some(after.sid),
                kernel_thread: after.kernel_thread,
            });
        }
        Err(ObserveError::NotFound(pid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Liveness;

    #[test]
    fn stat_parses_after_the_last_paren() {
        let text = "4242 (we ird) (x) S 1 4242 4200 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 8879 1 1";
        let s = Stat::parse(text.as_bytes()).expect("parses");
        assert_eq!(
            s,
            Stat {
                zombie: false,
                pgid: 4242,
                sid: 4200,
                start_time: "8879".into(),
                kernel_thread: false,
            }
        );
    }

    #[test]
    fn kernel_threads_are_told_by_their_flags_not_their_group() {
        let kthread = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0";
        assert!(
            Stat::parse(kthread.as_bytes())
                .expect("parses")
                .kernel_thread
        );
        // In a container the session leader may be outside our PID namespace.
        let contained = "77 (sleep) S 1 77 0 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 9 0 0";
        assert!(
            !Stat::parse(contained.as_bytes())
                .expect("parses")
                .kernel_thread
        );
    }

    #[test]
    fn zombie_state_is_flagged() {
        let text = "7 (z) Z 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0";
        assert!(Stat::parse(text.as_bytes()).expect("parses").zombie);
    }

    #[test]
    fn truncated_stat_is_rejected() {
        assert_eq!(Stat::parse(b"1 (init) S 0 1"), None);
        assert_eq!(Stat::parse(b"garbage"), None);
    }

    #[test]
    fn observes_itself_as_live() {
        let host = ProcHost::new(LocalFacts::read(None).expect("facts"));
        let me = host
            .observe(std::process::id() as i32)
            .expect("observe self");
        assert_eq!(me.pid, std::process::id() as i32);
        assert_eq!(host.judge(&me).status, Liveness::Live);
        assert!(matches!(host.observe(-5), Err(ObserveError::NotFound(_))));
    }

    /// A stat line as the kernel writes it, with `comm` as field 2.
    fn stat_line(comm: &[u8], state: u8, pgid: i32, sid: i32, flags: u64, start: u64) -> Vec<u8> {
        let mut line = b"4242 (".to_vec();
        line.extend_from_slice(comm);
        let mut fields = vec![format!("{}", state as char), "1".into()];
        fields.push(pgid.to_string());
        fields.push(sid.to_string());
        fields.extend(["34817", "-1"].map(String::from));
        fields.push(flags.to_string());
        fields.extend(std::iter::repeat_n("0".to_owned(), 12));
        fields.push(start.to_string());
        fields.extend(std::iter::repeat_n("7".to_owned(), 30));
        line.extend_from_slice(format!(") {}\n", fields.join(" ")).as_bytes());
        line
    }

    /// Command names of every kind the kernel allows (1 to 15 bytes, any
    /// but NUL: spaces, parentheses, newlines, digits, bytes that are not
    /// UTF-8), from a fixed seed, so that a failure is reproduced.
    #[test]
    fn stat_parses_whatever_the_command_name() {
        const TRICKY: &[u8] = b" ()\n)( Z9-\xff\xfe\xc3";
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for case in 0..20_000 {
            let len = 1 + (next() % 15) as usize;
            let comm: Vec<u8> = (0..len)
                .map(|_| match next() % 3 {
                    0 => TRICKY[(next() % TRICKY.len() as u64) as usize],
                    _ => 1 + (next() % 255) as u8,
                })
                .collect();
            let state = b"RSDZXTIx"[(next() % 8) as usize];
            let (pgid, sid) = ((next() % 4_194_304) as i32, (next() % 4_194_304) as i32);
            let flags = next() & 0x00ff_ffff;
            let start = next() >> 8;
            let line = stat_line(&comm, state, pgid, sid, flags, start);
            let got = Stat::parse(&line).unwrap_or_else(|| panic!("case {case}: {line:?}"));
            let want = Stat {
                zombie: matches!(state, b'Z' | b'X' | b'x'),
                pgid,
                sid,
                start_time: start.to_string(),
                kernel_thread: flags & PF_KTHREAD != 0,
            };
            assert_eq!(got, want, "case {case}: {line:?}");
        }
    }

    /// A live process whose name holds `) Z 1 1 1 (` and a byte that is
    /// not UTF-8 is read as it is: live, in its own group.
    #[test]
    fn a_process_with_a_hostile_name_is_observed() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let name = std::ffi::OsStr::from_bytes(b") Z 1 1 1 (\xff\n");
        let program = dir.path().join(name);
        std::fs::copy("/bin/sleep", &program).expect("copy sleep");
        let mut child = std::process::Command::new(&program)
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn");
        let pid = i32::try_from(child.id()).expect("pid");
        let host = ProcHost::new(LocalFacts::read(None).expect("facts"));
        let seen = host.observe(pid);
        let alive = crate::host::signal::group_alive(pid);
        let judged = seen.as_ref().map(|i| host.judge(i).status).ok();
        let _ = child.kill();
        let _ = child.wait();
        let seen = seen.expect("observed");
        assert_eq!((seen.pid, seen.pgid), (pid, Some(pid)));
        assert!(alive, "its group is seen alive");
        assert_eq!(judged, Some(Liveness::Live));
    }
}
