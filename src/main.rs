mod cli;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
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
    #[command(
        after_help = "Logging: HOLDFAST_LOG (a tracing filter: error, warn, info, debug, trace; default info) to stderr."
    )]
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

/// The command line, with the client's flags left out of `serve --help`:
/// they are global, so clap would list them there, and `serve` refuses them.
/// `serve` gets hidden copies of them, which clap then does not replace.
fn command() -> clap::Command {
    let cmd = Cli::command();
    let client: Vec<clap::Arg> = cmd
        .get_arguments()
        .filter(|arg| arg.is_global_set())
        .map(|arg| arg.clone().global(false).hide(true))
        .collect();
    cmd.mut_subcommand("serve", |serve| serve.args(client))
}

fn main() -> ExitCode {
    let matches = command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Some(serve) = matches.subcommand_matches("serve") {
        refuse_misplaced_flags(&matches, serve);
    }
    match cli.command {
        Command::Openapi => {
            print!("{}", holdfast::api::openapi_json());
            ExitCode::SUCCESS
        }
        Command::Healthcheck => ExitCode::from(cli::healthcheck(&cli.conn)),
        Command::Serve(config) => {
            if let Some(why) = config.listens_nowhere() {
                // Wrong usage, as clap's own refusals are (exit 2).
                command()
                    .error(clap::error::ErrorKind::MissingRequiredArgument, why)
                    .exit();
            }
            serve(*config)
        }
        Command::Client(cmd) => ExitCode::from(cli::main(&cli.conn, cmd)),
        Command::Exec(args) => cli::run::gate::exec(args),
    }
}

/// The client's connection flags are global, so clap also takes them after
/// `serve`, where they would do nothing: `serve --token-file F` would start
/// a server with no token at all. A usage error instead (exit 2), naming
/// the server's own flag where there is one; so are the hidden flags that
/// would take a token itself.
fn refuse_misplaced_flags(top: &ArgMatches, serve: &ArgMatches) {
    let given = |id: &str| {
        [top, serve]
            .iter()
            .any(|m| m.value_source(id) == Some(ValueSource::CommandLine))
    };
    let hint = [
        (
            "token_file",
            "--token-file",
            " (the server's token is --auth-token-file)",
        ),
        (
            "socket",
            "--socket",
            " (the server's socket is --unix-socket)",
        ),
        ("url", "--url", " (the server's address is --listen)"),
        ("json", "--json", ""),
    ]
    .into_iter()
    .find(|(id, ..)| given(id));
    if let Some((_, flag, hint)) = hint {
        command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                format!("{flag} is a client flag: `holdfast serve` does not take it{hint}"),
            )
            .exit();
    }
    // The tokens themselves are read from their variables; on the command
    // line every local user would read them in `ps`.
    for (id, flag, var) in [
        ("auth_token", "--auth-token", "HOLDFAST_AUTH_TOKEN"),
        ("admin_token", "--admin-token", "HOLDFAST_ADMIN_TOKEN"),
    ] {
        if serve.value_source(id) == Some(ValueSource::CommandLine) {
            command()
                .error(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!(
                        "{flag} would show the token to every local user (ps): give it with {flag}-file or {var}"
                    ),
                )
                .exit();
        }
    }
}

fn serve(config: Config) -> ExitCode {
    let filter = match tracing_subscriber::EnvFilter::try_from_env("HOLDFAST_LOG") {
        Ok(filter) => filter,
        Err(e) => {
            // Unset is the default; a value that does not parse is said.
            if std::env::var_os("HOLDFAST_LOG").is_some_and(|v| !v.is_empty()) {
                eprintln!("holdfast: HOLDFAST_LOG does not parse ({e}); logging at info");
            }
            tracing_subscriber::EnvFilter::new("info")
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
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
    let mut config = config;
    // The pool, and PostgreSQL's three more (SQLite's few fit the headroom).
    let store_files = u64::from(config.database_pool_size) + 3;
    config.max_connections =
        holdfast::server::connections_that_fit(config.max_connections, store_files);
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
