//! `holdfast events`: the log of state changes, read or followed.

use std::time::Duration;

use clap::Args;
use holdfast::api::events::EventsQuery;
use holdfast::model::{EventType, LeaseView, PortRecord, ProcessView};
use hyper::Method;
use serde::Deserialize;
use serde_json::Value;

use super::error::CliError;
use super::follow::Reconnect;
use super::http::{Client, success};
use super::sse;
use super::table::{Table, local_time, print_json_text};

/// One event as the API shows it, read with the crate's own records (the
/// server splices stored JSON and has no type of its own for it).
#[derive(Debug, Deserialize)]
pub struct Event {
    pub seq: i64,
    #[serde(with = "holdfast::time::ser")]
    pub at: holdfast::time::Millis,
    #[serde(rename = "type")]
    pub kind: String,
    pub lease: Option<LeaseView>,
    pub process: Option<ProcessView>,
    pub port: Option<PortRecord>,
}

#[derive(Debug, Deserialize)]
struct EventList {
    items: Vec<Value>,
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Events after this seq [default: from the oldest kept; with --follow, from now]
    #[arg(long, value_name = "SEQ", allow_negative_numbers = true)]
    after: Option<i64>,
    /// Keep printing events as they happen, until interrupted
    #[arg(long)]
    follow: bool,
    /// Only events of this type (lease.broken, process.exited, ...); repeatable
    #[arg(long = "type", value_name = "TYPE",
          value_parser = clap::builder::PossibleValuesParser::new(EventType::ALL.map(EventType::as_str)))]
    types: Vec<String>,
}

const PAGE: i64 = 1000;

pub async fn run(a: EventsArgs, client: &Client, json: bool) -> Result<(), CliError> {
    if a.follow {
        let follower = async {
            // Without --after it starts at the newest event: the server
            // has answered by then.
            let (after, reached) = match a.after {
                Some(after) => (after, false),
                None => (newest_seq(client).await?, true),
            };
            follow(client, after, &a.types, json, Reconnect::new(reached)).await
        };
        return super::follow::until_reader_gone(follower).await;
    }
    let mut after = a.after.unwrap_or(0);
    let mut pages: Vec<String> = Vec::new();
    let mut items: Vec<Value> = Vec::new();
    loop {
        let answer = client.get(&page_path(after, PAGE, None)).await?;
        let page: EventList = answer.json()?;
        let full = i64::try_from(page.items.len()).unwrap_or(0) >= PAGE;
        if let Some(last) = page.items.last().and_then(|e| e["seq"].as_i64()) {
            after = last;
        }
        pages.push(String::from_utf8_lossy(&answer.body).into_owned());
        items.extend(page.items.into_iter().filter(|e| wanted(e, &a.types)));
        if !full {
            break;
        }
    }
    if json {
        // One page unfiltered is what the API answered; otherwise the
        // items of every page, in the same shape.
        match (pages.as_slice(), a.types.is_empty()) {
            ([one], true) => print_json_text(one)?,
            _ => print_json_text(&serde_json::json!({ "items": items }).to_string())?,
        }
        return Ok(());
    }
    let mut t = Table::new(&["SEQ", "TIME", "TYPE", "SUBJECT"]);
    for e in items {
        let e: Event = parse(e)?;
        t.row(cells(&e));
    }
    t.print()?;
    Ok(())
}

fn page_path(after: i64, limit: i64, wait: Option<Duration>) -> String {
    let q = EventsQuery {
        after: Some(after),
        limit: Some(limit),
        wait_ms: wait.map(super::duration::ms),
    };
    format!(
        "/v1/events?{}",
        serde_urlencoded::to_string(&q).unwrap_or_default()
    )
}

fn wanted(e: &Value, types: &[String]) -> bool {
    types.is_empty()
        || e["type"]
            .as_str()
            .is_some_and(|t| types.iter().any(|w| w == t))
}

pub fn parse(e: Value) -> Result<Event, CliError> {
    serde_json::from_value(e)
        .map_err(|err| CliError::local(format!("an event does not parse: {err}")))
}

fn cells(e: &Event) -> Vec<String> {
    let subject = if let Some(l) = &e.lease {
        format!(
            "lease {} {} token {} ({})",
            l.id, l.resource, l.token, l.holder
        )
    } else if let Some(p) = &e.process {
        let pid = p.pid.map(|pid| format!(" pid {pid}")).unwrap_or_default();
        format!("process {} {}{pid}", p.id, p.kind)
    } else if let Some(p) = &e.port {
        format!("port {} {}", p.port, p.name)
    } else {
        String::new()
    };
    vec![e.seq.to_string(), local_time(e.at), e.kind.clone(), subject]
}

