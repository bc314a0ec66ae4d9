//! Messages per second through the inbox, beside a hand-written client on the same driver.
//!
//! `inbox-throughput [--backend postgres|mysql|sqlite] [--messages N] [--duplicates PERCENT]
//! [--batch N] [--json]`
//!
//! One worker. Each mode processes the same generated stream (a share of it repeats earlier
//! keys) and writes one effect row per new key, then checks that effect rows equal
//! distinct keys:
//! - `hand-written`: BEGIN, INSERT … ON CONFLICT DO NOTHING, the effect, COMMIT;
//! - `run`: `Inbox::run`, one transaction per message; a duplicate of a key this process
//!   saw committed is answered from memory;
//! - `run-again`: the whole stream once more through the same inbox: every message a
//!   duplicate, answered from memory;
//! - `claim_many`: one transaction per batch.

use justonce_sql::{Claim, Consumer, Fingerprint, Key};
use justonce_tests::{StreamArgs, TestBackend, TestDb};
use std::time::Instant;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let Some(args) = StreamArgs::from_args(20_000, 1_000, &[]) else {
        eprintln!(
            "usage: inbox-throughput [--backend postgres|mysql|sqlite] [--messages N] \
             [--duplicates PERCENT] [--batch N] [--json]"
        );
        return std::process::ExitCode::from(2);
    };
    let results = justonce_tests::with_backend!(args.backend, DB => measure::<DB>(&args).await);
    for (mode, per_second, effects, distinct) in results {
        if args.json {
            println!(
                "{{\"bench\":\"inbox_throughput\",\"database\":\"{}\",\"mode\":\"{mode}\",\
                 \"messages\":{},\"duplicates_percent\":{},\"messages_per_second\":{per_second:.0},\
                 \"effects\":{effects},\"distinct_keys\":{distinct}}}",
                args.backend, args.messages, args.duplicates
            );
        } else {
            println!(
                "{:<10} {mode:<12} {per_second:>10.0} msg/s   effects {effects} = distinct keys {distinct}",
                args.backend
            );
        }
    }
    let rss = justonce_tests::peak_rss_mib(None);
    if args.json {
        println!(
            "{{\"bench\":\"inbox_throughput\",\"database\":\"{}\",\"peak_rss_mib\":{rss:.1}}}",
            args.backend
        );
    } else {
        println!("{:<10} peak RSS {rss:.1} MiB over all modes", args.backend);
    }
    std::process::ExitCode::SUCCESS
}

/// The stream: `messages` keys, of which `duplicates` percent repeat an earlier one.
fn stream(args: &StreamArgs) -> (Vec<Key>, usize) {
    let mut keys: Vec<Key> = Vec::with_capacity(args.messages);
    let mut distinct = 0;
    for n in 0..args.messages {
        if n > 0 && (n * 7919) % 100 < args.duplicates {
            keys.push(keys[(n * 104_729) % n].clone());
        } else {
            keys.push(Key::new(format!("message:{distinct}")).expect("key"));
            distinct += 1;
        }
    }
    (keys, distinct)
}

async fn measure<DB: TestBackend>(args: &StreamArgs) -> Vec<(&'static str, f64, i64, usize)> {
    let (keys, distinct) = stream(args);
    let mut results = Vec::new();
    for mode in ["hand-written", "run", "claim_many"] {
        let db = TestDb::<DB>::new("throughput").await;
        let inbox = db
            .inbox
            .with_consumer(Consumer::new("bench").expect("consumer"));
        let prefix = db.prefix.as_str();
        let started = Instant::now();
        match mode {
            "hand-written" => {
                for key in &keys {
                    let fingerprint = Fingerprint::of(key.as_str());
                    let mut tx = inbox.begin().await.expect("begin");
                    let new = DB::hand_claim(&mut tx, prefix, key.as_str(), fingerprint.as_bytes())
                        .await
                        .expect("claim");
                    if new {
                        DB::insert_effect(&mut tx, prefix, "bench", key.as_str())
                            .await
                            .expect("effect");
                    }
                    tx.commit().await.expect("commit");
                }
            }
            "run" => {
                run_all(&inbox, &keys, prefix).await;
                let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
                results.push((mode, per_second, db.rows("effects").await, distinct));
                let again = Instant::now();
                run_all(&inbox, &keys, prefix).await;
                let per_second = keys.len() as f64 / again.elapsed().as_secs_f64();
                results.push(("run-again", per_second, db.rows("effects").await, distinct));
                db.cleanup().await;
                continue;
            }
            _ => {
                for batch in keys.chunks(args.batch) {
                    let messages: Vec<(Key, &[u8])> = batch
                        .iter()
                        .map(|key| (key.clone(), key.as_str().as_bytes()))
                        .collect();
                    let mut tx = inbox.begin().await.expect("begin");
                    let claims = inbox
                        .claim_many(&mut tx, &messages)
                        .await
                        .expect("claim_many");
                    for ((key, _), claim) in messages.iter().zip(claims) {
                        if claim == Claim::First {
                            DB::insert_effect(&mut tx, prefix, "bench", key.as_str())
                                .await
                                .expect("effect");
                        }
                    }
                    tx.commit().await.expect("commit");
                }
            }
        }
        let per_second = keys.len() as f64 / started.elapsed().as_secs_f64();
        let effects = db.rows("effects").await;
        results.push((mode, per_second, effects, distinct));
        db.cleanup().await;
    }
    results
}

/// Every key through `Inbox::run`, each new one writing one effect row.
async fn run_all<DB: TestBackend>(inbox: &justonce_sql::Inbox<DB>, keys: &[Key], prefix: &str) {
    for key in keys {
        let _ = inbox
            .run(key, key.as_str().as_bytes(), |tx| {
                Box::pin(DB::insert_effect(tx, prefix, "bench", key.as_str()))
            })
            .await
            .expect("run");
    }
}
