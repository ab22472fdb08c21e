//! One error for every way a command fails: the line it prints and the
//! exit code it ends with (CLI.md, "Exit codes").

use holdfast::api::error::Problem;

/// `eprintln!` that cannot panic: a closed stderr (`2>&-`, `2>&1 | head`)
/// loses the line, not the command (CLI.md: never a panic).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}
pub(crate) use say;

/// Wrong usage (clap uses the same code for its own usage errors).
pub const EXIT_USAGE: u8 = 2;
/// The server could not be reached, or stayed `busy`/`unavailable` (EX_UNAVAILABLE).
pub const EXIT_UNREACHABLE: u8 = 69;
/// The lease is held by someone else, or `run` lost it (EX_TEMPFAIL).
pub const EXIT_CONFLICT: u8 = 75;

#[derive(Debug)]
pub struct CliError {
    /// The API's `code`, or one of the client's own (`unreachable`, `local`, ...).
    pub code: String,
    pub detail: String,
    pub exit: u8,
    /// The problem the API answered, for callers that look into it.
    pub problem: Option<Box<Problem>>,
    /// That problem as the API wrote it, which `--json` prints.
    pub answer: Option<String>,
    /// Nothing to print: the reader of stdout went away (`| head`).
    quiet: bool,
}

impl CliError {
    pub fn new(code: &str, detail: impl Into<String>, exit: u8) -> Self {
        Self {
            code: code.to_owned(),
            detail: detail.into(),
            exit,
            problem: None,
            answer: None,
            quiet: false,
        }
    }

    pub fn unreachable(detail: impl Into<String>) -> Self {
        Self::new("unreachable", detail, EXIT_UNREACHABLE)
    }

    /// A failure on this side: a file, an answer that does not parse.
    pub fn local(detail: impl Into<String>) -> Self {
        Self::new("local", detail, 1)
    }

    /// Writing to stdout failed: exit 1. When the reader went away (a
    /// pipe to `head` or `grep -m1`), without a word, as a writer killed
    /// by SIGPIPE would end; otherwise with the reason.
    pub fn output(e: std::io::Error) -> Self {
        let mut err = Self::local(format!("writing the output: {e}"));
        err.quiet = e.kind() == std::io::ErrorKind::BrokenPipe;
        err
    }

    pub fn usage(detail: impl Into<String>) -> Self {
        Self::new("usage", detail, EXIT_USAGE)
    }

    /// `run` lost its lease while the command ran.
    pub fn lease_lost(detail: impl Into<String>, exit: u8) -> Self {
        Self::new("lease_lost", detail, exit)
    }

    /// What the API answered with a non-2xx status.
    pub fn api(status: u16, body: &[u8]) -> Self {
        let exit = |code: &str| match code {
            _ if status == 503 => EXIT_UNREACHABLE,
            "lease_held" => EXIT_CONFLICT,
            _ => 1,
        };
        let answer = Some(String::from_utf8_lossy(body).into_owned());
        if let Ok(problem) = serde_json::from_slice::<Problem>(body) {
            let flag = problem.field.as_deref().and_then(flag_of);
            return Self {
                code: problem.code.as_str().to_owned(),
                detail: match flag {
                    Some(flag) => format!("{} ({flag})", problem.detail),
                    None => problem.detail.clone(),
                },
                exit: exit(problem.code.as_str()),
                problem: Some(Box::new(problem)),
                answer,
                quiet: false,
            };
        }
        // A problem of a code (or shape) this build does not know.
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(v) if v["code"].is_string() => {
                let code = v["code"].as_str().unwrap_or_default();
                let mut e = Self::new(code, v["detail"].as_str().unwrap_or_default(), exit(code));
                e.answer = answer;
                e
            }
            _ => {
                let text = String::from_utf8_lossy(body);
                let text = text.trim();
                let detail = if text.is_empty() {
                    format!("the server answered {status} without a problem body")
                } else {
                    format!("the server answered {status}: {}", truncate(text, 200))
                };
                Self::new(&format!("http_{status}"), detail, exit(""))
            }
        }
    }

    /// A refusal of `field`, which this command took from `flag` rather
    /// than from the flag `flag_of` names (`run --lease` is an acquire's
    /// `resource`).
    pub fn field_from_flag(mut self, field: &str, flag: &str) -> Self {
        if let Some(p) = self
            .problem
            .as_ref()
            .filter(|p| p.field.as_deref() == Some(field))
        {
            self.detail = format!("{} ({flag})", p.detail);
        }
        self
    }

    pub fn is(&self, code: &str) -> bool {
        self.code == code
    }

    /// Print the one line that says what went wrong.
    pub fn report(&self) {
        if self.quiet {
            return;
        }
        say!("holdfast: {}: {}", self.code, self.detail);
    }
}

/// The flag (or argument) a member of a request body came from, for a
/// refusal that names the member: `ttl_ms must be between 1000 and
/// 86400000 (--ttl)`, where `--ttl 250ms` was typed. A member of a list
/// or map (`names.1`, `command.env.PATH`) came from its list's flag.
fn flag_of(field: &str) -> Option<&'static str> {
    let mut at = field;
    loop {
        if let Some(flag) = flag_of_member(at) {
            return Some(flag);
        }
        at = &at[..at.rfind('.')?];
    }
}

fn flag_of_member(field: &str) -> Option<&'static str> {
    Some(match field {
        "ttl_ms" => "--ttl",
        "wait_ms" => "--wait",
        "after" => "--after",
        "grace_ms" => "--grace",
        "holder" => "--holder",
        "resource" => "RESOURCE",
        "token" => "--token",
        "reason" => "--reason",
        "kind" => "--kind",
        "operation_id" => "--operation-id",
        "metadata" => "--metadata",
        "owner.pid" => "--owner-pid",
        "parent.id" | "parent.token" => "--parent",
        "lease.id" | "lease.token" => "--lease",
        "command.cwd" => "--cwd",
        "command.env" => "--env",
        "command.argv" => "COMMAND",
        "ports" | "names" => "--port",
        _ => return None,
    })
}

pub fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_problem() {
        let held = br#"{"type":"about:blank","title":"t","status":409,"code":"lease_held","detail":"r is held by h"}"#;
        let e = CliError::api(409, held);
        assert_eq!((e.code.as_str(), e.exit), ("lease_held", EXIT_CONFLICT));
        let busy =
            br#"{"type":"about:blank","title":"t","status":503,"code":"busy","detail":"busy"}"#;
        assert_eq!(CliError::api(503, busy).exit, EXIT_UNREACHABLE);
        let fenced =
            br#"{"type":"about:blank","title":"t","status":409,"code":"fenced","detail":"no"}"#;
        assert_eq!(CliError::api(409, fenced).exit, 1);
        let novel = br#"{"type":"about:blank","title":"t","status":409,"code":"request_in_progress","detail":"later"}"#;
        let e = CliError::api(409, novel);
        assert_eq!(
            (e.code.as_str(), e.detail.as_str(), e.exit),
            ("request_in_progress", "later", 1)
        );
        let e = CliError::api(502, b"<html>bad gateway</html>");
        assert_eq!((e.code.as_str(), e.exit), ("http_502", 1));
    }
}
