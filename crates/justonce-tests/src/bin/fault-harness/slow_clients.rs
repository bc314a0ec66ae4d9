//! `slow-clients`: signed webhooks posted to `justonce serve`, the shipped binary, by
//! senders that retry each until it is answered 2xx, while hostile clients hold many
//! connections at once (a slowloris): each sends half a request's headers and then
//! nothing, and opens another as soon as the server closes it.
//!
//! The server must close every hostile connection within its header timeout, answer the
//! honest senders meanwhile, and forward each event to the receiver once, as in
//! `serve-kill`.

use crate::report::{Report, latency_details};
use crate::serve_kill::{Senders, Sent, Server, check, event_key, settle, source};
use crate::{Args, Rng};
use justonce_tests::{Sink, TestBackend};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The server's `header_timeout`.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a hostile client waits for the server to close its connection before it counts
/// the connection as held: the header timeout and a margin for a busy machine.
const HELD: Duration = Duration::from_secs(HEADER_TIMEOUT.as_secs() + 8);

/// What a hostile client sends: half a request's headers.
const HALF_REQUEST: &[u8] =
    b"POST /webhooks/demo HTTP/1.1\r\nHost: harness\r\nContent-Type: applica";

/// Honest senders posting at once.
const SENDERS: usize = 8;

pub async fn slow_clients<DB: TestBackend>(
    args: &Args,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let events = args.size(500, 5_000);
    let at_once = args.size(200, 1_000);
    // The honest sends are spread over several header timeouts, so that hostile
    // connections keep coming while they go.
    let spread = Duration::from_secs(args.size(6, 20) as u64);
    let deadline = Instant::now() + Duration::from_secs(args.size(120, 1200) as u64);
    let database =
        DB::create_database(&format!("harness_slow_clients_{}", std::process::id())).await;
    let sink = Sink::start().await;
    let mut server = Server::with_settings(
        &database,
        &format!("header_timeout = \"{}s\"", HEADER_TIMEOUT.as_secs()),
        &source("demo", &sink.url(), ""),
    )?;
    let (sent, attack) =
        match send_under_attack(events, at_once, spread, deadline, rng, &mut server).await {
            Ok((sent, attack)) => (Ok(sent), Some(attack)),
            Err(error) => (Err(error), None),
        };
    let (sent, received, stored) =
        settle::<DB>(&database, &[&sink], &mut server, sent, deadline).await?;
    let attack = attack.ok_or("the hostile clients' figures")?;
    let mut report = check(title, events, &sent, &received, &stored, event_key);
    report.faults = attack.opened;
    let closed: Vec<Duration> = attack.closes.iter().flatten().copied().collect();
    // A hostile connection is recovered from when the server closes it.
    report.recovery.clone_from(&closed);
    let held = attack.closes.len() - closed.len();
    if held > 0 {
        report.breaches.push(format!(
            "{held} hostile connections were held open past {} s",
            HELD.as_secs()
        ));
    }
    let refused = sent.answers.get("503").copied().unwrap_or(0);
    let mut details = vec![
        ("hostile connections at once".to_owned(), at_once as u64),
        (
            "hostile connections opened".to_owned(),
            attack.opened as u64,
        ),
        (
            "hostile connections closed by the server".to_owned(),
            closed.len() as u64,
        ),
        (
            "hostile connections the server did not accept".to_owned(),
            attack.not_connected,
        ),
        (
            "slowest close (ms)".to_owned(),
            closed.iter().max().map_or(0, |d| d.as_millis() as u64),
        ),
        (
            "server.header_timeout (ms)".to_owned(),
            HEADER_TIMEOUT.as_millis() as u64,
        ),
        ("honest requests".to_owned(), sent.latencies.len() as u64),
    ];
    details.extend(latency_details("honest latency", &sent.latencies));
    details.push(("honest requests refused (503)".to_owned(), refused));
    report.details.splice(0..0, details);
    Ok(report)
}

/// What the hostile clients saw.
struct Attack {
    /// Connections opened.
    opened: usize,
    /// Connections that could not be opened.
    not_connected: u64,
    /// How long each connection stayed open after it was opened, until the server closed
    /// it; `None` when it was still open after [`HELD`].
    closes: Vec<Option<Duration>>,
}

/// Starts the server, then `at_once` hostile clients, and posts every event (spread over
/// `spread`) while they go on; stops the hostile clients when every event was answered.
async fn send_under_attack(
    events: usize,
    at_once: usize,
    spread: Duration,
    deadline: Instant,
    rng: &mut Rng,
    server: &mut Server,
) -> Result<(Sent, Attack), String> {
    server.start().await?;
    let address = server.public.trim_start_matches("http://").to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let hostile: Vec<_> = (0..at_once)
        .map(|_| tokio::spawn(hold_open(address.clone(), Arc::clone(&stop))))
        .collect();
    let mut plan: Vec<u32> = (0..events as u32).collect();
    rng.shuffle(&mut plan);
    let senders = Senders::new(plan, events, vec![server.hooks_url("demo")], Some(spread));
    let sent = senders.finish(senders.spawn(SENDERS, deadline)).await;
    stop.store(true, Ordering::Relaxed);
    let mut attack = Attack {
        opened: 0,
        not_connected: 0,
        closes: Vec::new(),
    };
    for client in hostile {
        let (closes, not_connected) = client.await.map_err(|e| e.to_string())?;
        attack.opened += closes.len();
        attack.not_connected += not_connected;
        attack.closes.extend(closes);
    }
    Ok((sent?, attack))
}

/// One hostile client: opens a connection, sends half a request's headers, and waits for
/// the server to close it; then again, until `stop`. Returns how long each connection
/// stayed open (`None`: held past [`HELD`]) and how many could not be opened.
async fn hold_open(address: String, stop: Arc<AtomicBool>) -> (Vec<Option<Duration>>, u64) {
    let mut closes = Vec::new();
    let mut not_connected = 0;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut stream) = TcpStream::connect(&address).await else {
            not_connected += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let opened = Instant::now();
        let _ = stream.write_all(HALF_REQUEST).await;
        let mut buffer = [0; 1024];
        let closed = tokio::time::timeout(HELD, async {
            // Whatever the server answers (a 408, a 503), the connection must end.
            while let Ok(read) = stream.read(&mut buffer).await
                && read > 0
            {}
        })
        .await;
        closes.push(closed.ok().map(|()| opened.elapsed()));
    }
    (closes, not_connected)
}
