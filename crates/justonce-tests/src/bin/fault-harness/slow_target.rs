//! `slow-target`: signed webhooks for two sources of `justonce serve`, the shipped binary,
//! each forwarding to a receiver of its own inside the harness. The `fast` receiver answers
//! at once. The `slow` one takes each request and does not answer within the source's
//! timeout (it would answer after an hour) until, well after the last event was posted, it
//! turns healthy and answers at once.
//!
//! The healthy target's deliveries must not wait behind the slow one's, the slow target's
//! breaker must hold its requests down while it does not answer, and every event must
//! reach its receiver under one key, the slow target's after it turned healthy.

use crate::broker::key_name;
use crate::report::{Report, latency_details, workload_index};
use crate::serve_kill::{Senders, Sent, Server, check, settle, source};
use crate::{Args, Rng};
use justonce_tests::{Answer, Sink, TestBackend};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The slow source's `timeout` (the default): a delivery the slow target does not answer
/// fails after it.
const SLOW_TIMEOUT: Duration = Duration::from_secs(10);

/// The server's `relay_lease`: a source's timeout is at most half of it.
const RELAY_LEASE: Duration = Duration::from_secs(2 * SLOW_TIMEOUT.as_secs());

/// How long the slow target keeps a request before it answers, until it turns healthy.
const NEVER: Duration = Duration::from_secs(3_600);

/// Senders posting at once.
const SENDERS: usize = 4;

/// The source event `index` is posted to: the even ones to `fast`, the odd ones to `slow`.
fn source_of(index: u32) -> &'static str {
    if index.is_multiple_of(2) {
        "fast"
    } else {
        "slow"
    }
}

/// The key the server forwards event `index` with.
fn event_key(index: u32) -> String {
    format!("{}:{}", source_of(index), key_name(index))
}

pub async fn slow_target<DB: TestBackend>(
    args: &Args,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let events = args.size(200, 2_000);
    let spread = Duration::from_secs(args.size(4, 30) as u64);
    // The breaker opens when the first deliveries time out, after 10 s. The slow target
    // turns healthy during its first pause (10 s) in the short run, its third (40 s) in the
    // long one.
    let slow_for = Duration::from_secs(args.size(15, 60) as u64);
    let deadline = Instant::now() + Duration::from_secs(args.size(120, 1200) as u64);
    let database =
        DB::create_database(&format!("harness_slow_target_{}", std::process::id())).await;
    let fast = Sink::start().await;
    let healthy = Arc::new(AtomicBool::new(false));
    let answers = Arc::clone(&healthy);
    let slow = Sink::scripted(Arc::new(move |_, _| {
        if answers.load(Ordering::Relaxed) {
            Answer::status(200)
        } else {
            Answer {
                delay: NEVER,
                ..Answer::status(200)
            }
        }
    }))
    .await;
    let sources = source("fast", &fast.url(), "")
        + &source(
            "slow",
            &slow.url(),
            &format!("timeout = \"{}s\"", SLOW_TIMEOUT.as_secs()),
        );
    let mut server = Server::with_settings(
        &database,
        &format!("relay_lease = \"{}s\"", RELAY_LEASE.as_secs()),
        &sources,
    )?;
    server.watch_relay();
    let (sent, turned) = match send_then_heal(
        events,
        spread,
        slow_for,
        deadline,
        rng,
        &mut server,
        &healthy,
    )
    .await
    {
        Ok((sent, turned)) => (Ok(sent), Some(turned)),
        Err(error) => (Err(error), None),
    };
    let (sent, received, stored) =
        settle::<DB>(&database, &[&fast, &slow], &mut server, sent, deadline).await?;
    let turned = turned.ok_or("when the slow target turned healthy")?;
    let mut report = check(title, events, &sent, &received, &stored, event_key);

    // The healthy target: from each event's first 2xx to its first arrival.
    let mut arrived: HashMap<u32, Instant> = HashMap::new();
    for request in fast.received() {
        if let Some(index) = workload_index(&request.body) {
            arrived.entry(index).or_insert(request.at);
        }
    }
    let latencies: Vec<Duration> = arrived
        .iter()
        .filter_map(|(index, at)| {
            let answered = sent
                .first_answered
                .get(*index as usize)
                .copied()
                .flatten()?;
            Some(at.saturating_duration_since(answered))
        })
        .collect();
    let slowest = latencies.iter().max().copied().unwrap_or_default();
    if slowest >= SLOW_TIMEOUT {
        report.breaches.push(format!(
            "a delivery to the healthy target took {} ms, as long as the slow target's timeout: it waited behind the slow one",
            slowest.as_millis()
        ));
    }

    // The slow target: held down by its breaker, then every event once healthy.
    let (before, after): (Vec<_>, Vec<_>) = slow
        .received()
        .into_iter()
        .partition(|request| request.at < turned);
    let slow_events = events / 2;
    let mut healed: Vec<u32> = after
        .iter()
        .filter_map(|request| workload_index(&request.body))
        .collect();
    healed.sort_unstable();
    healed.dedup();
    if healed.len() < slow_events {
        report.breaches.push(format!(
            "{} of the slow target's {slow_events} events did not reach it after it turned healthy",
            slow_events - healed.len()
        ));
    }
    let breaker = Breaker::read(&server.relay_log());
    if breaker.opened.contains_key("fast") {
        report
            .breaches
            .push("the healthy target's breaker opened".to_owned());
    }
    let pauses = breaker.opened.get("slow").map_or(0, Vec::len) as u64;
    report.faults = 1;
    report.recovery = after
        .iter()
        .map(|request| request.at - turned)
        .min()
        .into_iter()
        .collect();
    let mut details = vec![(
        "healthy target: events".to_owned(),
        (events - slow_events) as u64,
    )];
    details.extend(latency_details(
        "healthy target: from 2xx to arrival",
        &latencies,
    ));
    details.extend([
        ("slow target: events".to_owned(), slow_events as u64),
        (
            "slow target: sources.slow.timeout (ms)".to_owned(),
            SLOW_TIMEOUT.as_millis() as u64,
        ),
        (
            "slow target: did not answer for (ms)".to_owned(),
            slow_for.as_millis() as u64,
        ),
        (
            "slow target: requests while it did not answer".to_owned(),
            before.len() as u64,
        ),
        ("slow target: breaker pauses".to_owned(), pauses),
        (
            "slow target: requests per breaker pause".to_owned(),
            (before.len() as u64).div_ceil(pauses.max(1)),
        ),
        (
            "slow target: longest breaker pause (ms)".to_owned(),
            breaker
                .opened
                .get("slow")
                .and_then(|pauses| pauses.iter().max().copied())
                .unwrap_or(0),
        ),
        (
            "slow target: probes after a pause".to_owned(),
            breaker.probes.get("slow").copied().unwrap_or(0),
        ),
        (
            "slow target: requests after it turned healthy".to_owned(),
            after.len() as u64,
        ),
        (
            "slow target: events that reached it after it turned healthy".to_owned(),
            healed.len() as u64,
        ),
    ]);
    report.details.splice(0..0, details);
    Ok(report)
}

