mod cli;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use holdfast::App;
use holdfast::config::Config;

#[derive(Parser)]
#[command(
    name = "holdfast",
    version,
    about = "Exclusive leases with fencing tokens, over HTTP/JSON: the server and its client"
)]
struct Cli {
    #[command(flatten)]
    conn: cli::ConnArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service.
    Serve(Box<Config>),
    /// Print the OpenAPI document.
    Openapi,
    /// Exit 0 only when the service answers /readyz with 200 (for container health checks).
    Healthcheck,
    #[command(flatten)]
    Client(cli::ClientCmd),
    /// The gate `holdfast run` starts COMMAND behind (internal).
    #[command(name = "__exec", hide = true)]
    Exec(cli::run::gate::ExecArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Openapi => {
            print!("{}", holdfast::api::openapi_json());
            ExitCode::SUCCESS
        }
        Command::Healthcheck => ExitCode::from(cli::healthcheck(&cli.conn)),
        Command::Serve(config) => serve(*config),
        Command::Client(cmd) => ExitCode::from(cli::main(&cli.conn, cmd)),
        Command::Exec(args) => cli::run::gate::exec(args),
    }
}

fn serve(config: Config) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HOLDFAST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // A batch of SQLite writes holds its runtime thread through its fsync
    // (see store/sqlite/direct.rs): on one CPU (a container's quota, an
    // affinity mask) a second thread serves requests meanwhile.
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        runtime.worker_threads(cpus.max(2));
    }
    let runtime = match runtime.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("holdfast: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    holdfast::server::raise_fd_limit();
    let result = runtime.block_on(async move {
        let app = App::build(config).await?;
        let listeners = app.bind().await?;
        if let Some(tcp) = &listeners.tcp {
            tracing::info!(addr = %tcp.local_addr()?, "holdfast listening");
        }
        if let Some(path) = &app.config.unix_socket {
            tracing::info!(path = %path.display(), "holdfast listening on a unix socket");
        }
        app.serve(listeners, shutdown_signal()).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("holdfast: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, serve until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
}
