//! Deleting what is past its retention: each source's and consumer's keys, then their
//! delivered events, then the dashboard's duplicate counts as old as the oldest event kept. `justonce purge` runs it once; `justonce serve` every
//! `server.purge_every`.

use crate::config::Settings;
use anyhow::Result;
use justonce_cli_support::pacing::Pacer;
use justonce_cli_support::progress::Progress;
use justonce_sql::{Backend, Consumer, Inbox, Retention};
use std::future::Future;
use std::time::Duration;

/// Keys deleted per statement by the service's own purge, as `justonce purge` by default.
pub const SERVICE_BATCH: u32 = 1_000;

/// What to purge, taken from the settings before the service consumes them.
#[derive(Clone)]
pub struct Plan {
    /// Each source's and consumer's name, key retention and event retention.
    kept: Vec<(String, Retention, Duration)>,
    /// How long any delivered event is kept: the longest event retention, or the store's
    /// retention without sources and consumers. Deliveries of names no longer configured
    /// go after it.
    longest: Duration,
}

/// How many rows a purge deleted.
pub struct Purged {
    pub keys: u64,
    /// Delivered events (sent deliveries).
    pub sent: u64,
}

impl Plan {
    pub fn of(settings: &Settings) -> Result<Self> {
        let sources = settings
            .sources
            .iter()
            .map(|s| (s.name.clone(), s.retention, s.event_retention));
        let consumers =
            (settings.consumers.iter()).map(|c| (c.name.clone(), c.retention, c.event_retention));
        let kept: Vec<_> = sources.chain(consumers).collect();
        let longest = match kept.iter().map(|(_, _, events)| *events).max() {
            Some(longest) => longest,
            None => settings.store_retention()?.keep(),
        };
        Ok(Self { kept, longest })
    }

    /// Each source's and consumer's name and retention.
    pub fn kept(&self) -> impl Iterator<Item = (&str, Retention)> {
        self.kept
            .iter()
            .map(|(name, retention, _)| (name.as_str(), *retention))
    }

    /// Deletes in statements of `batch_size` rows, each paced by `pacer`, and reports each
    /// statement's progress to `progress` if given.
    pub async fn run<DB: Backend>(
        &self,
        inbox: &Inbox<DB>,
        batch_size: u32,
        pacer: &mut Pacer,
        mut progress: Option<&mut Progress>,
    ) -> Result<Purged> {
        let full = u64::from(batch_size.max(1));
        let mut keys = 0;
        for (name, retention, _) in &self.kept {
            let consumer = inbox.with_consumer(Consumer::new(name.as_str())?);
            let what = format!("keys of {name}");
            keys += until_short(full, pacer, &mut progress, &what, || {
                consumer.purge_batch(retention.keep(), batch_size)
            })
            .await?;
            let what = format!("counts of runs of {name}");
            until_short(full, pacer, &mut progress, &what, || {
                consumer.purge_runs_batch(retention.keep(), batch_size)
            })
            .await?;
        }
        let outbox = inbox.outbox();
        let mut sent = 0;
        // Each origin's delivered events past its own event retention, which is never
        // shorter than its keys'.
        for (name, _, event_retention) in &self.kept {
            let what = format!("delivered events of {name}");
            sent += until_short(full, pacer, &mut progress, &what, || {
                outbox.purge_events_batch(name, *event_retention, batch_size)
            })
            .await?;
        }
        sent += until_short(full, pacer, &mut progress, "sent deliveries", || {
            outbox.purge_sent_batch(self.longest, batch_size)
        })
        .await?;
        // The dashboard's per-minute duplicate counts, kept as long as any event.
        until_short(full, pacer, &mut progress, "duplicate counts", || {
            outbox.purge_duplicate_counts_batch(self.longest, batch_size)
        })
        .await?;
        Ok(Purged { keys, sent })
    }
}

/// Runs `statement` until it deletes fewer than `full` rows; the rows it deleted in all.
async fn until_short<F, Deleting>(
    full: u64,
    pacer: &mut Pacer,
    progress: &mut Option<&mut Progress>,
    what: &str,
    mut statement: F,
) -> Result<u64>
where
    F: FnMut() -> Deleting,
    Deleting: Future<Output = Result<u64, justonce_sql::Error>>,
{
    let mut purged = 0;
    loop {
        let batch = pacer.run(statement()).await?;
        purged += batch;
        if let Some(progress) = progress.as_deref_mut() {
            progress.update(format!("{what}: {purged} purged"));
        }
        if batch < full {
            break;
        }
    }
    if let Some(progress) = progress.as_deref_mut() {
        progress.finish();
    }
    Ok(purged)
}
