//! `justonce bench`: how fast claims are on this database, beside what the same work costs
//! without justonce, as the key table grows, while a purge runs, and behind the webhook
//! receiver.
//!
//! Everything runs in tables of its own (`justonce_bench_<pid>_*`), dropped at the end. Each
//! throughput result checks, and prints, that effect rows equal distinct keys.
//!
//! The hand-written baselines that send `claim_many`'s statements by hand take their text
//! from `justonce_sql::statements`: one copy, the library's.

use crate::bench::Bench;
use crate::db::{BenchDb, BenchTables, CONSUMER};
use crate::modes::Mode;
use crate::report::Report;
use anyhow::{Context, Result};
use futures_util::future::BoxFuture;
use justonce_cli_support::database::DatabaseKind;
use justonce_cli_support::shutdown_signal;
use justonce_sql::sqlx::{MySql, Postgres, Sqlite};
use justonce_sql::{Consumer, Inbox, InboxOptions, Retention};
use std::sync::atomic::AtomicI64;
use std::time::Duration;

mod args;
mod bench;
mod capacity;
mod chart;
mod db;
mod modes;
mod receiver;
mod report;
mod sections;

pub use args::{Args, Section, Settings};

/// The distinct keys in one share (`INDEX/COUNT`, as `--share` takes it) of the bench's
/// stream of `messages` messages with `duplicates` percent repeated: the effect rows that
/// a throughput run of that share writes.
pub fn distinct_in_share(messages: usize, duplicates: usize, share: &str) -> Result<usize> {
    let share = args::share(share).map_err(anyhow::Error::msg)?;
    let (keys, _) = sections::stream(messages, duplicates);
    Ok(share.of(&keys).1)
}

/// Serves the receiver's router on the listener as `justonce serve` serves webhooks, so that
/// the service's own caps and timeouts are part of what the receiver section times; runs
/// until dropped.
pub type Serve = fn(tokio::net::TcpListener, axum::Router) -> BoxFuture<'static, ()>;

/// Runs the sections of `settings` on the database at `url`, the receiver's behind `serve`.
pub async fn run(url: &str, settings: &Settings, serve: Serve) -> Result<()> {
    match DatabaseKind::named_by(url, "--database")? {
        DatabaseKind::Sqlite => run_on::<Sqlite>(url, settings, serve).await,
        DatabaseKind::MySql => run_on::<MySql>(url, settings, serve).await,
        DatabaseKind::Postgres => run_on::<Postgres>(url, settings, serve).await,
    }
}

/// The bench on the database at `url`, in tables of its own that it drops at the end.
async fn run_on<DB: BenchDb>(url: &str, settings: &Settings, serve: Serve) -> Result<()> {
    let bench = open::<DB>(url, settings).await?;
    // Interrupted, the bench still drops its tables: a stopped section is not worth a
    // million rows left behind. Ctrl-C is caught from before the first table is made.
    let result = tokio::select! {
        result = async {
            bench.create_tables().await?;
            bench.sections(serve).await
        } => result,
        () = shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    // A second signal while dropping stops at once, and says what it leaves.
    let dropped = tokio::select! {
        dropped = bench.drop_tables() => dropped,
        () = shutdown_signal() => Err(anyhow::anyhow!(
            "interrupted again: the tables {}* are left",
            tables_prefix()
        )),
    };
    result?;
    dropped?;
    bench.report.memory();
    Ok(())
}

/// Messages per second through `claim_many` on the database at `url`, as the throughput
/// section measures it, once: `messages` messages, `duplicates` percent of them repeating
/// an earlier key, in batches of `batch`, each batch one transaction with one effect row
/// per first claim. It works in tables of its own and drops them. This is the database's
/// own limit for batched work, which other programs hold their batches against.
pub async fn claim_many_per_second(
    url: &str,
    messages: usize,
    duplicates: usize,
    batch: usize,
) -> Result<f64> {
    let settings = Settings::claim_many_once(messages, duplicates, batch)?;
    match DatabaseKind::named_by(url, "--database")? {
        DatabaseKind::Sqlite => claim_many_on::<Sqlite>(url, &settings, batch).await,
        DatabaseKind::MySql => claim_many_on::<MySql>(url, &settings, batch).await,
        DatabaseKind::Postgres => claim_many_on::<Postgres>(url, &settings, batch).await,
    }
}

async fn claim_many_on<DB: BenchDb>(url: &str, settings: &Settings, batch: usize) -> Result<f64> {
    let bench = open::<DB>(url, settings).await?;
    bench.create_tables().await?;
    let (keys, distinct) = sections::stream(settings.messages, settings.duplicates);
    let measured = bench.measure(Mode::ClaimMany(batch), &keys, distinct).await;
    bench.drop_tables().await?;
    let per_second = measured?.first().map(|&(_, per_second, _)| per_second);
    per_second.context("claim_many was not measured")
}

/// The bench's inbox on the database at `url`, connected: [`Bench::create_tables`] makes
/// its tables.
async fn open<'s, DB: BenchDb>(url: &str, settings: &'s Settings) -> Result<Bench<'s, DB>> {
    let prefix = tables_prefix();
    // A retry horizon of an hour lets the purge section purge keys a day old.
    let retention = Retention::new(Duration::from_secs(86_400), Duration::from_secs(3_600))?;
    let options = InboxOptions::default()
        .prefix(&prefix)
        .retention(retention)
        .share_commits(settings.share_commits);
    let inbox = Inbox::<DB>::connect_with(url, Consumer::new(CONSUMER)?, options.clone())
        .await
        .context("opening the database")?;
    let tables = BenchTables::new(&prefix, DB::claim_many(&prefix)?);
    Ok(Bench {
        tables,
        inbox,
        options,
        hand_claim_ids: AtomicI64::new(1),
        settings,
        report: Report::new(settings.json, DB::LABEL),
    })
}

/// The prefix of the bench's tables: this process's own.
fn tables_prefix() -> String {
    format!("justonce_bench_{}_", std::process::id())
}
