//! Command-line flags, each also read from a `HOLDFAST_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Address and port of the HTTP listener.
    #[arg(long, env = "HOLDFAST_LISTEN", default_value = "127.0.0.1:7427")]
    pub listen: SocketAddr,

    /// Directory for the SQLite database (and, later, process logs).
    /// Default: $XDG_STATE_HOME/holdfast, else ~/.local/state/holdfast.
    #[arg(long, env = "HOLDFAST_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Store URL: sqlite://PATH. Default: sqlite://<data-dir>/holdfast.db.
    #[arg(long, env = "HOLDFAST_DATABASE_URL")]
    pub database: Option<String>,

    /// How often the reconciler ends expired and dead-owner leases.
    #[arg(long, env = "HOLDFAST_RECONCILE_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub reconcile_interval_ms: u64,

    /// This host's id in recorded identities (default: /etc/machine-id, else the hostname).
    #[arg(long, env = "HOLDFAST_HOST_ID")]
    pub host_id: Option<String>,
}

/// Where the store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    Sqlite(PathBuf),
}

impl Config {
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
        let Some(url) = &self.database else {
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
            return Err("PostgreSQL is not supported yet by this build; use sqlite://PATH".into());
        }
        Err(format!(
            "unsupported database URL {url:?}: expected sqlite://PATH"
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
        let c = parse(&["--database", "mysql://x"]);
        assert!(c.database().is_err());
    }

    #[test]
    fn reconcile_interval_is_bounded() {
        let cli = Cli::try_parse_from(["holdfast", "--reconcile-interval-ms", "0"]);
        assert!(cli.is_err());
    }
}
