//! A worker for the crash and multi-process tests: processes keys with `Inbox::run`, writing
//! one effect row per key, and can stop at a named point for its parent to kill it.
//!
//! `crash-worker <database-url> <prefix> <consumer> <pause-at> <key>...`
//!
//! `pause-at` is `after-claim` (the key is claimed, nothing else done), `after-effect` (the
//! effect row is written, not committed), `after-commit` (committed, the message not yet
//! acknowledged) or `never`; `go` pauses nowhere, but prints `ready` once connected and
//! waits for a line on standard input, so that a parent can start several workers at once. At that point the worker prints `paused at <point>` and waits
//! to be killed. Otherwise it prints `processed <key>`, `duplicate <key>` or
//! `reused <key>` for each key.

use justonce_sql::{Consumer, Inbox, InboxOptions, Key, Outcome};
use justonce_tests::TestBackend;
use std::io::Write;
use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, prefix, consumer, pause_at, keys @ ..] = args.as_slice() else {
        eprintln!("usage: crash-worker <database-url> <prefix> <consumer> <pause-at> <key>...");
        return ExitCode::from(2);
    };
    let result = justonce_tests::with_backend!(url, DB => work::<DB>(url, prefix, consumer, pause_at, keys).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("crash-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn work<DB: TestBackend>(
    url: &str,
    prefix: &str,
    consumer: &str,
    pause_at: &str,
    keys: &[String],
) -> Result<(), Box<dyn std::error::Error>> {
    let consumer = Consumer::new(consumer)?;
    let inbox = Inbox::<DB>::connect_with(
        url,
        consumer.clone(),
        InboxOptions::default().prefix(prefix),
    )
    .await?;
    if pause_at == "go" {
        inbox.check().await?;
        println!("ready");
        std::io::stdout().flush()?;
        std::io::stdin().read_line(&mut String::new())?;
    }
    for key in keys {
        let key = Key::new(key.as_str())?;
        let outcome = inbox
            .run(&key, key.as_str().as_bytes(), |tx| {
                Box::pin(async {
                    if pause_at == "after-claim" {
                        pause(pause_at).await;
                    }
                    DB::insert_effect(tx, prefix, consumer.as_str(), key.as_str()).await?;
                    if pause_at == "after-effect" {
                        pause(pause_at).await;
                    }
                    Ok::<_, sqlx::Error>(())
                })
            })
            .await?;
        if pause_at == "after-commit" {
            pause(pause_at).await;
        }
        let word = match outcome {
            Outcome::Processed(()) => "processed",
            Outcome::Duplicate => "duplicate",
            _ => "reused",
        };
        println!("{word} {key}");
    }
    Ok(())
}

/// Tells the parent where the worker stands, then waits for SIGKILL.
async fn pause(point: &str) {
    println!("paused at {point}");
    std::io::stdout().flush().expect("stdout");
    std::future::pending::<()>().await;
}
