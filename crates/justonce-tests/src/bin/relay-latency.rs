//! Measures the time from a committed outbox row to its arrival at an HTTP receiver on
//! loopback, through a relay that waits for notifications (PostgreSQL) or polls (SQLite).
//!
//! `relay-latency [--backend postgres|mysql|sqlite] [--messages N] [--burst] [--json]`
//!
//! PostgreSQL is the one at `JUSTONCE_TEST_POSTGRES_URL`; SQLite a new file.
//!
//! Rows are committed one at a time, 5 ms apart, so that the figure is the wake-up and
//! delivery path rather than a queue. Prints p50, p99 and the maximum.
//!
//! With `--burst`, every row is committed before the relay starts, and the figure is the
//! relay's throughput: deliveries recorded per second until the last one arrived.

use justonce_http::HttpDestination;
use justonce_sql::{Key, Message, RelayOptions};
use justonce_tests::{RunningRelay, Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut backend, mut messages, mut json, mut burst) =
        ("postgres".to_owned(), 500_usize, false, false);
    while let Some(arg) = args.next() {
        // Flags take no value: only the options read the next argument.
        let value = match arg.as_str() {
            "--backend" | "--messages" => args.next(),
            _ => None,
        };
        match (arg.as_str(), value) {
            ("--backend", Some(name)) if justonce_tests::BACKENDS.contains(&name.as_str()) => {
                backend = name
            }
            ("--messages", Some(n)) if n.parse::<usize>().is_ok_and(|n| n > 0) => {
                messages = n.parse().unwrap_or(messages)
            }
            ("--json", None) => json = true,
            ("--burst", None) => burst = true,
            _ => {
                eprintln!(
                    "usage: relay-latency [--backend postgres|mysql|sqlite] [--messages N] [--burst] [--json]"
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    let name = justonce_tests::with_backend!(backend, DB => <DB as sqlx::Database>::NAME);
    if burst {
        let elapsed =
            justonce_tests::with_backend!(backend, DB => measure_burst::<DB>(messages).await);
        let per_second = messages as f64 / elapsed.as_secs_f64();
        let rss = justonce_tests::peak_rss_mib(None);
        if json {
            println!(
                "{{\"bench\":\"relay_burst\",\"database\":\"{name}\",\"messages\":{messages},\
                 \"deliveries_per_second\":{per_second:.1},\"peak_rss_mib\":{rss:.1}}}"
            );
        } else {
            println!("relay throughput, {name}, {messages} rows committed before it starts");
            println!(
                "  {per_second:8.1} deliveries/s ({:.2} s)",
                elapsed.as_secs_f64()
            );
            println!("  peak RSS {rss:.1} MiB (relay, writer and receiver)");
        }
        return std::process::ExitCode::SUCCESS;
    }
    let figures = justonce_tests::with_backend!(backend, DB => measure::<DB>(messages).await);
    let [p50, p99, max] = figures.map(|d| d.as_secs_f64() * 1000.0);
    let rss = justonce_tests::peak_rss_mib(None);
    if json {
        println!(
            "{{\"bench\":\"relay_latency\",\"database\":\"{name}\",\"messages\":{messages},\
             \"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3},\"max_ms\":{max:.3},\"peak_rss_mib\":{rss:.1}}}"
        );
    } else {
        println!("commit to receiver, {name}, {messages} messages 5 ms apart");
        println!("  p50 {p50:8.2} ms\n  p99 {p99:8.2} ms\n  max {max:8.2} ms");
        println!("  peak RSS {rss:.1} MiB (relay, writer and receiver)");
    }
    std::process::ExitCode::SUCCESS
}

/// The relay of this program: one HTTP destination, `hooks`, polled every 100 ms.
fn relay<DB: TestBackend>(db: &TestDb<DB>, sink: &Sink) -> justonce_sql::Relay<DB> {
    db.inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().poll_interval(Duration::from_millis(100)))
        .destination(
            "hooks",
            HttpDestination::new(&sink.url()).expect("receiver URL"),
        )
}

/// Commits `messages` rows, 100 a transaction, then starts the relay: how long it takes
/// until the receiver has every one and each is recorded as sent.
async fn measure_burst<DB: TestBackend>(messages: usize) -> Duration {
    let db = TestDb::<DB>::new("relay-burst").await;
    let sink = Sink::start().await;
    for first in (0..messages).step_by(100) {
        let mut tx = db.inbox.begin().await.expect("begin");
        for n in first..(first + 100).min(messages) {
            let key = Key::new(format!("burst:{n}")).expect("key");
            let message = Message::new("hooks", format!("message {n}"));
            db.inbox
                .enqueue(&mut tx, &key, "hook", message)
                .await
                .expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
    let started = Instant::now();
    let running = RunningRelay::start(relay(&db, &sink));
    while sink.received().len() < messages {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Stopping waits for the deliveries in flight to be recorded.
    running.stop().await;
    let elapsed = started.elapsed();
    let stats = db.inbox.outbox().stats().await.expect("stats");
    assert_eq!(stats.sent, messages as i64, "every row recorded as sent");
    db.cleanup().await;
    elapsed
}

async fn measure<DB: TestBackend>(messages: usize) -> [Duration; 3] {
    let db = TestDb::<DB>::new("relay-latency").await;
    let sink = Sink::start().await;
    let running = RunningRelay::start(relay(&db, &sink));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut committed = HashMap::new();
    for n in 0..messages {
        let key = Key::new(format!("latency:{n}")).expect("key");
        let mut tx = db.inbox.begin().await.expect("begin");
        let message = Message::new("hooks", format!("message {n}"));
        db.inbox
            .enqueue(&mut tx, &key, "hook", message)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
        committed.insert(
            db.inbox.identity(&key).derive("hook").to_string(),
            Instant::now(),
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while sink.received().len() < messages {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop().await;
    let mut latencies: Vec<Duration> = sink
        .received()
        .iter()
        .filter_map(|request| {
            let commit = committed.get(request.key.as_deref()?)?;
            Some(request.at.saturating_duration_since(*commit))
        })
        .collect();
    latencies.sort();
    db.cleanup().await;
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    [at(0.5), at(0.99), at(1.0)]
}
