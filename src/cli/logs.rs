//! `holdfast logs`: a spawned process's output, as raw bytes.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use holdfast::api::processes::{LogsQuery, Stream};
use holdfast::model::ProcessView;

use super::error::CliError;
use super::follow::{Reconnect, until_reader_gone};
use super::http::Client;
use super::parse;

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The spawned process's id
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
    if !a.follow {
        return drain(client, id, stream, &mut 0).await;
    }
    until_reader_gone(follow(client, id, stream)).await
}

/// New output as it is written, from the last offset read, until the
/// process has ended and all it wrote is out.
async fn follow(client: &Client, id: &str, stream: Stream) -> Result<(), CliError> {
    let mut offset = 0;
    let mut reconnect = Reconnect::new(false);
    loop {
        match step(client, id, stream, &mut offset).await {
            Ok(true) => return Ok(()),
            Ok(false) => reconnect.connected(),
            Err(e) => {
                reconnect.after(e).await?;
                continue;
            }
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Print what the log holds past `offset`; true once the process has ended
/// and nothing more is left.
async fn step(
    client: &Client,
    id: &str,
    stream: Stream,
    offset: &mut i64,
) -> Result<bool, CliError> {
    drain(client, id, stream, offset).await?;
    let p: ProcessView = client.get(&format!("/v1/processes/{id}")).await?.json()?;
    if p.state.is_current() {
        return Ok(false);
    }
    // It has ended: what it wrote before is all there is, once read.
    drain(client, id, stream, offset).await?;
    Ok(true)
}

/// Print what the log holds past `offset`, chunk by chunk, to its end.
async fn drain(
    client: &Client,
    id: &str,
    stream: Stream,
    offset: &mut i64,
) -> Result<(), CliError> {
    while let n @ 1.. = read_from(client, id, stream, *offset).await? {
        *offset += n;
    }
    Ok(())
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
        .map_err(CliError::output)?;
    Ok(i64::try_from(answer.body.len()).unwrap_or(0))
}
