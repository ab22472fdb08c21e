//! `owner` members: a pid the server reads itself, or the calling process.

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::{Caller, Peer};
use super::error::ApiError;
use crate::host::{Host, ObserveError};
use crate::model::Identity;

/// `{"pid": 4242}` (optionally with the `start_time` the client saw), or
/// `"caller"` over the Unix socket.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum OwnerSpec {
    Caller(CallerKeyword),
    Pid(OwnerPid),
}

/// By the JSON's own type, not as an untagged enum, whose one error
/// ("data did not match any variant of untagged enum OwnerSpec") named
/// neither the member at fault nor what is expected: an object's errors
/// are `OwnerPid`'s, at `owner.pid` or at the unknown member.
impl<'de> Deserialize<'de> for OwnerSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Spec;
        impl<'de> Visitor<'de> for Spec {
            type Value = OwnerSpec;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object {\"pid\": N} or \"caller\"")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<OwnerSpec, E> {
                match s {
                    "caller" => Ok(OwnerSpec::Caller(CallerKeyword::Caller)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(s), &self)),
                }
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<OwnerSpec, A::Error> {
                OwnerPid::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(OwnerSpec::Pid)
            }
        }
        d.deserialize_any(Spec)
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallerKeyword {
    Caller,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OwnerPid {
    #[schema(minimum = 1, maximum = 2_147_483_647, example = 4242)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub pid: i64,
    /// The start time the client saw; the request fails with
    /// `identity_mismatch` if the server reads another.
    #[schema(example = "8879")]
    pub start_time: Option<String>,
}

#[derive(Clone, Copy)]
enum OwnerKind {
    Caller,
    Pid,
}

/// Read the identity of the process an `owner` member names, on this host.
pub fn resolve_owner(
    host: &dyn Host,
    spec: OwnerSpec,
    field: &str,
    caller: &Caller,
) -> Result<Identity, ApiError> {
    let kind = match spec {
        OwnerSpec::Caller(_) => OwnerKind::Caller,
        OwnerSpec::Pid(_) => OwnerKind::Pid,
    };
    let p = match (spec, caller.peer) {
        // The kernel's word about the peer, read when it connected.
        (OwnerSpec::Caller(_), Peer::Unix { pid: Some(pid), .. }) => OwnerPid {
            pid: i64::from(pid),
            start_time: None,
        },
        (OwnerSpec::Caller(_), _) => {
            return Err(ApiError::validation(
                field,
                "\"caller\" is only accepted over the Unix socket",
            ));
        }
        (OwnerSpec::Pid(p), _) => p,
    };
    let pid_field = format!("{field}.pid");
    let pid = i32::try_from(p.pid)
        .ok()
        .filter(|pid| *pid > 0)
        .ok_or_else(|| ApiError::validation(&pid_field, "pid must be a positive process id"))?;
    let identity = host.observe(pid).map_err(|e| match e {
        ObserveError::NotFound(_) => ApiError::ProcessNotFound {
            field: pid_field.clone(),
            pid: p.pid,
        },
        other => ApiError::OwnerUnverifiable(other.to_string()),
    })?;
    if let Some(why) = identity.not_the_one_seen(p.start_time.as_deref()) {
        return Err(ApiError::IdentityMismatch(why));
    }
    // "caller": the process behind the peer's pidfd must be the one read now.
    if let (
        OwnerKind::Caller,
        Peer::Unix {
            pidfd_inode: Some(inode),
            ..
        },
    ) = (kind, caller.peer)
        && identity.pidfd_inode.as_deref() != Some(inode.to_string().as_str())
    {
        return Err(ApiError::IdentityMismatch(format!(
            "the calling process has exited; pid {pid} is another process now"
        )));
    }
    Ok(identity)
}
