//! Output for people: aligned columns and local times.

use std::io::Write;

use chrono::{Local, TimeZone};
use holdfast::time::Millis;

use super::error::CliError;

pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&'static str]) -> Self {
        Self {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Columns two spaces apart; the last one is not padded.
    pub fn render(&self) -> String {
        let head: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        let lines: Vec<&Vec<String>> = std::iter::once(&head).chain(&self.rows).collect();
        let mut widths = vec![0; self.header.len()];
        for line in &lines {
            for (w, cell) in widths.iter_mut().zip(line.iter()) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in lines {
            let last = line.len().saturating_sub(1);
            for (i, cell) in line.iter().enumerate() {
                out.push_str(cell);
                if i < last {
                    let pad = widths[i] - cell.chars().count() + 2;
                    out.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push('\n');
        }
        out
    }

    pub fn print(&self) -> Result<(), CliError> {
        print_text(&self.render())
    }
}

/// Write to stdout. Output that reached nowhere (a full disk, a closed
/// stdout) fails the command: an acquire whose id and token were never
/// written must not exit 0 (`CliError::output`).
pub fn print_text(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(CliError::output)
}

/// Resolves once nobody reads stdout any more: the pipe's reader closed
/// its end (`| grep -m1`). A follower waiting for the next event would
/// otherwise learn it only at its next write, which may never come. Never
/// resolves where that cannot be watched (a file, /dev/null).
#[allow(unsafe_code)]
pub async fn reader_gone() -> CliError {
    use std::os::fd::AsFd;
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;
    if let Ok(fd) = std::io::stdout().as_fd().try_clone_to_owned() {
        // SAFETY: the AsyncFd owns this duplicate, so the descriptor stays
        // open, and is not reused, for as long as it is registered.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::ERROR) };
        // A pipe's write end reports an error (EPOLLERR) once its reader is gone.
        if let Ok(fd) = registered
            && fd.ready(Interest::ERROR).await.is_ok()
        {
            return CliError::output(std::io::ErrorKind::BrokenPipe.into());
        }
    }
    std::future::pending().await
}

/// A JSON document on a line of its own.
pub fn print_json_text(text: &str) -> Result<(), CliError> {
    if text.ends_with('\n') {
        print_text(text)
    } else {
        print_text(&format!("{text}\n"))
    }
}

/// A time in this machine's zone, to the second.
pub fn local_time(ms: Millis) -> String {
    match Local.timestamp_millis_opt(ms).single() {
        Some(t) => t.format("%Y-%m-%d %H:%M:%S").to_string(),
        None => ms.to_string(),
    }
}

pub fn opt_time(ms: Option<Millis>) -> String {
    ms.map_or_else(|| "-".into(), local_time)
}

pub fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let mut t = Table::new(&["ID", "STATE", "HOLDER"]);
        t.row(vec!["1".into(), "active".into(), "me".into()]);
        t.row(vec!["22".into(), "released".into(), "you".into()]);
        assert_eq!(
            t.render(),
            "ID  STATE     HOLDER\n1   active    me\n22  released  you\n"
        );
    }
}
