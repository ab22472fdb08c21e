//! `holdfast ports list`: current port reservations.

use clap::{Args, Subcommand};
use holdfast::api::ports::ListQuery;
use holdfast::model::PortRecord;

use super::error::CliError;
use super::http::Client;
use super::list;
use super::table::{Table, local_time};

#[derive(Debug, Subcommand)]
pub enum PortsCmd {
    /// Ports reserved now, by lease or process.
    List(ListArgs),
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Every page, not only the first
    #[arg(long)]
    all: bool,
}

pub async fn run(cmd: PortsCmd, client: &Client, json: bool) -> Result<(), CliError> {
    let PortsCmd::List(a) = cmd;
    let query = ListQuery {
        limit: None,
        cursor: None,
    };
    let listing = list::fetch::<PortRecord>(client, "/v1/ports", &query, a.all).await?;
    if json {
        super::table::print_json_text(&listing.json)?;
        return Ok(());
    }
    let mut t = Table::new(&["PORT", "NAME", "OWNER", "RESERVED"]);
    for p in &listing.items {
        let owner = p.owner.target().map_or_else(
            || "-".into(),
            |o| format!("{} {}:{}", p.owner.kind(), o.id, o.token),
        );
        t.row(vec![
            p.port.to_string(),
            p.name.clone(),
            owner,
            local_time(p.reserved_at),
        ]);
    }
    listing.print_table(&t)?;
    Ok(())
}