/// Stream events after `after` over SSE until interrupted; a dropped
/// stream is opened again from the last event seen.
async fn follow(
    client: &Client,
    mut after: i64,
    types: &[String],
    json: bool,
    mut reconnect: Reconnect,
) -> Result<(), CliError> {
    let mut header = !json;
    loop {
        let opened = async {
            let res = client
                .open(
                    Method::GET,
                    &format!("/v1/events?after={after}"),
                    None,
                    &[("accept", "text/event-stream".into())],
                )
                .await?;
            success(res).await
        };
        let res = match opened.await {
            Ok(res) => res,
            Err(e) => {
                reconnect.after(e).await?;
                continue;
            }
        };
        reconnect.connected();
        let mut reader = sse::Reader::new(res.into_body());
        while let Ok(Some(msg)) = reader.next().await {
            if msg.event == "error" {
                let v: Value = serde_json::from_str(&msg.data).unwrap_or_default();
                let code = v["code"].as_str().unwrap_or("stream_error");
                let detail = v["detail"].as_str().unwrap_or(&msg.data);
                // A store that failed mid-stream is an outage like any 503:
                // waited out, from the last event seen.
                if v["status"] == 503 {
                    let e = CliError::new(code, detail, super::error::EXIT_UNREACHABLE);
                    reconnect.after(e).await?;
                    break;
                }
                return Err(CliError::new(code, detail, 1));
            }
            let v: Value = serde_json::from_str(&msg.data)
                .map_err(|e| CliError::local(format!("an event does not parse: {e}")))?;
            after = v["seq"].as_i64().unwrap_or(after);
            if !wanted(&v, types) {
                continue;
            }
            if json {
                print_json_text(&msg.data)?;
            } else {
                // Rows go out as they come, so the widths are fixed, and
                // the header waits for the first (as `events` prints none
                // over an empty table).
                if std::mem::take(&mut header) {
                    super::table::print_text(&follow_row(["SEQ", "TIME", "TYPE", "SUBJECT"]))?;
                }
                let c = cells(&parse(v)?);
                super::table::print_text(&follow_row([&c[0], &c[1], &c[2], &c[3]]))?;
            }
        }
    }
}

fn follow_row([seq, time, kind, subject]: [&str; 4]) -> String {
    format!("{seq:>6}  {time:<19}  {kind:<18}  {subject}\n")
}

/// Whether an event follows `after`; Err(oldest kept) when retention
/// removed the events right after it.
async fn any_after(client: &Client, after: i64) -> Result<Result<bool, i64>, CliError> {
    match client.get(&page_path(after, 1, None)).await {
        Ok(a) => Ok(Ok(!a.json::<EventList>()?.items.is_empty())),
        Err(e) if e.is("events_pruned") => match e.problem.as_ref().and_then(|p| p.oldest_seq) {
            Some(oldest) => Ok(Err(oldest)),
            None => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// The seq of the newest event. The API has no call for it, so: probe
/// further ahead until no event follows, then halve the gap; the last
/// page is read whole. About 2·log(n / 1000) small reads.
pub async fn newest_seq(client: &Client) -> Result<i64, CliError> {
    // Invariant: an event follows `lo` (or lo = 0); none follows `hi`.
    let mut lo = 0;
    let mut probe = PAGE;
    let hi = loop {
        match any_after(client, probe).await? {
            Ok(true) => {
                lo = probe;
                probe = probe.saturating_mul(8);
            }
            Ok(false) => break probe,
            Err(oldest) => {
                lo = oldest - 1;
                probe = lo.saturating_add(PAGE).max(probe.saturating_mul(8));
            }
        }
    };
    let mut hi = hi;
    while hi - lo > PAGE {
        let mid = lo + (hi - lo) / 2;
        match any_after(client, mid).await? {
            Ok(true) => lo = mid,
            Ok(false) => hi = mid,
            Err(oldest) => lo = lo.max(oldest - 1),
        }
    }
    let page: EventList = client.get(&page_path(lo, PAGE, None)).await?.json()?;
    Ok(page
        .items
        .last()
        .and_then(|e| e["seq"].as_i64())
        .unwrap_or(lo))
}

/// Events after `after`, waiting up to `wait` for the first (a long poll).
pub async fn poll(client: &Client, after: i64, wait: Duration) -> Result<Vec<Value>, CliError> {
    let answer = client.get(&page_path(after, PAGE, Some(wait))).await?;
    Ok(answer.json::<EventList>()?.items)
}
