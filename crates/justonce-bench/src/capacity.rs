//! The capacity section: what keys and outbox rows cost the database. Keys are claimed
//! with `claim_many`, then purged by age in the library's purge batches; outbox rows with
//! a 1 KiB body are written, delivered by the library's relay to a destination in this
//! process that takes each at once, then purged once sent. Each step reports its rows per
//! second, the write-ahead log it wrote, and the table's and indexes' bytes after it.
//!
//! Sizes are exact. Rates depend on the machine, and the log position is the whole
//! server's: measure on a server nothing else writes to for a figure of the bench alone.

use crate::bench::Bench;
use crate::db::{BenchDb, Sizes};
use anyhow::{Result, ensure};
use justonce_cli_support::progress::Progress;
use justonce_sql::{
    Answer, Claim, Delivered, Delivery, Destination, Inbox, Key, Message, RelayOptions, Retention,
};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// The bytes of each outbox row's body.
pub(crate) const BODY_BYTES: usize = 1024;
/// The outbox rows' destination.
const DESTINATION: &str = "capacity";
/// Rows the relay takes per round: its default.
const RELAY_BATCH: u32 = 100;
/// How old a key must be for the capacity section's purge: the keys are claimed just
/// before, and the purge takes those older than this.
const PURGE_AGE: Duration = Duration::from_secs(1);

/// What one step of the capacity section did, and the table after it.
pub(crate) struct Step {
    pub(crate) name: &'static str,
    pub(crate) rows: u64,
    /// Rows per transaction, or per purge statement.
    pub(crate) batch: u64,
    pub(crate) took: Duration,
    /// Write-ahead log bytes the server wrote meanwhile, where it tells.
    pub(crate) log_bytes: Option<u64>,
    /// The table the step wrote, after it.
    pub(crate) sizes: Sizes,
}

