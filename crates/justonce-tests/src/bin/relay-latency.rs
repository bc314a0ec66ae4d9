//! Measures the time from a committed outbox row to its arrival at an HTTP receiver on
//! loopback, through a relay that waits for notifications (PostgreSQL) or polls (SQLite).
//!
//! `relay-latency [--backend postgres|mysql|sqlite] [--messages N] [--json]`
//!
//! PostgreSQL is the one at `JUSTONCE_TEST_POSTGRES_URL`; SQLite a new file.
//!
//! Rows are committed one at a time, 5 ms apart, so that the figure is the wake-up and
//! delivery path rather than a queue. Prints p50, p99 and the maximum.

use justonce_http::HttpDestination;
use justonce_sql::{Key, Message, RelayOptions};
use justonce_tests::{RunningRelay, Sink, TestBackend, TestDb};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut backend, mut messages, mut json) = ("postgres".to_owned(), 500_usize, false);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--backend", Some(name)) if justonce_tests::BACKENDS.contains(&name.as_str()) => {
                backend = name
            }
            ("--messages", Some(n)) if n.parse::<usize>().is_ok_and(|n| n > 0) => {
                messages = n.parse().unwrap_or(messages)
            }
            ("--json", None) => json = true,
            _ => {
                eprintln!(
                    "usage: relay-latency [--backend postgres|mysql|sqlite] [--messages N] [--json]"
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    let figures = justonce_tests::with_backend!(backend, DB => measure::<DB>(messages).await);
    let [p50, p99, max] = figures.map(|d| d.as_secs_f64() * 1000.0);
    let name = justonce_tests::with_backend!(backend, DB => <DB as sqlx::Database>::NAME);
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

async fn measure<DB: TestBackend>(messages: usize) -> [Duration; 3] {
    let db = TestDb::<DB>::new("relay-latency").await;
    let sink = Sink::start().await;
    let relay = db
        .inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().poll_interval(Duration::from_millis(100)))
        .destination(
            "hooks",
            HttpDestination::new(&sink.url()).expect("receiver URL"),
        );
    let running = RunningRelay::start(relay);
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
