//! Command-line flags, each also read from a `HOLDFAST_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Address and port of the HTTP listener, or `none` for the Unix socket alone.
    #[arg(long, env = "HOLDFAST_LISTEN", default_value = "127.0.0.1:7427", value_parser = parse_listen)]
    pub listen: Listen,

    /// Also (or only) serve on this Unix socket; callers are identified by their peer credentials.
    #[arg(long, env = "HOLDFAST_UNIX_SOCKET")]
    pub unix_socket: Option<PathBuf>,

    /// Octal permission bits of the Unix socket.
    #[arg(long, env = "HOLDFAST_UNIX_SOCKET_MODE", default_value = "0660", value_parser = parse_mode)]
    pub unix_socket_mode: u32,

    /// File holding the bearer token every /v1 call and /metrics must carry
    /// (or the token itself in HOLDFAST_AUTH_TOKEN; the file wins).
    #[arg(long, env = "HOLDFAST_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,

    /// File holding the admin token (may `break` leases and act on processes of any uid;
    /// or the token itself in HOLDFAST_ADMIN_TOKEN; the file wins).
    #[arg(long, env = "HOLDFAST_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,

    /// The bearer token itself (prefer the file: environments leak).
    #[arg(long, env = "HOLDFAST_AUTH_TOKEN", hide_env_values = true, hide = true)]
    pub auth_token: Option<String>,

    /// The admin token itself (prefer the file).
    #[arg(
        long,
        env = "HOLDFAST_ADMIN_TOKEN",
        hide_env_values = true,
        hide = true
    )]
    pub admin_token: Option<String>,

    /// On a loopback listener, host names accepted in `Host` and `Origin` besides
    /// localhost, 127.0.0.1 and [::1]; repeatable, or comma-separated.
    #[arg(
        long = "allowed-host",
        env = "HOLDFAST_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub allowed_hosts: Vec<String>,

    /// Connections served at once (1024 to 1000000); past it a client gets `503 busy`.
    #[arg(long, env = "HOLDFAST_MAX_CONNECTIONS", default_value_t = 4096,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=1_000_000))]
    pub max_connections: usize,

    /// Events kept: a count (`100000`) or an age (`30m`, `12h`, `7d`).
    #[arg(long, env = "HOLDFAST_EVENT_RETENTION", default_value = "1000000", value_parser = parse_retention)]
    pub event_retention: Retention,

    /// Ended leases, processes and port reservations are kept this long
    /// (`30m`, `12h`, `7d`), then deleted with their log files; `off` keeps
    /// them for ever.
    #[arg(long, env = "HOLDFAST_RECORD_RETENTION", default_value = "7d", value_parser = parse_record_retention)]
    pub record_retention: RecordRetention,

    /// Directory for the SQLite database and the logs of spawned processes (`logs/`).
    /// Default: $XDG_STATE_HOME/holdfast, else ~/.local/state/holdfast.
    #[arg(long, env = "HOLDFAST_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Store URL: sqlite://PATH, or postgres://USER@HOST:PORT/DB to share one
    /// database with the holdfast of other hosts.
    /// Default: sqlite://<data-dir>/holdfast.db. (HOLDFAST_DATABASE is read too.)
    #[arg(long, env = "HOLDFAST_DATABASE_URL")]
    pub database: Option<String>,

    /// PostgreSQL only: connections in the server's pool, 2 to 1000 (it opens
    /// three more: the writer's, one to LISTEN, one for renewals).
    #[arg(long, env = "HOLDFAST_DATABASE_POOL_SIZE", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub database_pool_size: u32,

    /// PostgreSQL only: how long to wait to connect, for a free connection,
    /// or for the fleet-wide write lock before answering `busy` (100 to 600000).
    #[arg(long, env = "HOLDFAST_DATABASE_TIMEOUT_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub database_timeout_ms: u64,

    /// How often the reconciler ends expired and dead-owner leases (10 to 3600000).
    #[arg(long, env = "HOLDFAST_RECONCILE_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub reconcile_interval_ms: u64,

    /// This host's id in recorded identities (default: /etc/machine-id, else the hostname).
    #[arg(long, env = "HOLDFAST_HOST_ID", value_parser = parse_host_id)]
    pub host_id: Option<String>,
}

/// The TCP listener, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    None,
}