impl<DB: BenchDb> Bench<'_, DB> {
    /// Claims, sizes and purges the keys, then writes, delivers, sizes and purges the
    /// outbox rows, reporting each step.
    pub(crate) async fn capacity(&self) -> Result<()> {
        self.empty().await?;
        let mut progress = Progress::new();
        let claimed = self.claim_keys(&mut progress).await?;
        self.report.capacity(&claimed);
        let purged = self.purge_keys(&mut progress).await?;
        self.report.capacity(&purged);
        for step in self.outbox_steps(&mut progress).await? {
            self.report.capacity(&step);
        }
        progress.finish();
        Ok(())
    }

    /// `--capacity-keys` new keys, claimed with `claim_many` in transactions of the first
    /// `--batch`.
    async fn claim_keys(&self, progress: &mut Progress) -> Result<Step> {
        let count = self.settings.capacity_keys as u64;
        let batch = self.settings.batches.first().copied().unwrap_or(1_000) as u64;
        let (took, log_bytes) = self
            .timed(async {
                let mut at = 0;
                while at < count {
                    if at % 100_000 < batch {
                        progress.update(format!("capacity: {at} of {count} keys claimed"));
                    }
                    let until = (at + batch).min(count);
                    let keys: Vec<Key> = (at..until).map(capacity_key).collect::<Result<_>>()?;
                    let messages: Vec<(Key, &[u8])> = keys
                        .iter()
                        .map(|key| (key.clone(), key.as_str().as_bytes()))
                        .collect();
                    let mut tx = self.inbox.begin().await?;
                    let claims = self.inbox.claim_many(&mut tx, &messages).await?;
                    tx.commit().await?;
                    ensure!(
                        claims.iter().all(|claim| *claim == Claim::First),
                        "a new key was not claimed first"
                    );
                    at = until;
                }
                Ok(())
            })
            .await?;
        let rows = DB::count(self.inbox.pool(), &self.tables.keys).await?;
        ensure!(
            rows == count as i64,
            "{rows} keys stored of {count} claimed"
        );
        Ok(Step {
            name: "keys claimed",
            rows: count,
            batch,
            took,
            log_bytes,
            sizes: self.sizes(&self.tables.keys).await?,
        })
    }

    /// Every key, once old enough, purged by age with `Inbox::purge_batch`, `--purge-batch`
    /// per statement, flat out.
    async fn purge_keys(&self, progress: &mut Progress) -> Result<Step> {
        // The bench's inbox keeps keys a day; this one, on the same tables, a second.
        let options = (self.options.clone()).retention(Retention::new(PURGE_AGE, PURGE_AGE)?);
        let purger = Inbox::from_pool(
            self.inbox.pool().clone(),
            self.inbox.consumer().clone(),
            options,
        )?;
        // `processed_at` is the claiming transaction's start, on the database's clock.
        tokio::time::sleep(PURGE_AGE * 2).await;
        let batch = self.settings.purge_batch;
        let count = self.settings.capacity_keys as u64;
        progress.update(format!("capacity: purging {count} keys"));
        let mut purged = 0;
        let (took, log_bytes) = self
            .timed(async {
                loop {
                    let deleted = purger.purge_batch(PURGE_AGE, batch).await?;
                    purged += deleted;
                    if deleted < u64::from(batch) {
                        return Ok(());
                    }
                }
            })
            .await?;
        ensure!(purged == count, "purged {purged} keys of {count}");
        let left = DB::count(self.inbox.pool(), &self.tables.keys).await?;
        ensure!(left == 0, "{left} keys left after the purge");
        Ok(Step {
            name: "keys purged",
            rows: purged,
            batch: u64::from(batch),
            took,
            log_bytes,
            sizes: self.sizes(&self.tables.keys).await?,
        })
    }

    /// `--capacity-outbox` rows with a 1 KiB body, written with `Inbox::forward` in
    /// transactions of the first `--batch`; delivered by the relay, each attempt recorded in
    /// its row's history; purged once sent, `--purge-batch` per statement.
    async fn outbox_steps(&self, progress: &mut Progress) -> Result<Vec<Step>> {
        let count = self.settings.capacity_outbox as u64;
        let batch = self.settings.batches.first().copied().unwrap_or(1_000) as u64;
        let pool = self.inbox.pool();
        let table = &self.tables.outbox;
        progress.update(format!("capacity: writing {count} outbox rows"));
        let mut first_id = None;
        let (took, log_bytes) = self
            .timed(async {
                let mut at = 0;
                while at < count {
                    let until = (at + batch).min(count);
                    let mut tx = self.inbox.begin().await?;
                    for n in at..until {
                        let key = capacity_key(n)?;
                        let message = Message::new(DESTINATION, event_body(&key));
                        let id = self.inbox.forward(&mut tx, &key, message).await?;
                        first_id.get_or_insert(id);
                    }
                    tx.commit().await?;
                    at = until;
                }
                Ok(())
            })
            .await?;
        let rows = DB::count(pool, table).await?;
        ensure!(
            rows == count as i64,
            "{rows} outbox rows of {count} written"
        );
        let written = Step {
            name: "outbox written",
            rows: count,
            batch,
            took,
            log_bytes,
            sizes: self.sizes(table).await?,
        };

        progress.update(format!("capacity: delivering {count} outbox rows"));
        let outbox = self.inbox.outbox();
        let relay = (outbox.relay())
            .destination(DESTINATION, Accepting)
            .options(RelayOptions::default().batch_size(RELAY_BATCH));
        let mut sent = 0;
        let (took, log_bytes) = self
            .timed(async {
                loop {
                    let round = relay.relay_once().await?;
                    sent += round.sent as u64;
                    if round.taken == 0 {
                        return Ok(());
                    }
                }
            })
            .await?;
        ensure!(sent == count, "{sent} outbox rows sent of {count}");
        if let Some(id) = first_id {
            let attempts = outbox.attempts(id).await?;
            ensure!(
                attempts.len() == 1,
                "{} attempts in a delivered row's history",
                attempts.len()
            );
        }
        let delivered = Step {
            name: "outbox delivered",
            rows: sent,
            batch: u64::from(RELAY_BATCH),
            took,
            log_bytes,
            sizes: self.sizes(table).await?,
        };

        progress.update(format!("capacity: purging {count} sent outbox rows"));
        let purge_batch = self.settings.purge_batch;
        let mut purged = 0;
        let (took, log_bytes) = self
            .timed(async {
                loop {
                    let deleted = outbox.purge_sent_batch(Duration::ZERO, purge_batch).await?;
                    purged += deleted;
                    if deleted < u64::from(purge_batch) {
                        return Ok(());
                    }
                }
            })
            .await?;
        ensure!(
            purged == count,
            "purged {purged} sent outbox rows of {count}"
        );
        let purged = Step {
            name: "outbox purged",
            rows: purged,
            batch: u64::from(purge_batch),
            took,
            log_bytes,
            sizes: self.sizes(table).await?,
        };
        Ok(vec![written, delivered, purged])
    }

    /// What `table` takes, its indexes named without the bench's table prefix.
    async fn sizes(&self, table: &str) -> Result<Sizes> {
        let mut sizes = DB::sizes(self.inbox.pool(), table).await?;
        let prefix = crate::tables_prefix();
        for (name, _) in &mut sizes.indexes {
            *name = name.replace(&prefix, "");
        }
        Ok(sizes)
    }

    /// How long `work` took, and the write-ahead log the server wrote meanwhile.
    async fn timed(
        &self,
        work: impl Future<Output = Result<()>>,
    ) -> Result<(Duration, Option<u64>)> {
        let before = DB::log_position(self.inbox.pool()).await?;
        let started = Instant::now();
        work.await?;
        let took = started.elapsed();
        let after = DB::log_position(self.inbox.pool()).await?;
        Ok((took, after.zip(before).map(|(a, b)| a.saturating_sub(b))))
    }
}

