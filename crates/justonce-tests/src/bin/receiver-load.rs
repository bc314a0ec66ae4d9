//! Accepted webhooks per second, and the time to the 2xx, for the receiver on loopback.
//!
//! `receiver-load [--backend postgres|mysql|sqlite] [--requests N] [--clients N | --rate R] [--json]`
//!
//! The receiver (`POST /webhooks/{source}`, hmac-sha256, id in the body) and the load
//! generator run in this process. By default `clients` connections each post distinct
//! signed events back to back (closed loop: the most the receiver takes). With `--rate`,
//! events start at R per second whatever the answers do (open loop), and each time to 2xx
//! counts from the moment its event was due, so a stall shows in the percentiles instead
//! of slowing the sender down. Every answer must be 200 "accepted"; the program then checks
//! that the store holds one key per event.

use hmac::Mac;
use justonce_http::receiver::{IdLocation, Scheme, Source, router};
use justonce_sql::Backend;
use justonce_tests::{TestBackend, TestDb};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"load secret";
const MAX_IN_FLIGHT: usize = 256;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut backend, mut requests, mut clients, mut json) =
        ("postgres".to_owned(), 5_000, 16, false);
    let mut rate = None;
    while let Some(flag) = args.next() {
        let number = |value: Option<String>| {
            value
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|n| *n > 0)
        };
        match flag.as_str() {
            "--backend" => match args.next() {
                Some(name) if justonce_tests::BACKENDS.contains(&name.as_str()) => backend = name,
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
            "--rate" => match number(args.next()) {
                Some(n) => rate = Some(n),
                None => return usage(),
            },
            "--json" => json = true,
            _ => return usage(),
        }
    }
    let load = match rate {
        Some(rate) => Load::Rate(rate),
        None => Load::Clients(clients),
    };
    let (per_second, p50, p99) =
        justonce_tests::with_backend!(backend, DB => run::<DB>(requests, load).await);
    let (p50, p99) = (p50.as_secs_f64() * 1000.0, p99.as_secs_f64() * 1000.0);
    let rss = justonce_tests::peak_rss_mib(None);
    let (load_name, load_value, load_text) = match load {
        Load::Clients(n) => ("clients", n, format!("from {n} clients")),
        Load::Rate(r) => ("rate", r, format!("started at {r}/s")),
    };
    if json {
        println!(
            "{{\"bench\":\"receiver_load\",\"database\":\"{backend}\",\"requests\":{requests},\
             \"{load_name}\":{load_value},\"accepted_per_second\":{per_second:.0},\"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3},\"peak_rss_mib\":{rss:.1}}}"
        );
    } else {
        println!("receiver on {backend}, {requests} events {load_text}");
        println!(
            "  {per_second:8.0} accepted/s\n  p50 {p50:7.2} ms to 2xx\n  p99 {p99:7.2} ms to 2xx\n  \
             peak RSS {rss:.1} MiB (server and load generator)"
        );
    }
    std::process::ExitCode::SUCCESS
}

fn usage() -> std::process::ExitCode {
    eprintln!(
        "usage: receiver-load [--backend postgres|mysql|sqlite] [--requests N] [--clients N | --rate R] [--json]"
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

#[derive(Clone, Copy)]
enum Load {
    /// This many connections, each posting its next event when the last is answered.
    Clients(usize),
    /// Events started at this many per second.
    Rate(usize),
}

async fn run<DB: TestBackend + Backend>(requests: usize, load: Load) -> (f64, Duration, Duration) {
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
    let mut latencies = Vec::with_capacity(requests);
    match load {
        Load::Clients(clients) => {
            let workers: Vec<_> = (0..clients)
                .map(|worker| {
                    let (client, url) = (client.clone(), url.clone());
                    tokio::spawn(async move {
                        let mut latencies = Vec::new();
                        for n in (worker..requests).step_by(clients) {
                            let sent = Instant::now();
                            post(&client, &url, n).await;
                            latencies.push(sent.elapsed());
                        }
                        latencies
                    })
                })
                .collect();
            for worker in workers {
                latencies.extend(worker.await.expect("a client"));
            }
        }
        Load::Rate(rate) => {
            // Bounds the open connections; an event that waits for one still counts its
            // time to 2xx from when it was due.
            let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
            let mut posts = tokio::task::JoinSet::new();
            for n in 0..requests {
                let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
                tokio::time::sleep_until(due.into()).await;
                let permit = in_flight
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
                let (client, url) = (client.clone(), url.clone());
                posts.spawn(async move {
                    post(&client, &url, n).await;
                    drop(permit);
                    due.elapsed()
                });
            }
            while let Some(latency) = posts.join_next().await {
                latencies.push(latency.expect("a post"));
            }
        }
    }
    let per_second = requests as f64 / started.elapsed().as_secs_f64();
    assert_eq!(db.rows("keys").await, requests as i64, "one key per event");
    db.cleanup().await;
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    (per_second, at(0.5), at(0.99))
}

/// Posts event `n` and checks that it was accepted.
async fn post(client: &reqwest::Client, url: &str, n: usize) {
    let body = format!(r#"{{"id":"evt_{n}","amount":{n}}}"#);
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .header("x-signature", signed(&body))
        .body(body)
        .send()
        .await
        .expect("the receiver answers");
    assert_eq!(response.status(), 200);
    let answer = response.text().await.expect("an answer");
    assert!(answer.contains("accepted"), "{answer}");
}
