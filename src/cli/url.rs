//! The `--url` a client connects to.

/// An `http://host[:port][/prefix]` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// As given, for the `Host` header.
    pub authority: String,
    /// Path prefix without a trailing slash (empty for none).
    pub prefix: String,
}

impl BaseUrl {
    /// `host:port` to connect to (port 80 when the URL names none).
    pub fn address(&self) -> String {
        let has_port = self.authority.rsplit_once(':').is_some_and(|(host, port)| {
            !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!host.contains(':') || host.ends_with(']'))
        });
        if has_port {
            self.authority.clone()
        } else {
            format!("{}:80", self.authority)
        }
    }
}

pub fn parse_url(s: &str) -> Result<BaseUrl, String> {
    let rest = s
        .strip_prefix("http://")
        .ok_or_else(|| {
            if s.starts_with("https://") {
                format!("{s:?}: holdfast serves plain HTTP; put TLS in front of it and keep the CLI on the local side")
            } else {
                format!("{s:?} is not a URL like http://127.0.0.1:7427")
            }
        })?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) {
        return Err(format!("{s:?} is not a URL like http://127.0.0.1:7427"));
    }
    Ok(BaseUrl {
        authority: authority.to_owned(),
        prefix: path.trim_end_matches('/').to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = parse_url("http://localhost:8080/hf/").expect("parses");
        assert_eq!(
            (u.authority.as_str(), u.prefix.as_str()),
            ("localhost:8080", "/hf")
        );
        assert_eq!(u.address(), "localhost:8080");
        assert_eq!(
            parse_url("http://example").expect("parses").address(),
            "example:80"
        );
        assert_eq!(
            parse_url("http://[::1]").expect("parses").address(),
            "[::1]:80"
        );
        assert_eq!(
            parse_url("http://[::1]:9").expect("parses").address(),
            "[::1]:9"
        );
        for bad in ["https://x", "127.0.0.1:7427", "http://", "http://u@h/"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
