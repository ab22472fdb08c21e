use std::process::ExitCode;

use clap::{Parser, Subcommand};
use holdfast::App;
use holdfast::config::Config;

#[derive(Parser)]
#[command(
    name = "holdfast",
    version,
    about = "Exclusive leases with fencing tokens, over HTTP/JSON"
)]
struct Cli {
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
    Healthcheck {
        #[arg(long, env = "HOLDFAST_URL", default_value = "http://127.0.0.1:7427")]
        url: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Openapi => {
            print!("{}", holdfast::api::openapi_json());
            ExitCode::SUCCESS
        }
        Command::Healthcheck { url } => match holdfast_healthcheck(&url) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("holdfast healthcheck: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Serve(config) => serve(*config),
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
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
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

/// GET <url>/readyz over plain HTTP/1.1; Ok only on status 200.
fn holdfast_healthcheck(url: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    use std::time::Duration;
    let rest = url
        .strip_prefix("http://")
        .ok_or("the URL must start with http://")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let mut stream = std::net::TcpStream::connect(authority)
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
    let timeout = Some(Duration::from_secs(5));
    stream
        .set_read_timeout(timeout)
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(timeout)
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut head = [0u8; 64];
    let n = stream.read(&mut head).map_err(|e| e.to_string())?;
    let status_line = String::from_utf8_lossy(&head[..n]);
    match status_line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        Some(code) => Err(format!("/readyz answered {code}")),
        None => Err("no HTTP answer".into()),
    }
}