fn parse_listen(s: &str) -> Result<Listen, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(Listen::None);
    }
    s.parse()
        .map(Listen::Tcp)
        .map_err(|e| {
            format!("{s:?} is not ADDR:PORT or none: {e} (an IP address and port, such as 127.0.0.1:7427 or [::1]:7427)")
        })
}

/// Not empty: an unset variable in a compose file (`HOLDFAST_HOST_ID: ${X}`)
/// would give every host of a fleet the same id.
fn parse_host_id(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "{s:?} is not a host id: 1 to 256 bytes, no spaces or control characters"
        ));
    }
    Ok(s.to_owned())
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal mode like 0660"))
}

/// How many events are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    Count(u64),
    Age(Duration),
}

/// How long ended records are kept; None: for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRetention(pub Option<Duration>);

fn parse_record_retention(s: &str) -> Result<RecordRetention, String> {
    if s == "off" {
        return Ok(RecordRetention(None));
    }
    parse_age(s, || format!("{s:?} is not an age (30m, 12h, 7d) or off"))
        .map(|d| RecordRetention(Some(d)))
}

fn parse_retention(s: &str) -> Result<Retention, String> {
    let bad = || format!("{s:?} is not a count (100000) or an age (30m, 12h, 7d)");
    if let Ok(n) = s.parse::<u64>() {
        return if n > 0 {
            Ok(Retention::Count(n))
        } else {
            Err(bad())
        };
    }
    parse_age(s, bad).map(Retention::Age)
}

/// `30s`, `30m`, `12h`, `7d`: a positive age.
fn parse_age(s: &str, bad: impl Fn() -> String) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).ok_or_else(&bad)?);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    match n.checked_mul(secs) {
        Some(total) if total > 0 => Ok(Duration::from_secs(total)),
        _ => Err(bad()),
    }
}

/// The bearer tokens, read from their files or the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    pub auth: Option<String>,
    pub admin: Option<String>,
}

impl Tokens {
    pub fn any(&self) -> bool {
        self.auth.is_some() || self.admin.is_some()
    }
}

fn token(
    file: Option<&PathBuf>,
    value: Option<&String>,
    what: &str,
) -> Result<Option<String>, String> {
    let raw = match (file, value) {
        (Some(path), _) => std::fs::read_to_string(path)
            .map_err(|e| format!("reading the {what} file {}: {e}", path.display()))?,
        (None, Some(v)) => v.clone(),
        (None, None) => return Ok(None),
    };
    let t = raw.trim().to_owned();
    if t.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    Ok(Some(t))
}

/// Where the store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    Sqlite(PathBuf),
    /// A PostgreSQL URL, as given.
    Postgres(String),
}

impl Config {
    pub fn tokens(&self) -> Result<Tokens, String> {
        Ok(Tokens {
            auth: token(
                self.auth_token_file.as_ref(),
                self.auth_token.as_ref(),
                "auth token",
            )?,
            admin: token(
                self.admin_token_file.as_ref(),
                self.admin_token.as_ref(),
                "admin token",
            )?,
        })
    }

    /// Refuse what would expose the API unprotected.
    pub fn check_exposure(&self, tokens: &Tokens) -> Result<(), String> {
        if let Listen::Tcp(addr) = self.listen
            && !addr.ip().is_loopback()
            && !tokens.any()
        {
            return Err(format!(
                "refusing to listen on {addr} without an auth token: anyone who can reach it could \
                 signal processes on this host. Set --auth-token-file (or HOLDFAST_AUTH_TOKEN), \
                 or listen on a loopback address"
            ));
        }
        if let Some(why) = self.listens_nowhere() {
            return Err(why.into());
        }
        Ok(())
    }

