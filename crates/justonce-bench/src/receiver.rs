//! The webhook receiver's section of `justonce bench`: the public router `justonce serve`
//! runs, on loopback, and a load generator in the same process posting signed events.
//!
//! Two loads, each on empty tables. Closed loop: `clients` connections each post their next
//! event when the last is answered, the most the receiver takes. Open loop: events start at
//! `rate` per second whatever the answers do, and each time to 2xx counts from the moment
//! its event was due, so a stall shows in the percentiles instead of slowing the sender.
//! Every answer must be `200 accepted`; then the store must hold one key and one outbox row
//! per event. No relay runs: delivering the rows onward is not part of the time to 2xx.
//!
//! With `--receiver-url`, the same loads go, unsigned, to another receiver instead, and
//! checking what it stored is left to whoever runs it: so a receiver written without
//! justonce is loaded exactly as `justonce serve` is. Several URLs take the events in turn.

use crate::Serve;
use crate::bench::Bench;
use crate::db::BenchDb;
use crate::modes::Load;
use anyhow::{Context, Result, bail, ensure};
use hmac::Mac;
use justonce_cli_support::progress::Progress;
use justonce_http::receiver::{IdLocation, Scheme, Source};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SOURCE: &str = "bench";
const SECRET: &[u8] = b"bench secret";
const SIGNATURE_HEADER: &str = "x-signature";
/// Open connections of the open loop at most; an event that waits for one still counts its
/// time to 2xx from when it was due.
const MAX_IN_FLIGHT: usize = 256;

impl<DB: BenchDb> Bench<'_, DB> {
    /// Accepted events per second and the time to 2xx, under each load.
    pub(crate) async fn receiver(&self, serve: Serve) -> Result<()> {
        // The relay's reqwest is built without a TLS provider of its own (the workspace
        // picks ring), and a client panics without one, even for plain HTTP.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let requests = self.settings.requests;
        for load in [
            Load::Clients(self.settings.clients),
            Load::Rate(self.settings.rate),
        ] {
            let mut progress = Progress::new();
            progress.update(format!("receiver: {requests} events {}", load.described()));
            if !self.settings.receiver_urls.is_empty() {
                let sender = Sender {
                    client: reqwest::Client::new(),
                    urls: self.settings.receiver_urls.clone().into(),
                    prefix: load.name(),
                    signed: false,
                };
                let (per_second, latencies) = self.send(&sender, load).await?;
                progress.finish();
                self.report
                    .receiver(load, requests, per_second, &latencies, false);
                continue;
            }
            self.empty().await?;
            let (per_second, latencies) = self.receive(serve, load).await?;
            progress.finish();
            let keys = DB::count(self.inbox.pool(), &self.tables.keys).await?;
            let rows = DB::count(self.inbox.pool(), &self.tables.outbox).await?;
            ensure!(
                keys == requests as i64 && rows == requests as i64,
                "receiver: {keys} keys and {rows} outbox rows for {requests} events"
            );
            self.report
                .receiver(load, requests, per_second, &latencies, true);
        }
        Ok(())
    }

    /// Serves the receiver on a loopback port with `serve` and sends it the events under
    /// `load`.
    async fn receive(&self, serve: Serve, load: Load) -> Result<(f64, Vec<Duration>)> {
        let scheme = Scheme::HmacSha256 {
            secrets: vec![SECRET.to_vec()],
            header: SIGNATURE_HEADER.to_owned(),
        };
        let source = Source::new(SOURCE, scheme, IdLocation::Json("/id".to_owned()))?;
        let app = justonce_http::receiver::router(&self.inbox, vec![source], 1 << 20);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("listening on loopback")?;
        let url = format!("http://{}/webhooks/{SOURCE}", listener.local_addr()?);
        // Stopped when this returns, or when an interrupted bench drops it before its tables.
        let _server = AbortOnDrop(tokio::spawn(serve(listener, app)));
        let sender = Sender {
            client: reqwest::Client::new(),
            urls: [url].into(),
            prefix: load.name(),
            signed: true,
        };
        self.send(&sender, load).await
    }

    async fn send(&self, sender: &Sender, load: Load) -> Result<(f64, Vec<Duration>)> {
        let requests = self.settings.requests;
        let started = Instant::now();
        let mut latencies = Vec::with_capacity(requests);
        match load {
            Load::Clients(clients) => {
                let senders = (0..clients).map(|client| async move {
                    let mut latencies = Vec::new();
                    for n in (client..requests).step_by(clients) {
                        let sent = Instant::now();
                        sender.post(n).await?;
                        latencies.push(sent.elapsed());
                    }
                    Ok::<_, anyhow::Error>(latencies)
                });
                for client in futures_util::future::join_all(senders).await {
                    latencies.extend(client?);
                }
            }
            Load::Rate(rate) => {
                let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
                let sender = Arc::new(sender.clone());
                let mut posts = tokio::task::JoinSet::new();
                for n in 0..requests {
                    let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
                    tokio::time::sleep_until(due.into()).await;
                    let permit = Arc::clone(&in_flight).acquire_owned().await?;
                    let sender = Arc::clone(&sender);
                    posts.spawn(async move {
                        sender.post(n).await?;
                        drop(permit);
                        Ok::<_, anyhow::Error>(due.elapsed())
                    });
                    // A refused event stops the run now, not after the whole schedule.
                    while let Some(latency) = posts.try_join_next() {
                        latencies.push(latency??);
                    }
                }
                while let Some(latency) = posts.join_next().await {
                    latencies.push(latency??);
                }
            }
        }
        let per_second = requests as f64 / started.elapsed().as_secs_f64();
        Ok((per_second, latencies))
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Posts events to the receiver.
#[derive(Clone)]
struct Sender {
    client: reqwest::Client,
    /// Event `n` goes to the `n`th URL, in turn.
    urls: Arc<[String]>,
    prefix: &'static str,
    /// Whether the events carry their signature, for the bench's own receiver.
    signed: bool,
}

impl Sender {
    /// Posts event `n` and checks that it was accepted.
    async fn post(&self, n: usize) -> Result<()> {
        let body = format!(r#"{{"id":"{}-{n}","amount":{n}}}"#, self.prefix);
        let mut request = self
            .client
            .post(&self.urls[n % self.urls.len()])
            .header("content-type", "application/json");
        if self.signed {
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET)
                .expect("HMAC takes a key of any length");
            mac.update(body.as_bytes());
            let signature: String = mac
                .finalize()
                .into_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            request = request.header(SIGNATURE_HEADER, signature);
        }
        let response = request
            .body(body)
            .send()
            .await
            .context("posting to the receiver")?;
        let status = response.status();
        let answer = response.text().await.context("reading the answer")?;
        if status != 200 || !answer.contains("accepted") {
            bail!("the receiver answered {status}: {answer}");
        }
        Ok(())
    }
}
