//! `holdfast logs`: a spawned process's output, as raw bytes.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use holdfast::api::processes::{LogsQuery, Stream};
use holdfast::model::ProcessView;

use super::error::{CliError, EXIT_UNREACHABLE};
use super::http::Client;
use super::parse;

#[derive(Debug, Args)]
pub struct LogsArgs {
    id: String,
    /// The standard error instead of the standard output
    #[arg(long)]
    stderr: bool,
    /// Keep printing new output until the process has ended (or until interrupted)
    #[arg(long)]
    follow: bool,
}

/// The API has no long poll for logs: a follower looks again this often.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);
const CHUNK: i64 = 1 << 20;

pub async fn run(a: LogsArgs, client: &Client) -> Result<(), CliError> {
    let id = parse::path_segment(&a.id)?;
    let stream = if a.stderr {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    let mut offset = 0;
    let mut failures = 0;
    loop {
        let read = read_from(client, id, stream, offset).await;
        let got = match read {
            Ok(n) => n,
            Err(e) if a.follow && e.exit == EXIT_UNREACHABLE && failures < 5 => {
                failures += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        failures = 0;
        offset += got;
        if got > 0 {
            continue;
        }
        if !a.follow {
            return Ok(());
        }
        let p: ProcessView = client.get(&format!("/v1/processes/{id}")).await?.json()?;
        if !p.state.is_current() {
            // It has ended: what it wrote before is all there is, once read.
            while let n @ 1.. = read_from(client, id, stream, offset).await? {
                offset += n;
            }
            return Ok(());
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Copy what the log holds from `offset` (up to a chunk) to stdout.
async fn read_from(
    client: &Client,
    id: &str,
    stream: Stream,
    offset: i64,
) -> Result<i64, CliError> {
    let q = LogsQuery {
        stream: Some(stream),
        offset: Some(offset),
        limit: Some(CHUNK),
    };
    let query = serde_urlencoded::to_string(&q).unwrap_or_default();
    let answer = client
        .get(&format!("/v1/processes/{id}/logs?{query}"))
        .await?;
    let mut out = std::io::stdout().lock();
    out.write_all(&answer.body)
        .and_then(|()| out.flush())
        .map_err(|e| CliError::local(format!("writing the output: {e}")))?;
    Ok(i64::try_from(answer.body.len()).unwrap_or(0))
}
