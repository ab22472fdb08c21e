//! The server's files on disk: a data directory only it may read, held by
//! one server at a time.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};

/// Create `dir` (and its missing parents) readable by the server's user
/// alone: the database holds the spawned commands' environments, and the
/// logs their output, which the API serves only to callers that pass its
/// token. A directory that exists keeps its mode.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Say so when a directory made before the server made them private (an
/// older version's, one made by hand) lets any local user in.
pub fn warn_if_open(dirs: &[&Path]) {
    use std::os::unix::fs::PermissionsExt;
    for dir in dirs {
        if let Ok(meta) = std::fs::metadata(dir)
            && meta.permissions().mode() & 0o007 != 0
        {
            tracing::warn!(
                dir = %dir.display(),
                mode = format!("{:04o}", meta.permissions().mode() & 0o7777),
                "other local users may read the spawned commands' environments and output here: chmod o-rwx it"
            );
        }
    }
}

/// `path` with its links resolved, as far as it exists: the same file
/// however it is named.
pub fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = std::fs::canonicalize(path) {
        return real;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// Exclusive use of a data directory (its logs, which each server sweeps
/// of files whose record its own store lacks) or of a SQLite file (whose
/// event seqs and tokens a second writer would hand out again): an
/// `flock(2)` on a lock file beside it, held while the server runs and
/// let go by the kernel however the process ends, so a crash leaves
/// nothing to clean up.
#[derive(Debug)]
pub struct Held {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{what} {path} is in use by another holdfast server{by}: stop it first, or give this one its own {flag}"
    )]
    InUse {
        what: &'static str,
        path: String,
        by: String,
        flag: &'static str,
    },
    #[error("locking {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// What a lock guards, for its error.
pub struct Guarded<'a> {
    pub what: &'static str,
    pub path: &'a Path,
    pub flag: &'static str,
}

/// Take the lock `lock` (created if needed), which guards `g`; the lock
/// file says which process holds it.
pub async fn hold(lock: PathBuf, g: &Guarded<'_>) -> Result<Held, LockError> {
    let deadline = std::time::Instant::now() + HANDOVER;
    loop {
        match try_hold(&lock, g) {
            Err(LockError::InUse { by, .. }) if std::time::Instant::now() < deadline => {
                tracing::debug!(lock = %lock.display(), by, "waiting for the server before to end");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            out => return out,
        }
    }
}

/// How long a lock held by another server is waited for before it counts
/// as in use: a server killed just now (a restart by a supervisor or a
/// test harness that does not wait for its exit) lets it go within
/// milliseconds, as its process ends.
const HANDOVER: std::time::Duration = std::time::Duration::from_secs(3);

fn try_hold(lock: &Path, g: &Guarded) -> Result<Held, LockError> {
    let io = |source| LockError::Io {
        path: lock.display().to_string(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(lock)
        .map_err(io)?;
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            return Err(LockError::InUse {
                what: g.what,
                path: g.path.display().to_string(),
                by: if pid.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {pid})")
                },
                flag: g.flag,
            });
        }
        // A file system without locks (some FUSE ones): serve, unguarded,
        // rather than not at all.
        Err(
            e
            @ (rustix::io::Errno::NOLCK | rustix::io::Errno::NOSYS | rustix::io::Errno::OPNOTSUPP),
        ) => {
            tracing::warn!(lock = %lock.display(), error = %e, "cannot lock: a second server on it would not be refused");
        }
        Err(e) => return Err(io(e.into())),
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .map_err(io)?;
    Ok(Held { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_hold_is_refused_until_the_first_is_let_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = Guarded {
            what: "the data directory",
            path: dir.path(),
            flag: "--data-dir",
        };
        let lock = dir.path().join("holdfast.lock");
        let first = hold(lock.clone(), &g).await.expect("first");
        let err = hold(lock.clone(), &g)
            .await
            .expect_err("second")
            .to_string();
        let me = std::process::id();
        assert!(
            err.contains(&format!("in use by another holdfast server (pid {me})"))
                && err.ends_with("give this one its own --data-dir"),
            "{err}"
        );
        // One let go while the next waits is taken over.
        let next = tokio::spawn({
            let lock = lock.clone();
            let path = dir.path().to_owned();
            async move {
                let g = Guarded {
                    what: "the data directory",
                    path: &path,
                    flag: "--data-dir",
                };
                hold(lock, &g).await.map(|_| ())
            }
        });
        drop(first);
        next.await.expect("join").expect("taken over once let go");
    }
}
