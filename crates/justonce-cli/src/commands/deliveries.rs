//! `justonce deliveries`: the deliveries waiting for their target, and each delivery's
//! attempts.

use super::output::{counted, one_line, print_table, utc_text};
use crate::cli::{DeliveriesCommand, ListArgs};
use anyhow::{Context, Result};
use justonce_cli_support::Usage;
use justonce_sql::{Attempt, Backend, Outbox, Row, RowFilter, RowSummary};

/// Runs one `deliveries` command on the outbox.
pub async fn run<DB: Backend>(outbox: &Outbox<DB>, command: DeliveriesCommand) -> Result<()> {
    match command {
        DeliveriesCommand::List { filter, .. } => {
            let rows = outbox.list_due(&filter.row_filter()).await?;
            if filter.json {
                print_json(&rows, Listed::Due);
                return Ok(());
            }
            print_table(
                "deliveries waiting",
                &[
                    "id",
                    "destination",
                    "key",
                    "attempts",
                    "waiting",
                    "next attempt",
                    "last error",
                ],
                rows.into_iter().map(|row| {
                    vec![
                        row.id.to_string(),
                        row.destination,
                        row.key,
                        row.attempts.to_string(),
                        format!("{} s", row.age.as_secs()),
                        match row.next_attempt_in.as_secs() {
                            0 => "now".to_owned(),
                            seconds => format!("in {seconds} s"),
                        },
                        one_line(row.last_error.as_deref().unwrap_or_default()),
                    ]
                }),
            );
        }
        DeliveriesCommand::Show { id: Some(id), .. } => show(outbox, id).await?,
        DeliveriesCommand::Show { key: Some(key), .. } => {
            let ids = outbox.ids_with_key(&key).await?;
            if ids.is_empty() {
                anyhow::bail!("no delivery has key {key}");
            }
            for (index, id) in ids.into_iter().enumerate() {
                if index > 0 {
                    println!();
                }
                show(outbox, id).await?;
            }
        }
        DeliveriesCommand::Show { .. } => {
            return Err(Usage("give a delivery's id, or --key".to_owned()).into());
        }
    }
    Ok(())
}

/// Prints one delivery with its attempts.
async fn show<DB: Backend>(outbox: &Outbox<DB>, id: i64) -> Result<()> {
    let row = outbox
        .get(id)
        .await?
        .with_context(|| format!("no delivery has id {id}"))?;
    let attempts = outbox.attempts(id).await?;
    print_row(&row, &attempts);
    Ok(())
}

impl ListArgs {
    /// The rows these arguments select.
    pub fn row_filter(&self) -> RowFilter {
        let mut filter = RowFilter::default().limit(self.limit);
        if let Some(destination) = &self.destination {
            filter = filter.destination(destination);
        }
        if let Some(since) = self.since {
            filter = filter.since(since);
        }
        if let Some(until) = self.until {
            filter = filter.until(until);
        }
        filter
    }
}

/// Which rows a JSON listing holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    Due,
    Dead,
}

/// Prints `rows` as one JSON array; due rows say when their next attempt is.
pub fn print_json(rows: &[RowSummary], listed: Listed) {
    let rows: Vec<serde_json::Value> = rows.iter().map(|row| summary_json(row, listed)).collect();
    println!("{}", serde_json::Value::from(rows));
}

/// One row of a listing as JSON, as `--json` prints it and the admin API answers it.
pub fn summary_json(row: &RowSummary, listed: Listed) -> serde_json::Value {
    let mut object = serde_json::json!({
        "id": row.id,
        "scope": (!row.scope.is_empty()).then_some(&row.scope),
        "key": row.key,
        "destination": row.destination,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "age_seconds": row.age.as_secs_f64(),
    });
    if listed == Listed::Due {
        object["next_attempt_in_seconds"] = row.next_attempt_in.as_secs_f64().into();
    }
    object
}

/// `sent`, `due` or `dead`.
pub fn state_of(row: &Row) -> &'static str {
    if row.sent {
        "sent"
    } else if row.dead {
        "dead"
    } else {
        "due"
    }
}

/// Prints a delivery: its state and last error, its headers, its attempts, then its body.
pub fn print_row(row: &Row, attempts: &[Attempt]) {
    let state = state_of(row);
    println!("id:          {}", row.id);
    println!("destination: {}", row.destination);
    println!("key:         {}", row.key);
    println!(
        "state:       {state} after {}",
        counted(row.attempts, "attempt", "attempts")
    );
    if let Some(error) = &row.last_error {
        println!("last error:  {error}");
    }
    for (name, value) in &row.headers {
        println!("header:      {name}: {value}");
    }
    println!();
    print_attempts(attempts);
    println!("{}", String::from_utf8_lossy(&row.payload));
}

/// Prints a delivery's attempts, oldest first, as a table.
pub fn print_attempts(attempts: &[Attempt]) {
    print_table(
        "attempts",
        &["attempt", "started", "took", "status", "error or answer"],
        attempts.iter().map(|attempt| {
            vec![
                attempt.attempt.to_string(),
                utc_text(attempt.started_at),
                format!("{} ms", attempt.duration.as_millis()),
                attempt
                    .status
                    .map_or_else(|| "-".to_owned(), |status| status.to_string()),
                one_line(
                    attempt
                        .error
                        .as_deref()
                        .or(attempt.answer.as_deref())
                        .unwrap_or_default(),
                ),
            ]
        }),
    );
}
