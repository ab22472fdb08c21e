//! `holdfast run`: run a command while holding a lease, the eight steps of
//! CLI.md. The lease is owned by `run` itself, COMMAND is a managed process
//! of the lease, so the server stops COMMAND's tree if `run` dies.

mod child;
pub mod gate;
mod previous;
mod terminal;
mod watch;

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use holdfast::api::leases::{AcquireRequest, ReleaseRequest};
use holdfast::api::owner::{CallerKeyword, OwnerSpec};
use holdfast::api::ports::{OwnerRef, ReserveRequest, Reserved};
use holdfast::api::processes::{ConfirmRequest, CreateProcessRequest, StopRequest};
use holdfast::model::{LeaseView, ProcessView, TokenRef};
use serde_json::{Map, Value, json};

use super::error::say;
use super::error::{CliError, EXIT_CONFLICT};
use super::http::Client;
use super::{duration, lease, parse};
use child::{Ended, Gated};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The resource to hold while COMMAND runs
    #[arg(long = "lease", value_name = "RESOURCE")]
    resource: String,
    /// Who holds it, for people [default: <hostname>:<pid>: <COMMAND>]
    #[arg(long)]
    holder: Option<String>,
    /// While the lease is held, wait this long for it to end [default: do not wait]
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    wait: Option<Duration>,
    /// Also give the lease this TTL, renewed every third of it
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    ttl: Option<Duration>,
    /// Reserve a port for COMMAND as PORT_<NAME> (the first also as PORT); repeatable
    #[arg(long = "port", value_name = "NAME")]
    ports: Vec<String>,
    /// Between SIGTERM and SIGKILL when the lease is lost
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true, default_value = "5s")]
    grace: Duration,
    /// Exit code when the lease is held, or lost while COMMAND runs
    #[arg(long, value_name = "N", default_value_t = EXIT_CONFLICT)]
    conflict_exit_code: u8,
    /// A JSON object kept with the lease
    #[arg(long, value_name = "JSON", value_parser = parse::json_object)]
    metadata: Option<Map<String, Value>>,
    /// The program and its arguments (no shell)
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// Run COMMAND under the lease; the exit code `run` ends with.
pub async fn run(a: RunArgs, client: &Client) -> Result<u8, CliError> {
    // 1, 2: acquire, owned by this process; held → the conflict code.
    let owner = if client.over_unix_socket() {
        OwnerSpec::Caller(CallerKeyword::Caller)
    } else {
        lease::pid_owner(i64::from(std::process::id()))
    };
    let mut req = AcquireRequest {
        resource: a.resource.clone(),
        holder: a
            .holder
            .clone()
            .unwrap_or_else(|| default_holder(&a.command)),
        ttl_ms: a.ttl.map(duration::ms),
        owner: Some(owner),
        parent: None,
        reserve: false,
        wait_ms: None,
        metadata: a.metadata.clone(),
    };
    let held: LeaseView = lease::acquire(client, &mut req, a.wait, a.conflict_exit_code)
        .await
        .map_err(|e| e.field_from_flag("resource", "--lease"))?
        .json()?;
    let ended = under_lease(&a, client, &held).await;
    let released = match &ended {
        Ok(Ended::Lost(_)) => Ok(()),
        _ => release(client, &held).await,
    };
    match (ended, released) {
        (Ok(Ended::Lost(why)), _) => Err(CliError::lease_lost(why, a.conflict_exit_code)),
        (Ok(Ended::Exited(code)), Err(e)) => match watch::lost_on_release(&e) {
            // The lease ended before COMMAND did (the server may have stopped it).
            Some(why) => Err(CliError::lease_lost(why, a.conflict_exit_code)),
            None => {
                say!(
                    "holdfast: {}: releasing the lease: {} (it ends with this process)",
                    e.code,
                    e.detail
                );
                Ok(code)
            }
        },
        (Ok(Ended::Exited(code)), Ok(())) => Ok(code),
        (Err(e), _) => Err(e),
    }
}

