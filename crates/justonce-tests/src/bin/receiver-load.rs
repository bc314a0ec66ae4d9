//! Accepted webhooks per second, and the time to the 2xx, for the receiver on loopback.
//!
//! `receiver-load [--backend postgres|sqlite] [--requests N] [--clients N] [--json]`
//!
//! The receiver (`POST /webhooks/{source}`, hmac-sha256, id in the body) and the load
//! generator run in this process: `clients` connections each post distinct signed events
//! back to back. Every answer must be 200 "accepted"; the program then checks that the
//! store holds one key per event.

use hmac::Mac;
use justonce_http::receiver::{IdLocation, Scheme, Source, router};
use justonce_sql::Backend;
use justonce_tests::{TestBackend, TestDb};
use sqlx::{Postgres, Sqlite};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"load secret";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut backend, mut requests, mut clients, mut json) =
        ("postgres".to_owned(), 5_000, 16, false);
    while let Some(flag) = args.next() {
        let number = |value: Option<String>| {
            value
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|n| *n > 0)
        };
        match flag.as_str() {
            "--backend" => match args.next() {
                Some(name) if name == "postgres" || name == "sqlite" => backend = name,
                _ => return usage(),
            },
            "--requests" => match number(args.next()) {
                Some(n) => requests = n,
                None => return usage(),
            },
            "--clients" => match number(args.next()) {
                Some(n) => clients = n,
                None => return usage(),
            },
            "--json" => json = true,
            _ => return usage(),
        }
    }
    let (per_second, p50, p99) = if backend == "sqlite" {
        load::<Sqlite>(requests, clients).await
    } else {
        load::<Postgres>(requests, clients).await
    };
    let (p50, p99) = (p50.as_secs_f64() * 1000.0, p99.as_secs_f64() * 1000.0);
    if json {
        println!(
            "{{\"bench\":\"receiver_load\",\"database\":\"{backend}\",\"requests\":{requests},\
             \"clients\":{clients},\"accepted_per_second\":{per_second:.0},\"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3}}}"
        );
    } else {
        println!("receiver on {backend}, {requests} events from {clients} clients");
        println!(
            "  {per_second:8.0} accepted/s\n  p50 {p50:7.2} ms to 2xx\n  p99 {p99:7.2} ms to 2xx"
        );
    }
    std::process::ExitCode::SUCCESS
}

fn usage() -> std::process::ExitCode {
    eprintln!(
        "usage: receiver-load [--backend postgres|sqlite] [--requests N] [--clients N] [--json]"
    );
    std::process::ExitCode::from(2)
}

fn signed(body: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET).expect("any key length");
    mac.update(body.as_bytes());
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn load<DB: TestBackend + Backend>(
    requests: usize,
    clients: usize,
) -> (f64, Duration, Duration) {
    let db = TestDb::<DB>::new("receiver-load").await;
    let scheme = Scheme::HmacSha256 {
        secrets: vec![SECRET.to_vec()],
        header: "x-signature".to_owned(),
    };
    let source = Source::new("load", scheme, IdLocation::Json("/id".to_owned())).expect("source");
    let app = router(&db.inbox, vec![source], 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/webhooks/load",
        listener.local_addr().expect("address")
    );
    tokio::spawn(async move { axum::serve(listener, app).await });

    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let workers: Vec<_> = (0..clients)
        .map(|worker| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for n in (worker..requests).step_by(clients) {
                    let body = format!(r#"{{"id":"evt_{n}","amount":{n}}}"#);
                    let sent = Instant::now();
                    let response = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .header("x-signature", signed(&body))
                        .body(body)
                        .send()
                        .await
                        .expect("the receiver answers");
                    assert_eq!(response.status(), 200);
                    let answer = response.text().await.expect("an answer");
                    assert!(answer.contains("accepted"), "{answer}");
                    latencies.push(sent.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests);
    for worker in workers {
        latencies.extend(worker.await.expect("a client"));
    }
    let per_second = requests as f64 / started.elapsed().as_secs_f64();
    assert_eq!(db.rows("keys").await, requests as i64, "one key per event");
    db.cleanup().await;
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    (per_second, at(0.5), at(0.99))
}