/// Key `n` of the capacity section, shaped as a webhook source's event id
/// (`source:evt_` and 32 hex digits, 43 bytes), and spread over the key space as
/// random ids are, so that the primary key's pages split as they do in use.
fn capacity_key(n: u64) -> Result<Key> {
    let digest = Sha256::digest(n.to_le_bytes());
    let mut key = String::from("source:evt_");
    for byte in &digest[..16] {
        write!(key, "{byte:02x}")?;
    }
    Ok(Key::new(key)?)
}

/// A JSON event of exactly [`BODY_BYTES`] bytes about `key`.
fn event_body(key: &Key) -> Vec<u8> {
    let mut body = format!(
        "{{\"id\":\"{}\",\"type\":\"invoice.paid\",\"data\":\"",
        key.as_str()
    );
    let filler = BODY_BYTES.saturating_sub(body.len() + 2);
    body.extend(key.as_str().chars().cycle().take(filler));
    body.push_str("\"}");
    body.into_bytes()
}

/// A destination that takes every delivery at once and answers as a webhook receiver
/// does, so that each row's history holds a status and the start of an answer.
struct Accepting;

impl Destination for Accepting {
    fn deliver<'a>(
        &'a self,
        _delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        Box::pin(async { Delivered::Sent })
    }

    fn deliver_answered<'a>(
        &'a self,
        _delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = (Delivered, Answer)> + Send + 'a>> {
        Box::pin(async { (Delivered::Sent, Answer::http(200, "{\"received\":true}")) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_43_bytes_and_bodies_1_kib() {
        let key = capacity_key(7).unwrap();
        assert_eq!(key.as_str().len(), 43, "{key}");
        assert_ne!(key, capacity_key(8).unwrap());
        let body = event_body(&key);
        assert_eq!(body.len(), BODY_BYTES);
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["id"], key.as_str());
    }
}
