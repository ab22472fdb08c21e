//! The client half of the binary (`../shared/CLI.md`): every endpoint from
//! the shell, and `holdfast run`. It speaks only the public HTTP API, with
//! the crate's own request and record types, so client and server cannot
//! drift.

mod conn;
mod duration;
mod error;
mod events;
mod follow;
mod http;
mod lease;
mod list;
mod logs;
mod parse;
mod ports;
mod process;
pub mod run;
mod sse;
mod table;
mod url;

use clap::Subcommand;

pub use conn::ConnArgs;
use error::CliError;

/// The client commands.
#[derive(Debug, Subcommand)]
pub enum ClientCmd {
    /// Acquire, renew, activate, release, break, get and list leases.
    #[command(subcommand)]
    Lease(lease::LeaseCmd),
    /// List managed processes.
    Ps(process::PsArgs),
    /// Start a command as a managed process of the server.
    Spawn(process::SpawnArgs),
    /// Stop a managed process (its whole group): SIGTERM, grace, SIGKILL.
    Stop(process::StopArgs),
    /// Print a spawned process's output.
    Logs(logs::LogsArgs),
    /// Print the log of state changes.
    Events(events::EventsArgs),
    /// Port reservations.
    #[command(subcommand)]
    Ports(ports::PortsCmd),
    /// Run COMMAND while holding a lease; it never outlives the lease.
    Run(run::RunArgs),
}

/// Run one client command; the process's exit code. Errors are printed
/// here, as one line.
pub fn main(conn: &ConnArgs, cmd: ClientCmd) -> u8 {
    // `run`'s stdout is COMMAND's.
    let json = conn.json && !matches!(cmd, ClientCmd::Run(_));
    let result = runtime().and_then(|rt| rt.block_on(dispatch(conn, cmd)));
    match result {
        Ok(code) => code,
        Err(e) => {
            // With --json, a refusal is what the API answered too: a
            // script reads its `current` or `holder` from stdout.
            if let Some(answer) = e.answer.as_deref().filter(|_| json) {
                let _ = table::print_json_text(answer);
            }
            e.report();
            e.exit
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::local(format!("cannot start the runtime: {e}")))
}

async fn dispatch(conn: &ConnArgs, cmd: ClientCmd) -> Result<u8, CliError> {
    let client = conn.client(&conn::Env::read())?;
    let json = conn.json;
    match cmd {
        ClientCmd::Lease(c) => lease::run(c, &client, json).await?,
        ClientCmd::Ps(a) => process::ps(a, &client, json).await?,
        ClientCmd::Spawn(a) => process::spawn(a, &client, json).await?,
        ClientCmd::Stop(a) => process::stop(a, &client, json).await?,
        ClientCmd::Logs(a) => logs::run(a, &client).await?,
        ClientCmd::Events(a) => events::run(a, &client, json).await?,
        ClientCmd::Ports(c) => ports::run(c, &client, json).await?,
        ClientCmd::Run(a) => return run::run(a, &client).await,
    }
    Ok(0)
}

/// `holdfast healthcheck`: 0 when the server answers /readyz with 200 at
/// the first try, else 1 (what container health checks expect), with the
/// reason on stderr.
pub fn healthcheck(conn: &ConnArgs) -> u8 {
    let check = async {
        let client = conn.client(&conn::Env::read())?;
        let ready = client.open(hyper::Method::GET, "/readyz", None, &[]);
        match tokio::time::timeout(std::time::Duration::from_secs(10), ready).await {
            Ok(res) => http::success(res?).await.map(drop),
            Err(_) => Err(CliError::unreachable("no answer within 10 s")),
        }
    };
    match runtime().and_then(|rt| rt.block_on(check)) {
        Ok(()) => 0,
        Err(e) => {
            e.report();
            1
        }
    }
}
