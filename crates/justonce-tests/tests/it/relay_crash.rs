//! The relay process killed with SIGKILL, at random moments and between a receiver's
//! acceptance and the row being marked sent: every row reaches the receiver, and every
//! repeated request for a row carries the same key.

use super::Xorshift;
use justonce_sql::{Claim, Key, Message};
use justonce_tests::{Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

// The fault harness kills the relay ten times on every database
// (`harness::a_relay_killed_ten_times_*`); this longer run, twenty kills of 10,000 rows, is
// the same proof and runs on PostgreSQL alone.
mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_killed_twenty_times_delivers_every_row_with_one_key() {
        super::a_relay_killed_twenty_times_delivers_every_row_with_one_key::<sqlx::Postgres>(
            "a_relay_killed_twenty_times_delivers_every_row_with_one_key",
        )
        .await
    }
}

/// Outbox rows the killed relays must deliver.
const JOBS: usize = 10_000;

fn relay_worker<DB: TestBackend>(db: &TestDb<DB>, sink: &Sink, pause_after: u64) -> Child {
    Command::new(env!("CARGO_BIN_EXE_relay-worker"))
        .args([
            &db.url,
            &db.prefix,
            &sink.url(),
            "500",
            &pause_after.to_string(),
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start relay-worker")
}

async fn a_relay_killed_twenty_times_delivers_every_row_with_one_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let jobs = JOBS;
    for batch in (0..jobs).collect::<Vec<_>>().chunks(500) {
        let messages: Vec<(Key, Vec<u8>)> = batch
            .iter()
            .map(|n| {
                (
                    Key::new(format!("job:{n}")).unwrap(),
                    format!("job {n}").into_bytes(),
                )
            })
            .collect();
        let mut tx = db.inbox.begin().await.unwrap();
        let claims = db.inbox.claim_many(&mut tx, &messages).await.unwrap();
        for ((key, body), claim) in messages.iter().zip(claims) {
            assert_eq!(claim, Claim::First);
            let message = Message::new("hooks", body.clone());
            db.inbox
                .enqueue(&mut tx, key, "notify", message)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    assert_eq!(db.rows("outbox").await, jobs as i64);

    let sink = Sink::start().await;
    let mut random = Xorshift(0x5eed_1234_abcd_0001);
    for round in 0..20 {
        let mut relay = if round % 4 == 3 {
            // Killed after the receiver accepted a row, before the row is marked sent.
            let mut relay = relay_worker(&db, &sink, 1 + random.below(40));
            let stdout = relay.stdout.take().unwrap();
            let line = BufReader::new(stdout).lines().next_line().await.unwrap();
            assert_eq!(line.as_deref(), Some("paused after-send"));
            relay
        } else {
            let relay = relay_worker(&db, &sink, 0);
            tokio::time::sleep(Duration::from_millis(20 + random.below(200))).await;
            relay
        };
        relay.kill().await.expect("SIGKILL the relay");
    }
    let last = relay_worker(&db, &sink, 0);
    let output = tokio::time::timeout(Duration::from_secs(600), last.wait_with_output())
        .await
        .expect("the last relay hung")
        .unwrap();
    assert!(output.status.success());
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "drained");

    let mut bodies_by_key: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    let received = sink.received();
    for request in &received {
        let key = request
            .key
            .clone()
            .expect("every request has an Idempotency-Key");
        bodies_by_key
            .entry(key)
            .or_default()
            .push(request.body.clone());
    }
    assert_eq!(bodies_by_key.len(), jobs, "distinct keys at the receiver");
    assert!(
        bodies_by_key
            .values()
            .all(|bodies| bodies.iter().all(|b| *b == bodies[0])),
        "one key carried two different rows"
    );
    let unsent = DB::count(
        db.inbox.pool(),
        format!(
            "SELECT count(*) FROM {}outbox WHERE sent_at IS NULL OR dead",
            db.prefix
        ),
    )
    .await;
    assert_eq!(unsent, 0);
    println!(
        "{}: {} rows, {} requests, {} repeated",
        DB::NAME,
        jobs,
        received.len(),
        received.len() - jobs
    );
    db.cleanup().await;
}

/// Two relay processes drain one PostgreSQL outbox side by side: every row arrives, and a
/// row that arrives twice carries the same key both times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relay_processes_share_one_outbox_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("two-relays").await;
    let jobs = 3_000;
    let mut tx = db.inbox.begin().await.unwrap();
    for n in 0..jobs {
        let key = Key::new(format!("job:{n}")).unwrap();
        let message = Message::new("hooks", format!("job {n}"));
        db.inbox
            .enqueue(&mut tx, &key, "notify", message)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let sink = Sink::start().await;
    let relays = [relay_worker(&db, &sink, 0), relay_worker(&db, &sink, 0)];
    for relay in relays {
        let output = tokio::time::timeout(Duration::from_secs(300), relay.wait_with_output())
            .await
            .expect("a relay hung")
            .unwrap();
        assert!(output.status.success());
    }
    let received = sink.received();
    let mut bodies_by_key: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for request in &received {
        bodies_by_key
            .entry(request.key.clone().unwrap())
            .or_default()
            .push(request.body.clone());
    }
    assert_eq!(bodies_by_key.len(), jobs);
    assert!(
        bodies_by_key
            .values()
            .all(|bodies| bodies.iter().all(|b| *b == bodies[0]))
    );
    let repeated = received.len() - jobs;
    println!(
        "two relay processes: {jobs} rows, {} requests, duplicate rate {:.2}%",
        received.len(),
        100.0 * repeated as f64 / jobs as f64
    );
    db.cleanup().await;
}
