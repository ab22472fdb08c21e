//! Who is calling, and whether they may: bearer tokens, Unix socket peer
//! credentials, and the `Host` / `Origin` checks that keep web pages out.

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;
pub use crate::caller::{Caller, Peer};
use crate::config::Tokens;

/// The peer of a Unix socket connection, as the kernel describes it.
pub fn peer_of(stream: &tokio::net::UnixStream) -> Peer {
    let pidfd_inode = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerPidfd)
        .ok()
        .and_then(|fd| crate::host::identity::pidfs_inode(&fd));
    match stream.peer_cred() {
        Ok(cred) => Peer::Unix {
            pid: cred.pid(),
            uid: cred.uid(),
            gid: cred.gid(),
            pidfd_inode,
        },
        // Unknown credentials: treat as the most restricted local user.
        Err(_) => Peer::Unix {
            pid: None,
            uid: u32::MAX,
            gid: u32::MAX,
            pidfd_inode: None,
        },
    }
}

/// Constant-time comparison: how long it takes says nothing about where a
/// wrong token differs.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The caller of a request with these headers on this connection, or why not.
pub fn identify(tokens: &Tokens, headers: &HeaderMap, peer: Peer) -> Result<Caller, ApiError> {
    if !tokens.any() {
        // No token configured: every caller counts as admin, except that a
        // non-root Unix peer may act only on its own processes.
        let admin = !matches!(peer, Peer::Unix { uid, .. } if uid != 0);
        return Ok(Caller {
            admin,
            ordinary_token: false,
            peer,
        });
    }
    let given = bearer(headers).ok_or(ApiError::Unauthorized)?;
    let is = |t: &Option<String>| {
        t.as_ref()
            .is_some_and(|t| same_secret(given.as_bytes(), t.as_bytes()))
    };
    if is(&tokens.admin) {
        return Ok(Caller {
            admin: true,
            ordinary_token: false,
            peer,
        });
    }
    if is(&tokens.auth) {
        return Ok(Caller {
            admin: false,
            ordinary_token: true,
            peer,
        });
    }
    Err(ApiError::Unauthorized)
}

/// `Host` names a loopback listener accepts.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']')
            .next()
            .map(|h| format!("[{h}]"))
            .unwrap_or_default()
    } else {
        host.rsplit_once(':')
            .map_or(host, |(h, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    h
                } else {
                    host
                }
            })
            .to_owned()
    };
    let name = name.to_ascii_lowercase();
    matches!(name.as_str(), "localhost" | "127.0.0.1" | "[::1]")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(&name))
}

fn origin_allowed(origin: &str, allowed: &[String]) -> bool {
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    rest.is_some_and(|r| !r.contains('/') && host_allowed(r, allowed))
}

/// Whether the request may reach a loopback listener (DNS rebinding guard):
/// one `Host`, allowed, and every `Origin` allowed. Two `Host`s are refused
/// rather than one of them believed (RFC 9112 answers them 400). An
/// absolute-form target (`GET http://host/...`) names the host the request
/// is for, over its `Host`, and must be allowed too.
pub fn loopback_request_allowed(uri: &Uri, headers: &HeaderMap, allowed: &[String]) -> bool {
    let target_ok = uri
        .authority()
        .is_none_or(|a| host_allowed(a.as_str(), allowed));
    let mut hosts = headers.get_all(header::HOST).iter();
    let host_ok = hosts
        .next()
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| host_allowed(h, allowed))
        && hosts.next().is_none();
    let origin_ok = headers
        .get_all(header::ORIGIN)
        .iter()
        .all(|o| o.to_str().is_ok_and(|o| origin_allowed(o, allowed)));
    target_ok && host_ok && origin_ok
}

