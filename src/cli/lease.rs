//! `holdfast lease acquire|renew|activate|release|break|get|list`.

use std::time::Duration;

use clap::{Args, Subcommand};
use holdfast::api::leases::{
    AcquireRequest, AcquireResponse, ActivateRequest, BreakRequest, ListQuery, ParentSpec,
    ReleaseRequest, RenewRequest,
};
use holdfast::api::owner::{OwnerPid, OwnerSpec};
use holdfast::model::{LeaseView, StateFilter};
use serde_json::{Map, Value};

use super::error::{CliError, EXIT_CONFLICT};
use super::http::{Answer, Client};
use super::table::{Table, opt, opt_time};
use super::{duration, list, parse};

#[derive(Debug, Subcommand)]
pub enum LeaseCmd {
    /// Acquire RESOURCE; prints the lease with its id and fencing token.
    Acquire(AcquireArgs),
    /// Push a lease's expiry out by its TTL (or a new one).
    Renew {
        /// The lease's id (as `acquire` printed it)
        id: String,
        /// The lease's fencing token
        #[arg(long, allow_negative_numbers = true)]
        token: i64,
        /// A new TTL, kept for later renewals [default: the lease's own]
        #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
        ttl: Option<Duration>,
    },
    /// Turn a reserved lease active, bound to a process.
    Activate {
        /// The lease's id (as `acquire` printed it)
        id: String,
        /// The lease's fencing token
        #[arg(long, allow_negative_numbers = true)]
        token: i64,
        /// The process the lease is bound to: it ends when that process does
        #[arg(long, value_name = "PID", allow_negative_numbers = true)]
        owner_pid: i64,
    },
    /// Release a lease (and the ports it holds).
    Release {
        /// The lease's id (as `acquire` printed it)
        id: String,
        /// The lease's fencing token
        #[arg(long, allow_negative_numbers = true)]
        token: i64,
    },
    /// End a current lease whatever its owner (admin only).
    Break {
        /// The lease's id
        id: String,
        /// Why; recorded as its end reason, `broken:<reason>`
        #[arg(long)]
        reason: String,
    },
    /// One lease, current or ended.
    Get {
        /// The lease's id
        id: String,
    },
    /// Leases, newest first.
    List(ListArgs),
}

#[derive(Debug, Args)]
pub struct AcquireArgs {
    /// The name to hold (`workspace/alpha`)
    pub resource: String,
    /// Who holds it, for people (`supervisor-1`)
    #[arg(long)]
    pub holder: String,
    /// The holder must renew within this [required without --owner-pid]
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    pub ttl: Option<Duration>,
    /// While the lease is held, wait this long for it to end
    #[arg(long, value_name = "DUR", value_parser = duration::parse, allow_hyphen_values = true)]
    pub wait: Option<Duration>,
    /// Bind the lease to this process: it ends when the process does
    #[arg(
        long,
        value_name = "PID",
        required_unless_present = "ttl",
        allow_negative_numbers = true
    )]
    pub owner_pid: Option<i64>,
    /// Create the lease reserved, to be activated later
    #[arg(long)]
    pub reserve: bool,
    /// A current lease to acquire under
    #[arg(long, value_name = "ID:TOKEN", value_parser = parse::id_token)]
    pub parent: Option<(String, i64)>,
    /// A JSON object kept with the lease
    #[arg(long, value_name = "JSON", value_parser = parse::json_object)]
    pub metadata: Option<Map<String, Value>>,
    /// Exit code when the lease is held
    #[arg(long, value_name = "N", default_value_t = EXIT_CONFLICT)]
    pub conflict_exit_code: u8,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Leases of this resource only
    #[arg(long)]
    resource: Option<String>,
    /// Resources that start with this, literally
    #[arg(long)]
    prefix: Option<String>,
    /// Leases of this holder only
    #[arg(long)]
    holder: Option<String>,
    /// current, ended or all [default: current]
    #[arg(long, value_parser = parse::state)]
    state: Option<StateFilter>,
    /// Every page, not only the first
    #[arg(long)]
    all: bool,
}

pub async fn run(cmd: LeaseCmd, client: &Client, json: bool) -> Result<(), CliError> {
    let answer = match cmd {
        LeaseCmd::Acquire(a) => return acquire_cmd(a, client, json).await,
        LeaseCmd::List(a) => return list_cmd(a, client, json).await,
        LeaseCmd::Renew { id, token, ttl } => {
            let body = RenewRequest {
                token,
                ttl_ms: ttl.map(duration::ms),
            };
            client.post(&op_path(&id, "renew")?, &body).await?
        }
        LeaseCmd::Activate {
            id,
            token,
            owner_pid,
        } => {
            let body = ActivateRequest {
                token,
                owner: Some(pid_owner(owner_pid)),
            };
            client.post(&op_path(&id, "activate")?, &body).await?
        }
        LeaseCmd::Release { id, token } => {
            client
                .post(&op_path(&id, "release")?, &ReleaseRequest { token })
                .await?
        }
        LeaseCmd::Break { id, reason } => {
            client
                .post(&op_path(&id, "break")?, &BreakRequest { reason })
                .await?
        }
        LeaseCmd::Get { id } => {
            client
                .get(&format!("/v1/leases/{}", parse::path_segment(&id)?))
                .await?
        }
    };
    show_one(&answer, json)
}

