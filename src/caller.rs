//! Who is asking: the connection a request came on and what it may do.

/// The connection a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Tcp,
    /// Credentials the kernel gave for the peer (SO_PEERCRED), and the
    /// pidfs inode of its pidfd (SO_PEERPIDFD) where the kernel has one:
    /// that names the very process that connected, whatever its pid becomes.
    Unix {
        pid: Option<i32>,
        uid: u32,
        gid: u32,
        pidfd_inode: Option<u64>,
    },
}

/// The caller of one request, as the handlers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// May break leases and act on processes of any uid.
    pub admin: bool,
    /// Carried a configured token that is not the admin one.
    pub ordinary_token: bool,
    pub peer: Peer,
}

impl Caller {
    /// The uid the caller may act for, when the kernel told us (Unix socket).
    pub fn uid(&self) -> Option<u32> {
        match self.peer {
            Peer::Unix { uid, .. } => Some(uid),
            Peer::Tcp => None,
        }
    }

    /// Whether this caller may act on a process owned by `process_uid`;
    /// `server_uid` is the daemon's own.
    pub fn may_act_on(&self, process_uid: Option<u32>, server_uid: u32) -> Result<(), String> {
        if self.admin {
            return Ok(());
        }
        match (self.peer, process_uid) {
            (Peer::Unix { uid: 0, .. }, _) => Ok(()),
            (Peer::Unix { uid, .. }, Some(p)) if p == uid => Ok(()),
            (Peer::Unix { uid, .. }, _) => Err(format!("the process does not belong to uid {uid}")),
            (Peer::Tcp, Some(p)) if p != 0 && p == server_uid => Ok(()),
            (Peer::Tcp, _) => {
                Err("only the admin token may act on processes of root or of another user".into())
            }
        }
    }
}
