//! The bench's state: its inbox, its tables and its report, and how it fills and empties
//! the tables.

use crate::args::Settings;
use crate::db::{BenchDb, BenchTables};
use crate::report::Report;
use anyhow::Result;
use justonce_cli_support::progress::Progress;
use justonce_sql::{Inbox, InboxOptions};
use std::sync::atomic::AtomicI64;
use std::time::Duration;

/// A run of the bench on one database.
pub(crate) struct Bench<'s, DB: BenchDb> {
    pub(crate) tables: BenchTables,
    pub(crate) inbox: Inbox<DB>,
    /// The inbox's options, for a fresh inbox on the same pool.
    pub(crate) options: InboxOptions,
    /// The claim id of each hand-written batch: what tells its new keys on MySQL, which
    /// has no RETURNING.
    pub(crate) hand_claim_ids: AtomicI64,
    pub(crate) settings: &'s Settings,
    pub(crate) report: Report,
}

impl<DB: BenchDb> Bench<'_, DB> {
    /// The same bench with an inbox that remembers no keys yet.
    pub(crate) fn with_fresh_inbox(&self) -> Result<Self> {
        let inbox = Inbox::from_pool(
            self.inbox.pool().clone(),
            self.inbox.consumer().clone(),
            self.options.clone(),
        )?;
        Ok(Self {
            tables: self.tables.clone(),
            inbox,
            options: self.options.clone(),
            hand_claim_ids: AtomicI64::new(1),
            settings: self.settings,
            report: self.report.clone(),
        })
    }

    /// Adds keys `from..to`, processed `age` ago, in statements of 100,000.
    pub(crate) async fn fill(
        &self,
        progress: &mut Progress,
        from: u64,
        to: u64,
        age: Duration,
    ) -> Result<()> {
        let mut at = from;
        while at < to {
            let until = (at + 100_000).min(to);
            progress.update(format!("filling the key table: {at} of {to} keys"));
            DB::fill(self.inbox.pool(), &self.tables.keys, at, until, age).await?;
            at = until;
        }
        progress.update(format!("filling the key table: {to} of {to} keys"));
        progress.finish();
        Ok(())
    }

    pub(crate) async fn empty(&self) -> Result<()> {
        for table in [&self.tables.keys, &self.tables.effects, &self.tables.outbox] {
            DB::execute(self.inbox.pool(), format!("{} {table}", DB::EMPTY)).await?;
        }
        Ok(())
    }

    /// Makes the bench's tables: the inbox's, migrated, and the effects table.
    pub(crate) async fn create_tables(&self) -> Result<()> {
        self.inbox.migrate().await?;
        DB::create_effects(self.inbox.pool(), &self.tables.effects).await?;
        Ok(())
    }

    pub(crate) async fn drop_tables(&self) -> Result<()> {
        for table in &self.tables.all {
            DB::execute(self.inbox.pool(), format!("DROP TABLE IF EXISTS {table}")).await?;
        }
        Ok(())
    }
}
