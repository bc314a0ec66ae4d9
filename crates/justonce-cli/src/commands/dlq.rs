//! `justonce dlq`: list, show, replay and purge dead letters.

use super::deliveries::{Listed, print_json, print_row};
use super::output::{confirm, counted, one_line, print_table};
use crate::cli::DlqCommand;
use anyhow::{Context, Result};
use justonce_cli_support::progress::Progress;
use justonce_sql::{Backend, Outbox};

/// Dead letters replayed per statement by `dlq replay --all`.
const REPLAY_BATCH: u32 = 1_000;

/// Runs one `dlq` command on the outbox.
pub async fn run<DB: Backend>(outbox: &Outbox<DB>, command: DlqCommand) -> Result<()> {
    match command {
        DlqCommand::List { filter } => {
            let rows = outbox.list_dead(&filter.row_filter()).await?;
            if filter.json {
                print_json(&rows, Listed::Dead);
                return Ok(());
            }
            print_table(
                "dead letters",
                &["id", "destination", "key", "attempts", "last error"],
                rows.into_iter().map(|row| {
                    vec![
                        row.id.to_string(),
                        row.destination,
                        row.key,
                        row.attempts.to_string(),
                        one_line(row.last_error.as_deref().unwrap_or_default()),
                    ]
                }),
            );
        }
        DlqCommand::Show { id } => {
            let row = outbox
                .get(id)
                .await?
                .with_context(|| format!("no delivery has id {id}"))?;
            print_row(&row, &outbox.attempts(id).await?);
        }
        DlqCommand::Replay { id: Some(id), .. } => {
            if !outbox.replay(id).await? {
                anyhow::bail!("delivery {id} is not a dead letter");
            }
            println!("delivery {id} is due again");
        }
        DlqCommand::Replay { id: None, .. } => {
            // Bounded by the count at the start: a replayed row that dies again during the
            // replay is not replayed twice.
            let dead = u64::try_from(outbox.stats().await?.dead).unwrap_or(0);
            let mut progress = Progress::new();
            let mut replayed = 0;
            while replayed < dead {
                let batch = outbox.replay_batch(REPLAY_BATCH).await?;
                replayed += batch;
                progress.update(format!("dead letters: {replayed} of {dead} due again"));
                if batch < u64::from(REPLAY_BATCH) {
                    break;
                }
            }
            progress.finish();
            match replayed {
                1 => println!("1 dead letter is due again"),
                _ => println!("{replayed} dead letters are due again"),
            }
        }
        DlqCommand::Purge { yes } => {
            let dead = outbox.stats().await?.dead;
            confirm(
                &format!(
                    "Delete {} for good?",
                    counted(dead, "dead letter", "dead letters")
                ),
                yes,
            )?;
            let deleted = outbox.purge_dead_letters().await?;
            println!(
                "{} deleted",
                counted(deleted, "dead letter", "dead letters")
            );
        }
    }
    Ok(())
}
