//! `justonce stats`: what the store holds, as tables or one JSON object.

use super::output::{print_table, scope_or_none};
use anyhow::Result;
use justonce_sql::{BackedOff, Backend, Inbox, KeyCount, OutboxStats, StoredOffset};

/// What the store holds: the keys per consumer and scope, the deliveries, the backed-off
/// destinations and the stream offsets.
pub struct Stats {
    keys: Vec<KeyCount>,
    deliveries: OutboxStats,
    backed_off: Vec<BackedOff>,
    offsets: Vec<StoredOffset>,
}

impl Stats {
    /// Reads them from the store.
    pub async fn read<DB: Backend>(inbox: &Inbox<DB>) -> Result<Self, justonce_sql::Error> {
        Ok(Self {
            keys: inbox.key_counts().await?,
            deliveries: inbox.outbox().stats().await?,
            backed_off: inbox.outbox().backed_off().await?,
            offsets: inbox.all_offsets().await?,
        })
    }

    /// As one JSON object, as `stats --json` prints it and the admin API answers it.
    pub fn to_json(&self) -> serde_json::Value {
        let Self {
            keys,
            deliveries,
            backed_off,
            offsets,
        } = self;
        serde_json::json!({
            "keys": keys.iter().map(|count| serde_json::json!({
                "consumer": count.consumer,
                "scope": (!count.scope.is_empty()).then_some(&count.scope),
                "keys": count.keys,
                "in_progress": count.in_progress,
            })).collect::<Vec<_>>(),
            "deliveries": {
                "sent": deliveries.sent,
                "due": deliveries.due,
                "dead": deliveries.dead,
                "oldest_due_age_seconds": deliveries.oldest_due.as_secs_f64(),
            },
            "backed_off": backed_off.iter().map(|destination| serde_json::json!({
                "destination": destination.destination,
                "scope": (!destination.scope.is_empty()).then_some(&destination.scope),
                "failures": destination.failures,
                "pause_left_seconds": destination.pause_left.as_secs_f64(),
                "since_seconds": destination.since.as_secs_f64(),
            })).collect::<Vec<_>>(),
            "offsets": offsets.iter().map(|stored| serde_json::json!({
                "consumer": stored.consumer,
                "stream": stored.stream,
                "partition": stored.partition,
                "position": stored.offset.position,
                "sequence": stored.offset.sequence,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Prints the keys per consumer and scope, the deliveries, the backed-off destinations and
/// the stream offsets.
pub async fn print<DB: Backend>(inbox: &Inbox<DB>, json: bool) -> Result<()> {
    let stats = Stats::read(inbox).await?;
    if json {
        println!("{}", stats.to_json());
        return Ok(());
    }
    let Stats {
        keys,
        deliveries,
        backed_off,
        offsets,
    } = stats;
    print_table(
        "keys",
        &["consumer", "scope", "keys", "in progress"],
        keys.iter().map(|count| {
            vec![
                count.consumer.clone(),
                scope_or_none(&count.scope).to_owned(),
                count.keys.to_string(),
                count.in_progress.to_string(),
            ]
        }),
    );
    print_table(
        "deliveries",
        &["sent", "due", "dead", "oldest due"],
        vec![vec![
            deliveries.sent.to_string(),
            deliveries.due.to_string(),
            deliveries.dead.to_string(),
            // Nothing due has no age.
            match deliveries.due {
                0 => "(none)".to_owned(),
                _ => format!("{} s", deliveries.oldest_due.as_secs()),
            },
        ]],
    );
    print_table(
        "backed-off destinations",
        &["destination", "scope", "failures", "pause left", "since"],
        backed_off.iter().map(|destination| {
            vec![
                destination.destination.clone(),
                scope_or_none(&destination.scope).to_owned(),
                destination.failures.to_string(),
                format!("{} s", destination.pause_left.as_secs()),
                format!("{} s ago", destination.since.as_secs()),
            ]
        }),
    );
    print_table(
        "offsets",
        &["consumer", "stream", "partition", "position", "sequence"],
        offsets.iter().map(|stored| {
            vec![
                stored.consumer.clone(),
                stored.stream.clone(),
                stored.partition.to_string(),
                stored.offset.position.to_string(),
                stored.offset.sequence.to_string(),
            ]
        }),
    );
    println!(
        "Duplicates and key reuses are not stored: the running service counts them since it \
         started, on the admin listener's /metrics."
    );
    Ok(())
}
