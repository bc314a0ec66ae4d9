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
mod chart;
mod db;
mod modes;
mod receiver;
mod report;
mod sections;

pub use args::{Args, Section, Settings};

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
    let prefix = format!("justonce_bench_{}_", std::process::id());
    // A retry horizon of an hour lets the purge section purge keys a day old.
    let retention = Retention::new(Duration::from_secs(86_400), Duration::from_secs(3_600))?;
    let options = InboxOptions::default().prefix(&prefix).retention(retention);
    let inbox = Inbox::<DB>::connect_with(url, Consumer::new(CONSUMER)?, options.clone())
        .await
        .context("opening the database")?;
    inbox.migrate().await?;
    let bench = Bench {
        tables: BenchTables::new(&prefix, DB::claim_many(&prefix)?),
        inbox,
        options,
        hand_claim_ids: AtomicI64::new(1),
        settings,
        serve,
        report: Report::new(settings.json, DB::LABEL),
    };
    // Interrupted, the bench still drops its tables: a stopped section is not worth a
    // million rows left behind.
    let result = tokio::select! {
        result = bench.sections() => result,
        () = shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    // A second signal while dropping stops at once, and says what it leaves.
    let dropped = tokio::select! {
        dropped = bench.drop_tables() => dropped,
        () = shutdown_signal() => Err(anyhow::anyhow!(
            "interrupted again: the tables {prefix}* are left"
        )),
    };
    result?;
    dropped?;
    bench.report.memory();
    Ok(())
}