/// Steps 3 to 7, with the lease held: the previous holder's processes
/// gone, ports, COMMAND registered, started and confirmed, then supervised
/// until it ends or the lease is lost.
async fn under_lease(a: &RunArgs, client: &Client, held: &LeaseView) -> Result<Ended, CliError> {
    previous::wait_until_stopped(client, held, a.conflict_exit_code).await?;
    let lease_ref = TokenRef {
        id: held.id.clone(),
        token: held.token,
    };
    let mut env = vec![
        ("HOLDFAST_LEASE_ID".to_owned(), held.id.clone()),
        ("HOLDFAST_LEASE_TOKEN".to_owned(), held.token.to_string()),
        ("HOLDFAST_RESOURCE".to_owned(), held.resource.clone()),
    ];
    env.extend(reserve_ports(client, &lease_ref, &a.ports).await?);
    let registered: ProcessView = client
        .post(
            "/v1/processes",
            &CreateProcessRequest {
                kind: "run".into(),
                operation_id: None,
                lease: Some(lease_ref),
                owner: None,
                ttl_ms: None,
                command: None,
                ports: None,
                metadata: Some(argv_metadata(&a.command)),
            },
        )
        .await?
        .json()?;
    let gated = Gated::spawn(&a.command, &env)?;
    let confirmed = client
        .post(
            &format!("/v1/processes/{}/confirm", registered.id),
            &ConfirmRequest {
                token: registered.token,
                pid: i64::from(gated.pid()),
                process_group: true,
                // Its own child, held at the gate unreaped: the pid cannot
                // have been given to another.
                start_time: None,
            },
        )
        .await;
    if let Err(e) = confirmed {
        gated.abandon().await;
        let stop = StopRequest {
            token: registered.token,
            grace_ms: None,
            force: None,
            reason: Some("holdfast run: the confirmation was refused".into()),
        };
        let _ = client
            .post(&format!("/v1/processes/{}/stop", registered.id), &stop)
            .await;
        return Err(refused(e, client));
    }
    let foreground = terminal::Foreground::hand_to(gated.pid());
    let lost = watch::lost(client.clone(), held.clone(), a.ttl);
    let ended = gated.supervise(lost, a.grace).await;
    drop(foreground);
    ended
}

/// Step 3: one port per name, owned by the lease, as environment variables.
async fn reserve_ports(
    client: &Client,
    lease: &TokenRef,
    names: &[String],
) -> Result<Vec<(String, String)>, CliError> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let body = ReserveRequest {
        names: names.to_vec(),
        owner: OwnerRef {
            process: None,
            lease: Some(lease.clone()),
        },
        range: None,
    };
    let reserved: Reserved = client.post("/v1/ports", &body).await?.json()?;
    let mut env = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let port = reserved
            .ports
            .get(name)
            .ok_or_else(|| CliError::local(format!("the server reserved no port named {name}")))?;
        if i == 0 {
            env.push(("PORT".to_owned(), port.to_string()));
        }
        env.push((
            format!("PORT_{}", name.to_ascii_uppercase()),
            port.to_string(),
        ));
    }
    Ok(env)
}

async fn release(client: &Client, held: &LeaseView) -> Result<(), CliError> {
    client
        .post(
            &format!("/v1/leases/{}/release", held.id),
            &ReleaseRequest { token: held.token },
        )
        .await
        .map(drop)
}

/// A refused confirmation, with what to do about it.
fn refused(mut e: CliError, client: &Client) -> CliError {
    if e.is("forbidden") {
        let hint = if e.detail.contains(holdfast::host::signal::SERVERS_OWN) {
            "the server was started in this shell's session, and it never signals its own \
             session: start it in a session of its own (`setsid holdfast serve`, or as a service)"
        } else if client.over_unix_socket() {
            "over the Unix socket the server confirms only processes of the caller's own uid"
        } else {
            "over TCP with an ordinary token the server confirms only processes of its own uid, \
             never of uid 0: use the Unix socket (--socket or HOLDFAST_SOCKET), where your uid \
             decides, or the admin token"
        };
        e.detail = format!("{}; the command was not started: {hint}", e.detail);
    } else {
        e.detail = format!("{}; the command was not started", e.detail);
    }
    e.exit = 1;
    e
}

/// `<hostname>:<pid>: <COMMAND>`, within the API's 256 bytes, one line.
fn default_holder(argv: &[OsString]) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let words: Vec<String> = argv
        .iter()
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    let text = format!(
        "{}:{}: {}",
        host.trim(),
        std::process::id(),
        words.join(" ")
    );
    let text: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut end = text.len().min(256);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// COMMAND's words for `holdfast ps` (the record has no `command`: the
/// server did not spawn it), kept well under the API's metadata limit.
fn argv_metadata(argv: &[OsString]) -> Map<String, Value> {
    let mut words = Vec::new();
    let mut size = 0;
    for w in argv {
        let w = w.to_string_lossy();
        size += w.len();
        if size > 4096 {
            break;
        }
        words.push(w.into_owned());
    }
    let mut m = Map::new();
    m.insert("argv".into(), json!(words));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_is_one_bounded_line() {
        let long = OsString::from("x".repeat(1000));
        let h = default_holder(&[OsString::from("sh"), OsString::from("-c\nline"), long]);
        assert!(h.len() <= 256, "{}", h.len());
        assert!(!h.contains('\n'));
        assert!(
            h.contains(&format!(":{}: sh -c line", std::process::id())),
            "{h}"
        );
    }
}
