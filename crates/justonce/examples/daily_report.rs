//! A job a timer starts: one report a day, however many ticks, and however many replicas
//! run the timer.
//!
//! ```sh
//! cargo run --example daily_report -- --database postgres://postgres@127.0.0.1/test --every 10s
//! ```
//!
//! Each tick keys its work by the day it falls on, `report:2026-12-02`, by the database's
//! clock so that replicas agree. The first tick of a day claims the key, writes the report
//! and an outbox row for its email, in one transaction. Every other tick that day changes
//! no row and sends nothing. Ctrl-C stops the timer.

use justonce::sqlx::{self, Postgres, Transaction};
use justonce::{Consumer, Inbox, Key, OutboxMessage, Outcome, RunError};
use std::future::Future;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mut database = "postgres://postgres@127.0.0.1/test".to_owned();
    let mut every = Duration::from_secs(10);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--database", Some(url)) => database = url,
            ("--every", Some(seconds)) => match seconds.trim_end_matches('s').parse() {
                Ok(seconds) if seconds > 0 => every = Duration::from_secs(seconds),
                _ => usage(),
            },
            _ => usage(),
        }
    }
    let inbox = open(&database).await?;
    let ticks = schedule(&inbox, every, tokio::signal::ctrl_c()).await?;
    println!(
        "{} reports written, {} ticks skipped",
        ticks.written, ticks.skipped
    );
    Ok(())
}

fn usage() -> ! {
    eprintln!("usage: daily_report [--database postgres://URL] [--every SECONDSs]");
    std::process::exit(2);
}

/// Connects, and creates justonce's tables and `daily_reports` unless they exist.
pub async fn open(database: &str) -> Result<Inbox<Postgres>, BoxError> {
    let inbox = Inbox::<Postgres>::connect(database, Consumer::new("daily-report")?).await?;
    inbox.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS daily_reports (day text NOT NULL, written_at timestamptz NOT NULL)")
        .execute(inbox.pool())
        .await?;
    Ok(inbox)
}

/// What the ticks of one [`schedule`] did.
#[derive(Debug, Default)]
pub struct Ticks {
    /// Ticks that wrote their day's report.
    pub written: u32,
    /// Ticks whose day's report was written before.
    pub skipped: u32,
}

/// Ticks `every` until `shutdown` completes; each tick writes the day's report unless a
/// tick (of this process or another) has written it.
pub async fn schedule(
    inbox: &Inbox<Postgres>,
    every: Duration,
    shutdown: impl Future,
) -> Result<Ticks, BoxError> {
    let mut timer = tokio::time::interval(every);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut ticks = Ticks::default();
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(ticks),
            _ = timer.tick() => {}
        }
        let day: String =
            sqlx::query_scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD')")
                .fetch_one(inbox.pool())
                .await?;
        match report(inbox, &day).await? {
            Outcome::Processed(()) => {
                println!("{day}: report written");
                ticks.written += 1;
            }
            Outcome::Duplicate | Outcome::KeyReused { .. } => {
                println!("{day}: written before, nothing to do");
                ticks.skipped += 1;
            }
        }
    }
}

/// Why a report was not written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The report's statement failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    /// The outbox row was not written.
    #[error(transparent)]
    Store(#[from] justonce::Error),
}

/// Writes the report of `day` once.
pub async fn report(
    inbox: &Inbox<Postgres>,
    day: &str,
) -> Result<Outcome<()>, RunError<ReportError>> {
    let key = Key::purpose(["report", day]).map_err(RunError::Store)?;
    inbox
        .run(&key, day.as_bytes(), |tx| {
            Box::pin(write_report(tx, inbox, &key, day))
        })
        .await
}

/// The effect, in the transaction that claims the day's key: the report, and its email
/// for the outbox relay to send with a key derived from the day's.
async fn write_report(
    tx: &mut Transaction<'_, Postgres>,
    inbox: &Inbox<Postgres>,
    key: &Key,
    day: &str,
) -> Result<(), ReportError> {
    sqlx::query("INSERT INTO daily_reports (day, written_at) VALUES ($1, now())")
        .bind(day)
        .execute(&mut **tx)
        .await?;
    let email = OutboxMessage::new("report-email", format!("The report of {day} is ready"));
    inbox.enqueue(tx, key, "email", email).await?;
    Ok(())
}
