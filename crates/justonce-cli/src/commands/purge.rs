//! `justonce purge`: delete keys and sent deliveries past each source's retention.

use super::output::counted;
use crate::config::Settings;
use crate::purge::Plan;
use anyhow::Result;
use justonce_cli_support::pacing::Pacer;
use justonce_cli_support::progress::Progress;
use justonce_sql::{Backend, Inbox};

/// Purges in statements of `batch_size` rows, each after a pause `pause` times as long as
/// the last one took, and says how many rows went.
pub async fn run<DB: Backend>(
    settings: &Settings,
    inbox: &Inbox<DB>,
    batch_size: u32,
    pause: f64,
) -> Result<()> {
    // One pacer for the whole purge: every statement loads the same database.
    let mut pacer = Pacer::new(pause);
    let mut progress = Progress::new();
    let purged = Plan::of(settings)?
        .run(inbox, batch_size, &mut pacer, Some(&mut progress))
        .await?;
    println!(
        "purged {} and {}",
        counted(purged.keys, "key", "keys"),
        counted(purged.sent, "sent delivery", "sent deliveries")
    );
    Ok(())
}