    /// Why this configuration would serve on no listener at all, if so.
    pub fn listens_nowhere(&self) -> Option<&'static str> {
        (self.listen == Listen::None && self.unix_socket.is_none())
            .then_some("--listen none needs --unix-socket PATH: the server would listen nowhere")
    }

    pub fn data_dir(&self) -> PathBuf {
        if let Some(dir) = &self.data_dir {
            return dir.clone();
        }
        let state_home = std::env::var_os("XDG_STATE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
            .unwrap_or_else(|| PathBuf::from("."));
        state_home.join("holdfast")
    }

    pub fn database(&self) -> Result<Database, String> {
        // HOLDFAST_DATABASE is accepted too: the flag is --database.
        let fallback = std::env::var("HOLDFAST_DATABASE")
            .ok()
            .filter(|v| !v.is_empty());
        let Some(url) = self.database.as_ref().or(fallback.as_ref()) else {
            return Ok(Database::Sqlite(self.data_dir().join("holdfast.db")));
        };
        if let Some(path) = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
        {
            if path.is_empty() {
                return Err("the sqlite URL names no file".into());
            }
            return Ok(Database::Sqlite(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // libpq would take the user's name for the database's, and the
            // schema would land in whatever database that is.
            let names_one = url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .map_err(|e| format!("the PostgreSQL URL does not parse: {e}"))?
                .get_database()
                .is_some_and(|db| !db.is_empty());
            if !names_one {
                return Err(
                    "the PostgreSQL URL names no database: end it with /DB (postgres://USER@HOST:PORT/DB)"
                        .into(),
                );
            }
            return Ok(Database::Postgres(url.clone()));
        }
        Err(format!(
            "unsupported database URL {url:?}: expected sqlite://PATH or postgres://..."
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: Config,
    }

    fn parse(args: &[&str]) -> Config {
        let mut all = vec!["holdfast"];
        all.extend_from_slice(args);
        Cli::parse_from(all).config
    }

    #[test]
    fn database_url_forms() {
        let c = parse(&["--data-dir", "/d"]);
        assert_eq!(c.database(), Ok(Database::Sqlite("/d/holdfast.db".into())));
        let c = parse(&["--database", "sqlite:///tmp/x.db"]);
        assert_eq!(c.database(), Ok(Database::Sqlite("/tmp/x.db".into())));
        let c = parse(&["--database", "postgres://u@db:5432/holdfast"]);
        assert_eq!(
            c.database(),
            Ok(Database::Postgres("postgres://u@db:5432/holdfast".into()))
        );
        let c = parse(&["--database", "mysql://x"]);
        assert!(c.database().is_err());
        // libpq's default database (PGDATABASE, else the user's name) is
        // not taken for one: the schema would land in it.
        if std::env::var_os("PGDATABASE").is_none() {
            for url in ["postgres://u@db:5432", "postgres://u@db:5432/"] {
                let err = parse(&["--database", url]).database().expect_err(url);
                assert!(err.contains("names no database"), "{err}");
            }
        }
    }

    #[test]
    fn host_id_is_a_word() {
        assert_eq!(
            parse(&["--host-id", "web-1"]).host_id.as_deref(),
            Some("web-1")
        );
        for bad in ["", "a b", "x\ny"] {
            let all = vec!["holdfast", "--host-id", bad];
            assert!(Cli::try_parse_from(all).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retention_forms() {
        assert_eq!(parse_retention("100"), Ok(Retention::Count(100)));
        assert_eq!(
            parse_retention("30m"),
            Ok(Retention::Age(Duration::from_secs(1800)))
        );
        assert_eq!(
            parse_retention("7d"),
            Ok(Retention::Age(Duration::from_secs(604_800)))
        );
        for bad in ["0", "x", "5w", "m", "0h", ""] {
            assert!(parse_retention(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn non_loopback_without_a_token_is_refused() {
        let c = parse(&["--listen", "0.0.0.0:7427"]);
        let err = c.check_exposure(&Tokens::default()).expect_err("refused");
        assert!(err.contains("auth token"), "{err}");
        let with = Tokens {
            auth: Some("t".into()),
            admin: None,
        };
        assert!(c.check_exposure(&with).is_ok());
        assert!(
            parse(&[]).check_exposure(&Tokens::default()).is_ok(),
            "loopback is fine"
        );
        assert!(
            parse(&["--listen", "none"])
                .check_exposure(&Tokens::default())
                .is_err()
        );
        assert_eq!(
            parse(&["--unix-socket-mode", "0600"]).unix_socket_mode,
            0o600
        );
    }

    #[test]
    fn max_connections_is_at_least_1024() {
        for bad in ["0", "10", "1023", "1000001"] {
            assert!(
                Cli::try_parse_from(["holdfast", "--max-connections", bad]).is_err(),
                "{bad}"
            );
        }
        assert_eq!(parse(&["--max-connections", "1024"]).max_connections, 1024);
        assert_eq!(parse(&[]).max_connections, 4096);
    }

    #[test]
    fn reconcile_interval_is_bounded() {
        let cli = Cli::try_parse_from(["holdfast", "--reconcile-interval-ms", "0"]);
        assert!(cli.is_err());
    }
}
