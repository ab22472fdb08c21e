//! Where the server is and which token to show it: flags, then the
//! environment, then the defaults (CLI.md, "Connecting").

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use clap::Args;

use super::error::CliError;
use super::http::{Client, Endpoint};
use super::url::{BaseUrl, parse_url};

/// Where `holdfast serve` listens by default.
const DEFAULT_AUTHORITY: &str = "127.0.0.1:7427";

/// Flags every client command takes, before or after its name.
#[derive(Debug, Args)]
pub struct ConnArgs {
    /// Server URL, plain http [env: HOLDFAST_URL] [default: http://127.0.0.1:7427,
    /// or the address in HOLDFAST_LISTEN when that is set]
    #[arg(long, global = true, value_name = "URL", value_parser = parse_url)]
    pub url: Option<BaseUrl>,

    /// Talk HTTP over this Unix socket instead of --url [env: HOLDFAST_SOCKET]
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// File holding the bearer token (wins over HOLDFAST_TOKEN, the token itself)
    /// [env: HOLDFAST_TOKEN_FILE]
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Print exactly what the API answered, as JSON
    #[arg(long, global = true)]
    pub json: bool,
}

/// What the environment says when no flag does.
#[derive(Debug, Default)]
pub struct Env {
    pub url: Option<String>,
    pub socket: Option<String>,
    pub listen: Option<String>,
    pub unix_socket: Option<String>,
    pub token: Option<String>,
    pub token_file: Option<String>,
}

impl Env {
    pub fn read() -> Self {
        let var = |k| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            url: var("HOLDFAST_URL"),
            socket: var("HOLDFAST_SOCKET"),
            listen: var("HOLDFAST_LISTEN"),
            unix_socket: var("HOLDFAST_UNIX_SOCKET"),
            token: var("HOLDFAST_TOKEN"),
            // Read here, not by clap, so that an empty one is unset, as
            // every other variable of the client's.
            token_file: var("HOLDFAST_TOKEN_FILE"),
        }
    }
}

impl ConnArgs {
    /// A client for the server these flags and `env` name. A flag beats
    /// any variable; `--socket` and HOLDFAST_SOCKET beat a URL of the same rank.
    pub fn client(&self, env: &Env) -> Result<Client, CliError> {
        let endpoint = self.endpoint(env)?;
        let token = self.token(env)?;
        Ok(Client::new(endpoint, token))
    }

    fn endpoint(&self, env: &Env) -> Result<Endpoint, CliError> {
        if let Some(path) = &self.socket {
            return Ok(Endpoint::Unix(path.clone()));
        }
        if let Some(url) = &self.url {
            return Ok(Endpoint::Tcp(url.clone()));
        }
        if let Some(path) = &env.socket {
            return Ok(Endpoint::Unix(path.into()));
        }
        if let Some(url) = &env.url {
            let url = parse_url(url).map_err(|e| CliError::usage(format!("HOLDFAST_URL: {e}")))?;
            return Ok(Endpoint::Tcp(url));
        }
        Ok(listen_endpoint(env).unwrap_or_else(|| {
            Endpoint::Tcp(BaseUrl {
                authority: DEFAULT_AUTHORITY.into(),
                prefix: String::new(),
            })
        }))
    }

    fn token(&self, env: &Env) -> Result<Option<String>, CliError> {
        let from_env = env.token_file.as_ref().map(PathBuf::from);
        let Some(path) = self.token_file.as_ref().or(from_env.as_ref()) else {
            return Ok(env.token.clone());
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::local(format!(
                "cannot read the token file {}: {e}",
                path.display()
            ))
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(CliError::local(format!(
                "the token file {} is empty",
                path.display()
            )));
        }
        Ok(Some(token.to_owned()))
    }
}

/// Where a server configured by the same environment listens: its
/// HOLDFAST_LISTEN address (an unspecified one reached on loopback), or its
/// HOLDFAST_UNIX_SOCKET when it listens on no TCP port.
fn listen_endpoint(env: &Env) -> Option<Endpoint> {
    let listen = env.listen.as_deref()?;
    if listen.eq_ignore_ascii_case("none") {
        return env.unix_socket.as_ref().map(|p| Endpoint::Unix(p.into()));
    }
    let mut addr: SocketAddr = listen.parse().ok()?;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    Some(Endpoint::Tcp(BaseUrl {
        authority: addr.to_string(),
        prefix: String::new(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(url: Option<&str>, socket: Option<&str>) -> ConnArgs {
        ConnArgs {
            url: url.map(|u| parse_url(u).expect("url")),
            socket: socket.map(PathBuf::from),
            token_file: None,
            json: false,
        }
    }

    fn tcp(authority: &str) -> Endpoint {
        Endpoint::Tcp(BaseUrl {
            authority: authority.into(),
            prefix: String::new(),
        })
    }

    #[test]
    fn flags_beat_the_environment() {
        let env = Env {
            url: Some("http://10.0.0.1:1".into()),
            socket: Some("/env.sock".into()),
            ..Env::default()
        };
        let e = |c: ConnArgs| c.endpoint(&env).expect("endpoint");
        assert_eq!(e(conn(Some("http://h:2"), None)), tcp("h:2"));
        assert_eq!(
            e(conn(Some("http://h:2"), Some("/f.sock"))),
            Endpoint::Unix("/f.sock".into())
        );
        assert_eq!(e(conn(None, None)), Endpoint::Unix("/env.sock".into()));
        let env = Env {
            url: Some("http://10.0.0.1:1".into()),
            ..Env::default()
        };
        assert_eq!(
            conn(None, None).endpoint(&env).expect("endpoint"),
            tcp("10.0.0.1:1")
        );
    }

    #[test]
    fn listen_address_is_the_default() {
        let at = |listen: &str| {
            let env = Env {
                listen: Some(listen.into()),
                unix_socket: Some("/run/hf.sock".into()),
                ..Env::default()
            };
            conn(None, None).endpoint(&env).expect("endpoint")
        };
        assert_eq!(at("0.0.0.0:9000"), tcp("127.0.0.1:9000"));
        assert_eq!(at("[::]:9000"), tcp("[::1]:9000"));
        assert_eq!(at("10.1.2.3:80"), tcp("10.1.2.3:80"));
        assert_eq!(at("none"), Endpoint::Unix("/run/hf.sock".into()));
        assert_eq!(
            conn(None, None)
                .endpoint(&Env::default())
                .expect("endpoint"),
            tcp("127.0.0.1:7427")
        );
    }
}