/// Applied to every request: the Host/Origin check on a loopback listener,
/// then, for /v1 and /metrics, the bearer token, before any body is read.
pub async fn guard(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    mut req: Request,
    next: Next,
) -> Response {
    let head: usize = req.uri().to_string().len()
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>();
    if head > super::HEAD_LIMIT {
        return ApiError::HeadersTooLarge.into_response();
    }
    if peer == Peer::Tcp
        && state.access.tcp_loopback
        && !loopback_request_allowed(req.uri(), req.headers(), &state.access.allowed_hosts)
    {
        return ApiError::Forbidden(
            "this Host or Origin is not allowed on a loopback listener".into(),
        )
        .into_response();
    }
    let path = req.uri().path();
    let open = matches!(path, "/healthz" | "/readyz" | "/openapi.json");
    let caller = match identify(&state.access.tokens, req.headers(), peer) {
        Ok(c) => c,
        Err(e) if !open => return e.into_response(),
        Err(_) => Caller {
            admin: false,
            ordinary_token: false,
            peer,
        },
    };
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// What the guard needs to know.
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub tokens: Tokens,
    pub allowed_hosts: Vec<String>,
    /// The TCP listener is on a loopback address.
    pub tcp_loopback: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("header"));
        }
        h
    }

    #[test]
    fn loopback_hosts_and_origins() {
        let allowed = vec!["myhost.internal".to_owned()];
        let slash = Uri::from_static("/");
        for ok in [
            "localhost",
            "localhost:7427",
            "127.0.0.1:1",
            "[::1]:7427",
            "[::1]",
            "MyHost.internal:80",
        ] {
            assert!(
                loopback_request_allowed(&slash, &headers(&[("host", ok)]), &allowed),
                "{ok}"
            );
        }
        for bad in [
            "evil.example",
            "evil.example:7427",
            "127.0.0.1.evil.example",
            "localhost.evil",
        ] {
            assert!(
                !loopback_request_allowed(&slash, &headers(&[("host", bad)]), &allowed),
                "{bad}"
            );
        }
        assert!(
            !loopback_request_allowed(&slash, &HeaderMap::new(), &allowed),
            "no Host"
        );
        let with_origin = |o| headers(&[("host", "localhost:7427"), ("origin", o)]);
        assert!(loopback_request_allowed(
            &slash,
            &with_origin("http://localhost:3000"),
            &allowed
        ));
        assert!(!loopback_request_allowed(
            &slash,
            &with_origin("https://evil.example"),
            &allowed
        ));
        assert!(!loopback_request_allowed(
            &slash,
            &with_origin("null"),
            &allowed
        ));
        let twice = |name: &str, first: &str, second: &str| {
            let mut h = headers(&[("host", "localhost")]);
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                first.parse().expect("value"),
            );
            h.append(
                axum::http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                second.parse().expect("value"),
            );
            h
        };
        for h in [
            twice("host", "localhost", "evil.example"),
            twice("host", "localhost", "localhost"),
            twice("origin", "http://localhost", "http://evil.example"),
        ] {
            assert!(!loopback_request_allowed(&slash, &h, &allowed), "{h:?}");
        }
        let localhost = headers(&[("host", "localhost")]);
        for (target, ok) in [
            ("http://evil.example/healthz", false),
            ("http://localhost:7427/healthz", true),
        ] {
            let uri = Uri::from_static(target);
            assert_eq!(
                loopback_request_allowed(&uri, &localhost, &allowed),
                ok,
                "{target}"
            );
        }
    }

    #[test]
    fn tokens_decide_admin() {
        let tokens = Tokens {
            auth: Some("user".into()),
            admin: Some("root".into()),
        };
        let auth = |v: &str| headers(&[("authorization", v)]);
        let c = identify(&tokens, &auth("Bearer root"), Peer::Tcp).expect("admin");
        assert!(c.admin);
        let c = identify(&tokens, &auth("bearer user"), Peer::Tcp).expect("user");
        assert!(!c.admin && c.ordinary_token);
        assert!(identify(&tokens, &auth("Bearer nope"), Peer::Tcp).is_err());
        assert!(identify(&tokens, &auth("Basic user"), Peer::Tcp).is_err());
        assert!(identify(&tokens, &HeaderMap::new(), Peer::Tcp).is_err());
        let none = Tokens::default();
        assert!(
            identify(&none, &HeaderMap::new(), Peer::Tcp)
                .expect("open")
                .admin
        );
        let peer = Peer::Unix {
            pid: Some(5),
            uid: 1000,
            gid: 1000,
            pidfd_inode: None,
        };
        let c = identify(&none, &HeaderMap::new(), peer).expect("open");
        assert!(!c.admin, "a non-root Unix peer is limited to its own uid");
        assert!(c.may_act_on(Some(1000), 0).is_ok());
        assert!(c.may_act_on(Some(1001), 0).is_err());
    }

    #[test]
    fn tcp_callers_without_admin_act_only_on_the_servers_non_root_uid() {
        let c = Caller {
            admin: false,
            ordinary_token: true,
            peer: Peer::Tcp,
        };
        assert!(c.may_act_on(Some(1000), 1000).is_ok());
        assert!(c.may_act_on(Some(0), 0).is_err());
        assert!(c.may_act_on(Some(1001), 1000).is_err());
    }
}