/// Starts the server and posts every event (spread over `spread`); once `slow_for` has
/// passed since the first, turns the slow target healthy. Returns what the senders saw and
/// when the slow target turned healthy.
async fn send_then_heal(
    events: usize,
    spread: Duration,
    slow_for: Duration,
    deadline: Instant,
    rng: &mut Rng,
    server: &mut Server,
    healthy: &AtomicBool,
) -> Result<(Sent, Instant), String> {
    server.start().await?;
    let started = Instant::now();
    let mut plan: Vec<u32> = (0..events as u32).collect();
    rng.shuffle(&mut plan);
    let hooks = vec![server.hooks_url("fast"), server.hooks_url("slow")];
    let senders = Senders::new(plan, events, hooks, Some(spread));
    let sent = senders.finish(senders.spawn(SENDERS, deadline)).await?;
    tokio::time::sleep_until((started + slow_for).into()).await;
    healthy.store(true, Ordering::Relaxed);
    Ok((sent, Instant::now()))
}

/// What the relay logged of its breakers, by destination.
#[derive(Default)]
struct Breaker {
    /// Each opening's pause in milliseconds.
    opened: HashMap<String, Vec<u64>>,
    /// Deliveries let through when a pause ended.
    probes: HashMap<String, u64>,
}

impl Breaker {
    fn read(log: &[String]) -> Self {
        let mut breaker = Self::default();
        for line in log {
            let Some(destination) = field(line, "destination") else {
                continue;
            };
            if line.contains("the destination keeps failing") {
                let pause = field(line, "pause_ms").and_then(|ms| ms.parse().ok());
                breaker
                    .opened
                    .entry(destination.to_owned())
                    .or_default()
                    .push(pause.unwrap_or(0));
            } else if line.contains("the breaker lets one delivery through") {
                *breaker.probes.entry(destination.to_owned()).or_default() += 1;
            }
        }
        breaker
    }
}

/// The value of field `name` in a log line (`name=value` or `name="value"`).
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let rest = line.split(&format!(" {name}=")).nth(1)?;
    Some(rest.split(' ').next()?.trim_matches('"'))
}