fn op_path(id: &str, op: &str) -> Result<String, CliError> {
    Ok(format!("/v1/leases/{}/{op}", parse::path_segment(id)?))
}

pub fn pid_owner(pid: i64) -> OwnerSpec {
    OwnerSpec::Pid(OwnerPid {
        pid,
        start_time: None,
    })
}

fn show_one(answer: &Answer, json: bool) -> Result<(), CliError> {
    if json {
        answer.print_raw()?;
    } else {
        table(&[answer.json::<LeaseView>()?]).print()?;
    }
    Ok(())
}

async fn acquire_cmd(a: AcquireArgs, client: &Client, json: bool) -> Result<(), CliError> {
    let mut req = AcquireRequest {
        resource: a.resource,
        holder: a.holder,
        ttl_ms: a.ttl.map(duration::ms),
        owner: a.owner_pid.map(pid_owner),
        parent: a.parent.map(|(id, token)| ParentSpec { id, token }),
        reserve: a.reserve,
        wait_ms: None,
        metadata: a.metadata,
    };
    let answer = acquire(client, &mut req, a.wait, a.conflict_exit_code).await?;
    if json {
        answer.print_raw()?;
        return Ok(());
    }
    let acquired: AcquireResponse = answer.json()?;
    table(std::slice::from_ref(&acquired.lease)).print()?;
    if let Some(r) = acquired.reclaimed {
        super::table::print_text(&format!(
            "took over from lease {} (token {}): {}\n",
            r.id, r.token, r.reason
        ))?;
    }
    Ok(())
}

/// POST the acquire; while the lease is held, wait on the server
/// (`wait_ms`, at most a minute a request) until `wait` runs out. A lease
/// still held then is an error with exit code `conflict`, naming the holder.
pub async fn acquire(
    client: &Client,
    req: &mut AcquireRequest,
    wait: Option<Duration>,
    conflict: u8,
) -> Result<Answer, CliError> {
    const MAX_WAIT: Duration = Duration::from_secs(60);
    let deadline = tokio::time::Instant::now() + wait.unwrap_or_default();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        req.wait_ms = (!left.is_zero()).then(|| duration::ms(left.min(MAX_WAIT)));
        match client.post("/v1/leases", req).await {
            Err(e) if e.is("lease_held") && tokio::time::Instant::now() < deadline => continue,
            Err(mut e) if e.is("lease_held") => {
                e.detail = held_detail(&e, wait);
                e.exit = conflict;
                return Err(e);
            }
            other => return other,
        }
    }
}

/// "R is held by H" with the holder's lease id, token and owner.
fn held_detail(e: &CliError, waited: Option<Duration>) -> String {
    let mut detail = e.detail.clone();
    if let Some(h) = e.problem.as_ref().and_then(|p| p.holder.as_ref()) {
        detail.push_str(&format!(" (lease {}, token {}", h.id, h.token));
        if let Some(owner) = &h.owner {
            detail.push_str(&format!(", pid {} on {}", owner.pid, owner.hostname));
        }
        detail.push(')');
    }
    if let Some(w) = waited.filter(|w| !w.is_zero()) {
        detail.push_str(&format!("; waited {}", humanize(w)));
    }
    detail
}

fn humanize(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

async fn list_cmd(a: ListArgs, client: &Client, json: bool) -> Result<(), CliError> {
    let query = ListQuery {
        resource: a.resource,
        prefix: a.prefix,
        holder: a.holder,
        parent: None,
        state: a.state,
        limit: None,
        cursor: None,
    };
    let listing = list::fetch::<LeaseView>(client, "/v1/leases", &query, a.all).await?;
    if json {
        super::table::print_json_text(&listing.json)?;
    } else {
        listing.print_table(&table(&listing.items))?;
    }
    Ok(())
}

pub fn table(leases: &[LeaseView]) -> Table {
    let mut t = Table::new(&[
        "ID", "RESOURCE", "TOKEN", "STATE", "HOLDER", "OWNER", "EXPIRES",
    ]);
    for l in leases {
        let state = match &l.end_reason {
            Some(reason) if reason != l.state.as_str() => {
                format!("{} ({reason})", l.state.as_str())
            }
            _ => l.state.as_str().to_owned(),
        };
        let owner = l.owner.as_ref().map(|o| {
            let status = l.owner_status.map(parse::name).unwrap_or_default();
            match l.owner_status_reason {
                Some(r) => format!("pid {} {status} ({})", o.pid, r.as_str()),
                None => format!("pid {} {status}", o.pid),
            }
        });
        // An ended lease expires no more.
        let mut expires = opt_time(l.expires_at.filter(|_| l.state.is_current()));
        if l.stale {
            expires.push_str(" (stale)");
        }
        t.row(vec![
            l.id.clone(),
            l.resource.clone(),
            l.token.to_string(),
            state,
            l.holder.clone(),
            opt(owner),
            expires,
        ]);
    }
    t
}
