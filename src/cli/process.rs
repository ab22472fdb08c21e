//! `holdfast ps`, `spawn` and `stop`: managed processes.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use holdfast::api::processes::{CommandSpec, CreateProcessRequest, ListQuery, StopRequest};
use holdfast::model::{ProcessView, StateFilter, TokenRef};

use super::error::CliError;
use super::http::{Answer, Client};
use super::table::{Table, opt, opt_time};
use super::{duration, list, parse};

#[derive(Debug, Args)]
pub struct PsArgs {
    /// current, ended or all [default: current]
    #[arg(long, value_parser = parse::state)]
    state: Option<StateFilter>,
    /// Processes of this kind only
    #[arg(long)]
    kind: Option<String>,
    /// Every page, not only the first
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Args)]
pub struct SpawnArgs {
    /// What it is, for people and filters (`dev-server`)
    #[arg(long)]
    kind: String,
    /// The lease that owns it: the server stops it when the lease ends
    #[arg(long, value_name = "ID:TOKEN", value_parser = parse::id_token)]
    lease: Option<(String, i64)>,
    /// Reserve a port; the command gets PORT_<NAME> (and PORT for the first)
    #[arg(long = "port", value_name = "NAME")]
    ports: Vec<String>,
    /// Keep it only while heartbeats come within this; the server stops it when they stop
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    ttl: Option<Duration>,
    /// At most one current process per operation id: a second spawn with it is refused
    #[arg(long, value_name = "OP")]
    operation_id: Option<String>,
    /// Working directory [default: the server's]
    #[arg(long, value_name = "DIR")]
    cwd: Option<std::path::PathBuf>,
    /// Add to the command's environment
    #[arg(long = "env", value_name = "K=V", value_parser = parse::key_value)]
    env: Vec<(String, String)>,
    /// The program and its arguments (no shell)
    #[arg(last = true, required = true, value_name = "COMMAND")]
    argv: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct StopArgs {
    /// The process's id (as `spawn` or `ps` printed it)
    id: String,
    /// The process's token
    #[arg(long, allow_negative_numbers = true)]
    token: i64,
    /// Between SIGTERM and SIGKILL [default: 5s]
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    grace: Option<Duration>,
    /// No SIGKILL after the grace period
    #[arg(long)]
    no_force: bool,
    /// Why; recorded as its end reason
    #[arg(long)]
    reason: Option<String>,
}

pub async fn ps(a: PsArgs, client: &Client, json: bool) -> Result<(), CliError> {
    let query = ListQuery {
        state: a.state,
        kind: a.kind,
        operation_id: None,
        lease: None,
        limit: None,
        cursor: None,
    };
    let listing = list::fetch::<ProcessView>(client, "/v1/processes", &query, a.all).await?;
    if json {
        super::table::print_json_text(&listing.json)?;
    } else {
        listing.print_table(&table(&listing.items))?;
    }
    Ok(())
}

pub async fn spawn(a: SpawnArgs, client: &Client, json: bool) -> Result<(), CliError> {
    let argv = a
        .argv
        .into_iter()
        .map(|s| {
            s.into_string()
                .map_err(|s| CliError::usage(format!("{s:?} is not UTF-8")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cwd = a
        .cwd
        .map(|d| {
            std::path::absolute(&d)
                .map_err(|e| CliError::local(format!("{}: {e}", d.display())))
                .map(|d| d.to_string_lossy().into_owned())
        })
        .transpose()?;
    let body = CreateProcessRequest {
        kind: a.kind,
        operation_id: a.operation_id,
        lease: a.lease.map(|(id, token)| TokenRef { id, token }),
        owner: None,
        ttl_ms: a.ttl.map(duration::ms),
        command: Some(CommandSpec {
            argv,
            cwd,
            env: (!a.env.is_empty()).then(|| a.env.into_iter().collect::<BTreeMap<_, _>>()),
        }),
        ports: (!a.ports.is_empty()).then_some(a.ports),
        metadata: None,
    };
    let answer = client.post("/v1/processes", &body).await?;
    show_one(&answer, json)
}

pub async fn stop(a: StopArgs, client: &Client, json: bool) -> Result<(), CliError> {
    let body = StopRequest {
        token: a.token,
        grace_ms: a.grace.map(duration::ms),
        force: a.no_force.then_some(false),
        reason: a.reason,
    };
    let path = format!("/v1/processes/{}/stop", parse::path_segment(&a.id)?);
    let answer = client.post(&path, &body).await?;
    show_one(&answer, json)
}

fn show_one(answer: &Answer, json: bool) -> Result<(), CliError> {
    if json {
        answer.print_raw()?;
    } else {
        table(&[answer.json::<ProcessView>()?]).print()?;
    }
    Ok(())
}

pub fn table(procs: &[ProcessView]) -> Table {
    let mut t = Table::new(&[
        "ID", "KIND", "STATE", "TOKEN", "PID", "STATUS", "PORTS", "STARTED", "COMMAND",
    ]);
    for p in procs {
        let state = match (&p.end_reason, p.exit.code, p.exit.signal) {
            (_, Some(code), _) => format!("{} (exit {code})", p.state.as_str()),
            (_, None, Some(sig)) => format!("{} (signal {sig})", p.state.as_str()),
            (Some(reason), _, _) if reason != p.state.as_str() => {
                format!("{} ({reason})", p.state.as_str())
            }
            _ => p.state.as_str().to_owned(),
        };
        let ports: Vec<String> = p
            .ports
            .iter()
            .map(|(n, port)| format!("{n}={port}"))
            .collect();
        t.row(vec![
            p.id.clone(),
            p.kind.clone(),
            state,
            p.token.to_string(),
            opt(p.pid),
            opt(p.status.map(parse::name)),
            if ports.is_empty() {
                "-".into()
            } else {
                ports.join(",")
            },
            opt_time(p.started_at),
            command_line(p),
        ]);
    }
    t
}

/// What it runs: the spawned argv, the argv `holdfast run` recorded, or
/// the executable the server saw.
fn command_line(p: &ProcessView) -> String {
    if let Some(c) = &p.command {
        return c.argv.join(" ");
    }
    if let Some(argv) = p.metadata.get("argv").and_then(|v| v.as_array()) {
        let words: Vec<&str> = argv.iter().filter_map(|w| w.as_str()).collect();
        return words.join(" ");
    }
    opt(p.identity.as_ref().and_then(|i| i.executable.clone()))
}
