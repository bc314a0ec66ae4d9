//! `relay-kill`: outbox rows delivered by the project's relay, a `relay-worker` process
//! sending to an HTTP receiver inside the harness, SIGKILLed at random moments and at its
//! failpoint (the receiver has accepted a row, the row is not yet marked sent), and started
//! again, until every row is marked sent.
//!
//! The relay is at least once: the check is that every row reaches the receiver, and that
//! every request for a row carries the same key, so that a receiver acting once per
//! `Idempotency-Key` acts once.

use crate::broker::{failpoint_line, key_name, sibling};
use crate::report::{Report, receiver_effects};
use crate::{Args, Rng};
use justonce_sql::{Key, Message};
use justonce_tests::{Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// The step the rows are written for: their key is the workload key's derived key for it.
const STEP: &str = "notify";

pub async fn relay_kill<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let rows = args.size(2_000, 20_000);
    let kills = args.size(10, 100);
    let deadline = Instant::now() + Duration::from_secs(args.size(120, 1200) as u64);
    write_rows(db, rows).await?;
    let sink = Sink::start().await;

    // Kill points: after random numbers of requests received, well inside the run so that there
    // is work left to recover to. Every fourth kill is at the failpoint instead.
    let mut points: Vec<usize> = (0..kills)
        .map(|_| rows / 20 + rng.below(rows as u64 * 16 / 20) as usize)
        .collect();
    points.sort_unstable();
    let mut killed_at = Vec::new();
    let mut at_failpoint = 0;
    for (n, point) in points.into_iter().enumerate() {
        if Instant::now() >= deadline {
            break;
        }
        if n % 4 == 3 {
            let mut relay = start(db, &sink, 1 + rng.below(40), &args.mode)?;
            let stdout = relay.stdout.take().ok_or("relay-worker's output")?;
            match failpoint_line(stdout, "relay-worker").await?.as_deref() {
                Some("paused after-send") => {}
                // Fewer rows left than the pause asked for: the relay drained and exited.
                Some("drained") => continue,
                other => {
                    return Err(format!(
                        "relay-worker stopped before its failpoint: {other:?}"
                    ));
                }
            }
            killed_at.push(kill(relay).await?);
            at_failpoint += 1;
        } else {
            let mut relay = start(db, &sink, 0, &args.mode)?;
            while sink.requests() < point && Instant::now() < deadline {
                if relay.try_wait().map_err(|e| e.to_string())?.is_some() {
                    return Err("relay-worker exited before its kill".to_owned());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
            killed_at.push(kill(relay).await?);
        }
    }

    // The last relay works until no row is left unsent.
    let last = start(db, &sink, 0, &args.mode)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let drained = match tokio::time::timeout(left, last.wait_with_output()).await {
        Ok(output) => {
            let output = output.map_err(|e| e.to_string())?;
            output.status.success() && String::from_utf8_lossy(&output.stdout).trim() == "drained"
        }
        // Dropping the timed-out wait kills the relay.
        Err(_) => false,
    };

    let received = sink.received();
    let derived = derived_keys(db, rows)?;
    let (effects, repeated) = receiver_effects(&received, |index| derived[index as usize].clone());
    let acknowledged = marked_sent(db, &derived).await?;
    let unsent = acknowledged.iter().filter(|sent| !**sent).count() as u64;
    let mut report = Report::compare(title, rows, &vec![true; rows], &acknowledged, effects);
    report.redeliveries = Some(repeated);
    report.faults = killed_at.len();
    report.recovery = killed_at
        .iter()
        .filter_map(|(began, dead)| {
            let next = received.iter().find(|request| request.at > *dead)?;
            Some(next.at - *began)
        })
        .collect();
    report.drained = drained;
    report.details = vec![
        (
            "kills at the failpoint (accepted, not yet marked sent)".to_owned(),
            at_failpoint,
        ),
        ("requests".to_owned(), received.len() as u64),
        ("rows left unsent or dead".to_owned(), unsent),
    ];
    Ok(report)
}

/// `rows` outbox rows for destination `hooks`, each keyed by the derived key of a workload
/// key, its name the body.
async fn write_rows<DB: TestBackend>(db: &TestDb<DB>, rows: usize) -> Result<(), String> {
    for chunk in (0..rows as u32).collect::<Vec<_>>().chunks(500) {
        let mut tx = db.inbox.begin().await.map_err(|e| e.to_string())?;
        for index in chunk {
            let key = Key::new(key_name(*index)).map_err(|e| e.to_string())?;
            let message = Message::new("hooks", key.as_str().to_owned());
            db.inbox
                .enqueue(&mut tx, &key, STEP, message)
                .await
                .map_err(|e| e.to_string())?;
        }
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A relay process, its leases 500 ms, paused after `pause_after` rows accepted (0: never),
/// deliberately broken in `mode` unless that is `correct`.
fn start<DB: TestBackend>(
    db: &TestDb<DB>,
    sink: &Sink,
    pause_after: u64,
    mode: &str,
) -> Result<Child, String> {
    Command::new(sibling("relay-worker"))
        .args([
            &db.url,
            &db.prefix,
            &sink.url(),
            "500",
            &pause_after.to_string(),
        ])
        .args((mode != "correct").then_some(mode))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start relay-worker: {e}"))
}

/// SIGKILLs the relay; when the kill was sent, and when the process was gone.
async fn kill(mut relay: Child) -> Result<(Instant, Instant), String> {
    let began = Instant::now();
    relay
        .kill()
        .await
        .map_err(|e| format!("cannot kill the relay: {e}"))?;
    Ok((began, Instant::now()))
}

/// The key each workload key's row is sent with: its derived key for the step.
fn derived_keys<DB: TestBackend>(db: &TestDb<DB>, rows: usize) -> Result<Vec<String>, String> {
    (0..rows as u32)
        .map(|index| {
            let key = Key::new(key_name(index)).map_err(|e| e.to_string())?;
            Ok(db.inbox.identity(&key).derive(STEP).as_str().to_owned())
        })
        .collect()
}

/// Whether each workload key's row, sent with its `derived` key, is marked sent, and not
/// dead.
async fn marked_sent<DB: TestBackend>(
    db: &TestDb<DB>,
    derived: &[String],
) -> Result<Vec<bool>, String> {
    let index_of: HashMap<&str, usize> = derived
        .iter()
        .enumerate()
        .map(|(index, key)| (key.as_str(), index))
        .collect();
    let sent = DB::texts(
        db.inbox.pool(),
        format!(
            "SELECT {} FROM {}outbox WHERE sent_at IS NOT NULL AND NOT dead",
            DB::quoted("key"),
            db.prefix
        ),
    )
    .await
    .map_err(|e| format!("cannot read the outbox: {e}"))?;
    let mut acknowledged = vec![false; derived.len()];
    for key in sent {
        let index = index_of
            .get(key.as_str())
            .ok_or_else(|| format!("the outbox holds a row the workload never wrote: {key}"))?;
        acknowledged[*index] = true;
    }
    Ok(acknowledged)
}
