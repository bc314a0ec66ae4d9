//! The consumer the fault harness runs, kills and restarts: reads keys from standard input,
//! one a line, runs each through `Inbox::run` with one effect row as its work, and
//! acknowledges it on standard output once its transaction has committed.
//!
//! `harness-worker <database-url> <prefix> <mode> <lanes> <max-attempts>`
//!
//! `lanes` keys are in flight at once; `max-attempts` is `InboxOptions::max_attempts`. Lines written: `ready` once connected, then per key
//! `ack processed <key> <runs>` (`runs`: how many times the work ran), `ack duplicate <key>`,
//! or `nack <key> <reason>` (`commit-unknown` or `error`): not acknowledged, for the broker
//! to deliver again. `mode` is `correct`, or one of two deliberately broken variants that
//! the harness must catch: `ack-before-commit` (acknowledges, then runs the transaction) and
//! `separate-claim` (checks the key, commits the effect, then claims the key in a second
//! transaction).
//!
//! With `JUSTONCE_FAILPOINT=committed-not-acknowledged` in its environment, a `correct` worker
//! stops at its failpoint: the first key it processes is committed and never acknowledged; it
//! prints `paused committed-not-acknowledged` and waits to be killed. The other lanes go on.

use justonce_sql::{Consumer, Error, Inbox, InboxOptions, Key, Outcome, RunError};
use justonce_tests::{TestBackend, WORKER_FAILPOINT};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader, Lines, Stdin};
use tokio::sync::Mutex;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, prefix, mode, lanes, attempts] = args.as_slice() else {
        return usage();
    };
    let (Some(mode), Ok(lanes), Ok(attempts)) =
        (Mode::parse(mode), lanes.parse::<usize>(), attempts.parse())
    else {
        return usage();
    };
    let options = InboxOptions::default()
        .prefix(prefix)
        .max_attempts(attempts);
    let result = justonce_tests::with_backend!(url, DB => work::<DB>(url, options, prefix, mode, lanes).await);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("harness-worker: {error}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: harness-worker <database-url> <prefix> correct|ack-before-commit|separate-claim <lanes> <max-attempts>"
    );
    ExitCode::from(2)
}

#[derive(Clone, Copy)]
enum Mode {
    /// The claim, the effect and the commit in one `Inbox::run`; acknowledged after it.
    Correct,
    /// Deliberately wrong: the key is acknowledged before its transaction commits, so a
    /// crash in between loses it.
    BrokenAckBeforeCommit,
    /// Deliberately wrong: the key is looked up, the effect committed, and only then the key
    /// claimed in a transaction of its own, so a crash in between doubles the effect.
    BrokenSeparateClaim,
}

impl Mode {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "correct" => Some(Self::Correct),
            "ack-before-commit" => Some(Self::BrokenAckBeforeCommit),
            "separate-claim" => Some(Self::BrokenSeparateClaim),
            _ => None,
        }
    }
}

type Keys = Arc<Mutex<Lines<BufReader<Stdin>>>>;

async fn work<DB: TestBackend>(
    url: &str,
    options: InboxOptions,
    prefix: &str,
    mode: Mode,
    lanes: usize,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let inbox = connect::<DB>(url, options).await?;
    say("ready".to_owned());
    let keys: Keys = Arc::new(Mutex::new(BufReader::new(tokio::io::stdin()).lines()));
    let armed = matches!(mode, Mode::Correct)
        && std::env::var("JUSTONCE_FAILPOINT").is_ok_and(|name| name == WORKER_FAILPOINT);
    let armed = Arc::new(AtomicBool::new(armed));
    let mut running = tokio::task::JoinSet::new();
    for _ in 0..lanes.max(1) {
        let (inbox, keys, prefix) = (inbox.clone(), Arc::clone(&keys), prefix.to_owned());
        let armed = Arc::clone(&armed);
        running.spawn(async move { lane(inbox, keys, prefix, mode, &armed).await });
    }
    while let Some(done) = running.join_next().await {
        done??;
    }
    Ok(())
}

/// Connects, waiting out a database that is down: a worker restarted during an outage
/// keeps trying, as a deployed consumer would.
async fn connect<DB: TestBackend>(
    url: &str,
    options: InboxOptions,
) -> Result<Inbox<DB>, justonce_sql::Error> {
    let consumer = Consumer::new("test").expect("a valid consumer name");
    let mut tries = 0;
    loop {
        let connected = Inbox::<DB>::connect_with(url, consumer.clone(), options.clone()).await;
        match connected {
            Ok(inbox) => return Ok(inbox),
            Err(_) if tries < 600 => tries += 1,
            Err(error) => return Err(error),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Takes keys until standard input ends, one at a time; the first lane to process a key while
/// `armed` stops there for good.
async fn lane<DB: TestBackend>(
    inbox: Inbox<DB>,
    keys: Keys,
    prefix: String,
    mode: Mode,
    armed: &AtomicBool,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    loop {
        let Some(line) = keys.lock().await.next_line().await? else {
            return Ok(());
        };
        let key = Key::new(line.as_str())?;
        let answer = match mode {
            Mode::Correct => correct(&inbox, &prefix, &key).await,
            Mode::BrokenAckBeforeCommit => {
                say(format!("ack processed {key} 1"));
                // The outcome no longer matters to the broker: it was told already.
                let _ = correct(&inbox, &prefix, &key).await;
                continue;
            }
            Mode::BrokenSeparateClaim => broken_separate_claim(&inbox, &prefix, &key)
                .await
                .unwrap_or_else(|_| format!("nack {key} error")),
        };
        if answer.starts_with("ack processed") && armed.swap(false, Ordering::Relaxed) {
            say(format!("paused {WORKER_FAILPOINT}"));
            std::future::pending::<()>().await;
        }
        let refused = answer.starts_with("nack");
        say(answer);
        if refused {
            // Backs off, as a consumer does after a failure, rather than spin on a
            // database that is down.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The work as justonce means it: one transaction holds the claim and the effect, and the
/// key is acknowledged only once it has committed.
async fn correct<DB: TestBackend>(inbox: &Inbox<DB>, prefix: &str, key: &Key) -> String {
    let mut runs = 0;
    let outcome = inbox
        .run(key, key.as_str().as_bytes(), |tx| {
            runs += 1;
            Box::pin(DB::insert_effect(tx, prefix, "test", key.as_str()))
        })
        .await;
    match outcome {
        Ok(Outcome::Processed(())) => format!("ack processed {key} {runs}"),
        Ok(_) => format!("ack duplicate {key}"),
        Err(RunError::Store(Error::CommitUnknown { .. })) => {
            format!("nack {key} commit-unknown")
        }
        Err(_) => format!("nack {key} error"),
    }
}

/// The deliberately broken check-then-act: nothing ties the effect to the claim.
async fn broken_separate_claim<DB: TestBackend>(
    inbox: &Inbox<DB>,
    prefix: &str,
    key: &Key,
) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    if !justonce_tests::effect_unless_claimed(inbox, prefix, key.as_str()).await? {
        return Ok(format!("ack duplicate {key}"));
    }
    // Whatever the claim says now, the effect is already done.
    let _ = inbox
        .run(key, key.as_str().as_bytes(), |_| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await?;
    Ok(format!("ack processed {key} 1"))
}

fn say(line: String) {
    // One `println!` is one write of a whole line, so lanes never interleave.
    println!("{line}");
}
